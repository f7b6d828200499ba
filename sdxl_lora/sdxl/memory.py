"""Peak accelerator memory of an SDXL UNet LoRA/QLoRA run, estimated before it starts: weights by storage dtype,
adapter, gradients, optimizer state, activations (by resolution, batch and checkpointing) and a workspace.

Weights, adapter, gradients and optimizer state are counted exactly from the model's modules (on the meta
device too). Activations come from an analytic model of the UNet's config: every resnet and every
transformer layer saves a number of tensors the size of its feature map for backward; the counts below
are read off diffusers' blocks and then scaled by one factor fitted to the SDXL base's measured peaks
(bf16 autocast, SDPA, LoRA rank 16 on the attention projections, 1024x1024, AdamW:
benchmarks/RESULTS.md#qlora-memory; docs/qlora.md has the table). With gradient checkpointing only each
checkpointed unit's input stays, plus the activations of the one unit being recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..core.memory import CONTEXT, DTYPE_NAMES, GiB, OPTIMIZER_BYTES, RESERVE, state_bytes, weight_bytes

# ---- the activation model ------------------------------------------------------------------------
# Feature-map-sized tensors saved for backward, per element of a unit's output (a priori counts):
#   resnet: norm1 in, silu, conv1 out, norm2, silu, conv2 in                                      ~6
#   transformer layer (BasicTransformerBlock): 3 norms, q/k/v, self-attn out (+ logsumexp), to_out
#   in, cross q and out, GEGLU's 8x projection, gelu and product (4x each), residuals              ~30
#   Transformer2DModel around its layers: norm, proj_in, proj_out                                  ~4
K_RESNET, K_LAYER, K_PROJ = 6.0, 30.0, 4.0
# train.fused_geglu (eager blocks): the fused GEGLU keeps only its input, the 8x projection, and recomputes
# gelu(gate) in backward, so a layer no longer keeps the gelu's 4x output.
K_GEGLU_FUSED_SAVES = 4.0
# The other adapter kinds keep more for backward than LoRA's factors (DoRA's weight-normed path, LoHa's and
# LoKr's products; LoCon's convolution adapters keep their ResNets' inputs): their activations against LoRA's,
# from the kinds' runs through the CLI at batch 4 on SDXL base (benchmarks/RESULTS.md#adapter-kinds).
KIND_ACTIVATIONS = {"lora": 1.0, "dora": 1.19, "loha": 1.19, "lokr": 1.17}
LOCON_ACTIVATIONS = 1.26
# With model.quantize_convs="fp8" the two convolutions' inputs are not saved (Float8Conv2d's backward needs
# only the weight, dequantized again): 4 a resnet, counted with saved_tensors_hooks on a diffusers ResnetBlock2D
# under bf16 autocast; not fitted to a GPU peak (benchmarks/qlora_memory.py's fp8conv rows give one).
K_RESNET_FP8CONV = 4.0
# The tensors autocast keeps besides the counts above (bf16 copies of matmul inputs), as one factor on them.
# Fitted to the SDXL base's bf16 peaks at batch 1 and 4 (benchmarks/RESULTS.md#qlora-memory).
ACT_SCALE = 1.077
# With checkpointing each unit keeps its input (and the skip connections) in the compute dtype, besides the
# recompute of the largest unit. Fitted to the SDXL base with full checkpointing at batch 4
# (benchmarks/RESULTS.md#qlora-memory).
K_CKPT_INPUT = 1.61
# cuBLAS/cuDNN workspaces and allocator slack: what the bf16 batch-1 peak has beyond weights, adapter,
# gradients, optimizer state and activations (fitted with ACT_SCALE, benchmarks/RESULTS.md#qlora-memory).
WORKSPACE = int(0.14 * GiB)
# Quantized runs: bitsandbytes dequantizes each weight into a compute-dtype buffer for its matmuls
# (forward and backward) and the allocator keeps those blocks. Fitted to nf4 + checkpointing at batch 1
# (benchmarks/RESULTS.md#qlora-memory).
QUANT_OVERHEAD = int(0.14 * GiB)

# What quantized layers keep for backward beyond the activation model, as a fraction of it. The 4-bit
# layers return the autocast dtype (quantize._AutocastOutput), so they keep nothing extra; fp8 (Float8Linear)
# keeps nothing either. LLM.int8 keeps fp16 copies and outlier columns: fitted to benchmarks/qlora_memory.py's
# int8 rows without checkpointing (benchmarks/RESULTS.md#qlora-memory).
QUANT_SAVED_INPUTS = {"nf4": 0.0, "fp4": 0.0, "int8": 0.50, "fp8": 0.0}

# train.compile: what a compiled unit keeps of its eager activations (torch's partitioner recomputes cheap
# element-wise work instead of saving it), per kind of unit: fitted to the SDXL base's peaks with "regional"
# and "transformer" against eager ones, split between the layers and the ResNets by their share of the
# modelled activations (benchmarks/RESULTS.md#memory-estimates-against-measured-peaks). proj_in/proj_out are never
# inside a compiled block. train.compile_activation_budget F scales the compiled units' share by F, about
# what the partitioner keeps under that budget.
COMPILED_KEEP = {"layer": 0.723, "resnet": 0.154, "proj": 1.0}
# compile="regional" with channels_last: the trainer lays the ResNets' surroundings out too (docs/speed.md;
# the frozen convolutions then keep no input for backward), and the compiled units keep this fraction of the
# above. Fitted to the SDXL base's peaks with compile + graphs + channels_last at batch 4, 16 and 24
# (benchmarks/RESULTS.md#memory-estimates-against-measured-peaks).
REGIONAL_LAYOUT_KEEP = 0.930
COMPILED_KINDS = {"regional": ("layer", "resnet"), "transformer": ("layer",)}
# The trainer's own uncompiled step with a plain LoRA (train.fuse_qkv with lora_matmul="merged", the defaults)
# keeps less than the activation model counts, which was fitted to a bare peft step, and holds a little more
# besides (the merged weights, the CUDA graphs' workspace): a per-image factor on the activations and a fixed
# sum, fitted to the whole-process peaks of `sdxl-lora train` with the defaults at batch 1-16, kept a few
# percent above every one of them (benchmarks/RESULTS.md#memory-estimates-against-measured-peaks). Unquantized only:
# the quantized and other adapter kinds' steps were not measured this way and keep the model as it is.
MERGED_LORA_KEEP = 0.90
MERGED_LORA_FIXED = int(0.5 * GiB)


@dataclass
class MemoryEstimate:
    weights: dict[str, int] = field(default_factory=dict)   # storage ("nf4", "bf16", ...) -> bytes
    adapter: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    workspace: int = 0
    quant_overhead: int = 0
    quant_activations: int = 0   # inputs that bitsandbytes' matmuls save besides (QUANT_SAVED_INPUTS)
    # Context for the reader.
    resolution: int = 0
    batch_size: int = 0
    checkpointing: bool = False
    compile: str = "none"
    compile_activation_budget: float | None = None
    channels_last: bool = False
    quantize: str = "none"
    quantize_convs: str = "none"
    optimizer_name: str = "adamw"
    compute_dtype: str = "bf16"

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())

    @property
    def total(self) -> int:
        return (self.weights_total + self.adapter + self.gradients + self.optimizer + self.activations + self.workspace
                + self.quant_overhead + self.quant_activations)

    def as_dict(self) -> dict:
        g = lambda b: round(b / GiB, 3)  # noqa: E731
        return {"total_gib": g(self.total), "weights_gib": {k: g(v) for k, v in self.weights.items()},
                "adapter_gib": g(self.adapter), "gradients_gib": g(self.gradients),
                "optimizer_gib": g(self.optimizer), "activations_gib": g(self.activations),
                "workspace_gib": g(self.workspace), "quant_overhead_gib": g(self.quant_overhead),
                "quant_activations_gib": g(self.quant_activations),
                "resolution": self.resolution, "batch_size": self.batch_size,
                "gradient_checkpointing": self.checkpointing, "compile": self.compile,
                "compile_activation_budget": self.compile_activation_budget, "channels_last": self.channels_last,
                "quantize": self.quantize,
                "quantize_convs": self.quantize_convs,
                "optimizer": self.optimizer_name, "compute_dtype": self.compute_dtype}

    def format(self) -> str:
        w = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.weights.items())
        return "\n".join([
            f"memory estimate (UNet on the accelerator, {self.resolution}x{self.resolution}, batch {self.batch_size}, "
            f"{'checkpointing' if self.checkpointing else 'no checkpointing'}, "
            f"{'' if self.compile == 'none' else f'compile {self.compile}, '}"
            f"{'channels_last, ' if self.channels_last else ''}"
            f"{'' if self.compile_activation_budget is None else f'activation budget {self.compile_activation_budget:g}, '}"
            f"quantize {self.quantize}"
            f"{', fp8 convs' if self.quantize_convs == 'fp8' else ''}, "
            f"{self.optimizer_name}, compute {self.compute_dtype}):",
            f"  frozen weights {self.weights_total / GiB:7.2f} GiB  ({w})",
            f"  adapter (fp32) {self.adapter / GiB:7.2f} GiB",
            f"  gradients      {self.gradients / GiB:7.2f} GiB",
            f"  optimizer      {self.optimizer / GiB:7.2f} GiB",
            f"  activations    {self.activations / GiB:7.2f} GiB",
            f"  workspace      {self.workspace / GiB:7.2f} GiB",
            *([f"  dequant buffers{self.quant_overhead / GiB:7.2f} GiB"] if self.quant_overhead else []),
            *([f"  quant. inputs  {self.quant_activations / GiB:7.2f} GiB  (saved by bitsandbytes' matmuls)"]
              if self.quant_activations else []),
            f"  peak           {self.total / GiB:7.2f} GiB",
        ])


def _units(config, latent: int) -> list[tuple[str, int, int]]:
    """(kind, elements of its feature map per image, channels) for every resnet, transformer layer and
    Transformer2DModel of a diffusers UNet2DConditionModel config, at a square latent of side `latent`."""
    ch = list(config["block_out_channels"])
    n = len(ch)
    lpb = config["layers_per_block"]
    lpb = [lpb] * n if isinstance(lpb, int) else list(lpb)
    tl = config.get("transformer_layers_per_block", 1)
    tl = [tl] * n if isinstance(tl, int) else list(tl)
    units = []
    for lvl, kind in enumerate(config["down_block_types"]):
        p = (latent // 2**lvl) ** 2
        for _ in range(lpb[lvl]):
            units.append(("resnet", p * ch[lvl], ch[lvl]))
            if "CrossAttn" in kind:
                units.append(("proj", p * ch[lvl], ch[lvl]))
                units += [("layer", p * ch[lvl], ch[lvl])] * tl[lvl]
    deep = n - 1
    pm = (latent // 2**deep) ** 2
    units += [("resnet", pm * ch[deep], ch[deep])] * 2
    if config.get("mid_block_type", "UNetMidBlock2DCrossAttn") is not None:
        units.append(("proj", pm * ch[deep], ch[deep]))
        units += [("layer", pm * ch[deep], ch[deep])] * tl[deep]
    rtl = config.get("reverse_transformer_layers_per_block") or list(reversed(tl))
    for i, kind in enumerate(config["up_block_types"]):
        lvl = n - 1 - i
        p = (latent // 2**lvl) ** 2
        for _ in range(lpb[lvl] + 1):
            # the input is the upsampled stream and a skip connection, concatenated: ~1.5x the channels
            units.append(("resnet", int(1.5 * p * ch[lvl]), ch[lvl]))
            if "CrossAttn" in kind:
                units.append(("proj", p * ch[lvl], ch[lvl]))
                units += [("layer", p * ch[lvl], ch[lvl])] * rtl[i]
    return units


_K = {"resnet": K_RESNET, "layer": K_LAYER, "proj": K_PROJ}


def activation_bytes(config, resolution: int, batch_size: int, checkpointing: bool, compute_dtype: torch.dtype,
                     latent_factor: int = 8, quantize_convs: str = "none", compile: str = "none",
                     compile_activation_budget: float | None = None, channels_last: bool = False,
                     fused_geglu: bool = False, adapter_factor: float = 1.0) -> int:
    """Activations saved for backward at the peak, for one batch of square images of side `resolution`.
    With compile (and its activation budget) the compiled units keep less (COMPILED_KEEP; "regional" with
    channels_last less again, REGIONAL_LAYOUT_KEEP); compile together with checkpointing is counted as
    checkpointing alone (not fitted)."""
    elt = torch.empty((), dtype=compute_dtype).element_size()
    units = _units(config, max(1, resolution // latent_factor))
    counts = {**_K, "resnet": K_RESNET_FP8CONV} if quantize_convs == "fp8" else dict(_K)
    if fused_geglu and compile == "none":  # compiled blocks fuse it themselves (COMPILED_KEEP)
        counts["layer"] -= K_GEGLU_FUSED_SAVES
    if not checkpointing:
        compiled = COMPILED_KINDS.get(compile, ())
        layout = REGIONAL_LAYOUT_KEEP if compile == "regional" and channels_last else 1.0
        keep = {k: (COMPILED_KEEP[k] * layout * (compile_activation_budget or 1.0) if k in compiled else 1.0)
                for k in _K}
        per_image = ACT_SCALE * sum(counts[kind] * e * keep[kind] for kind, e, _ in units)
    else:
        # Inputs of every checkpointed unit (resnets and transformer layers), then the one unit being
        # recomputed in backward.
        kept = K_CKPT_INPUT * sum(e for k, e, _ in units if k != "proj")
        per_image = kept + ACT_SCALE * max(counts[kind] * e for kind, e, _ in units)
    return int(per_image * batch_size * elt * adapter_factor)


def estimate(unet: nn.Module, *, trainable_params: int, resolution: int, batch_size: int, checkpointing: bool,
             quantize: str = "none", double_quant: bool = True, compute_dtype: torch.dtype = torch.bfloat16,
             optimizer: str = "adamw", latent_factor: int = 8, skip=None,
             quantize_convs: str = "none", compile: str = "none",
             compile_activation_budget: float | None = None, channels_last: bool = False,
             fused_geglu: bool = False, adapter_factor: float = 1.0, merged_lora: bool = False) -> MemoryEstimate:
    """The estimate for a UNet (any device, meta included) and a planned adapter of `trainable_params`.
    adapter_factor: the adapter kind's activations against LoRA's (adapter_activations). merged_lora: the
    trainer's fused, merged plain-LoRA step (MERGED_LORA_KEEP), counted where it runs uncompiled and
    unquantized without checkpointing."""
    from .quantize import unet_conv_skip

    if skip is None and quantize != "none":
        from .quantize import unet_skip as skip
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"train.optimizer={optimizer!r}: no memory model for it; known: {', '.join(OPTIMIZER_BYTES)}")
    cuda_like = compute_dtype != torch.float32
    activations = activation_bytes(unet.config, resolution, batch_size, checkpointing, compute_dtype, latent_factor,
                                   quantize_convs, compile, compile_activation_budget, channels_last,
                                   fused_geglu, adapter_factor)
    lean = (merged_lora and cuda_like and compile == "none" and not checkpointing and quantize == "none"
            and quantize_convs == "none")
    if lean:
        activations = int(activations * MERGED_LORA_KEEP)
    overhead = 0
    if cuda_like and quantize != "none":
        overhead = QUANT_OVERHEAD
    elif cuda_like and quantize_convs == "fp8":
        # Only the convolutions dequantize: one weight at a time, the largest in the compute dtype.
        elt = torch.empty((), dtype=compute_dtype).element_size()
        overhead = max((m.weight.numel() * elt for m in unet.modules() if isinstance(m, nn.Conv2d)), default=0)
    return MemoryEstimate(
        weights=weight_bytes(unet, quantize, double_quant, compute_dtype, skip, quantize_convs, unet_conv_skip),
        **state_bytes(trainable_params, optimizer),
        activations=activations,
        quant_activations=int(QUANT_SAVED_INPUTS.get(quantize, 0.0) * activations),
        workspace=(WORKSPACE + (MERGED_LORA_FIXED if lean else 0)) if cuda_like else 0,
        quant_overhead=overhead,
        resolution=resolution, batch_size=batch_size, checkpointing=checkpointing, compile=compile,
        compile_activation_budget=compile_activation_budget if compile != "none" else None,
        channels_last=channels_last and compile == "regional" and not checkpointing, quantize=quantize,
        quantize_convs=quantize_convs,
        optimizer_name=optimizer, compute_dtype=DTYPE_NAMES.get(compute_dtype, str(compute_dtype)))


def estimate_for_config(unet: nn.Module, cfg, trainable_params: int, resolution: int,
                        mixed_precision: str | None = None, latent_factor: int = 8) -> MemoryEstimate:
    """The estimate for a run of this config. `mixed_precision` is what the run resolved ("no", "bf16",
    "fp16"); None reads train.mixed_precision, taking "auto" as bf16 (a GPU run)."""
    mp = mixed_precision or ("bf16" if cfg.train.mixed_precision == "auto" else cfg.train.mixed_precision)
    frozen = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mp, torch.float32)
    quant = cfg.model.quantize
    return estimate(unet, trainable_params=trainable_params, resolution=resolution,
                    batch_size=cfg.train.batch_size, checkpointing=cfg.train.gradient_checkpointing,
                    quantize=quant, double_quant=cfg.model.quant_double,
                    compute_dtype=frozen,  # of everything not quantized (the UNet is moved to it)
                    optimizer=cfg.train.optimizer, latent_factor=latent_factor,
                    quantize_convs=cfg.model.quantize_convs, compile=cfg.train.compile,
                    compile_activation_budget=cfg.train.compile_activation_budget,
                    channels_last=cfg.train.channels_last, fused_geglu=cfg.train.fused_geglu,
                    adapter_factor=adapter_activations(cfg.adapter),
                    merged_lora=runs_merged_lora(cfg))


def runs_merged_lora(cfg) -> bool:
    """The trainer's fused, merged plain-LoRA step (estimate's merged_lora): a LoRA without convolution
    adapters through train.fuse_qkv and lora_matmul="merged"."""
    return (cfg.adapter.kind == "lora" and adapter_activations(cfg.adapter) == 1.0 and cfg.train.fuse_qkv
            and cfg.train.lora_matmul == "merged")


def adapter_activations(adapter) -> float:
    """The adapter kind's (and LoCon's convolution adapters') activations against plain LoRA's."""
    locon = adapter.preset == "locon" or bool(adapter.conv_rank)
    return KIND_ACTIVATIONS.get(adapter.kind, 1.0) * (LOCON_ACTIVATIONS if locon else 1.0)


# ---- the whole run: each phase's peak, for the whole process ----------------------------------------
# The UNet's step is one phase of a run. Before it the VAE encodes the images and the text encoders the
# captions (caching); previews bring the text encoders and the VAE back beside the UNet and decode full-size
# images. These figures are the whole process's (what the GPU's own counters show): the CUDA context and
# the allocator's reserve included. Fitted to the full-size SDXL runs of benchmarks/train_e2e.py and
# benchmarks/preview_cost.py (benchmarks/RESULTS.md#memory-estimates-against-measured-peaks); VAE_DECODE_TILE is
# diffusers' tiled decode with tiles
# of this many pixels a side.
VAE_ENCODE_PER_PIXEL = 4800       # bytes per image pixel at the peak of an fp32 VAE encode
VAE_DECODE_PER_PIXEL = 5000       # bytes per image pixel at the peak of a VAE decode under bf16 autocast
UNET_INFER_PER_PIXEL = 600        # bytes per image pixel of the UNet's no-grad pass with guidance (batch 2)
VAE_DECODE_TILE = 512
TEXT_ACTIVATIONS = int(0.1 * GiB)  # the text encoders' no-grad pass over one caption
# Preview prompts of the same settings rendered in one pipeline call on a GPU (each image decoded on its own):
# with one call per image the eager UNet's launches can leave the GPU waiting on the host
# (benchmarks/preview_cost.py --batch times both ways). With tiled decoding (a run short of memory) one at a time.
PREVIEW_BATCH = 4


def preview_batch(vae_tiling: bool) -> int:
    """Preview prompts a GPU renders in one pipeline call (render's batch), as the estimate counts them."""
    return 1 if vae_tiling else PREVIEW_BATCH


@dataclass
class RunMemory:
    """The whole process's expected peak in each phase of a run (bytes), and the step's own estimate."""
    step: MemoryEstimate
    phases: dict[str, int]
    notes: list[str] = field(default_factory=list)
    # Previews render from 16-bit copies of this many bytes of a quantized base's layers, the smallest first
    # (counted in the previews phase): (copies, quantized layers) in number.
    dequantized_bytes: int = 0
    dequantized_layers: tuple[int, int] = (0, 0)

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def dequantized_previews(self) -> str:
        """Of the quantized layers, which previews render from 16-bit copies of: "all", "part" or "none"."""
        copies, layers = self.dequantized_layers
        return "none" if not copies else "all" if copies == layers else "part"

    def as_dict(self) -> dict:
        return {"peak_gib": round(self.peak / GiB, 3), "dequantized_previews": self.dequantized_previews,
                "dequantized_gib": round(self.dequantized_bytes / GiB, 3),
                "phases_gib": {k: round(v / GiB, 3) for k, v in self.phases.items()}}

    def format(self) -> str:
        lines = ["whole run (the process's peak in each phase, CUDA context included):"]
        lines += [f"  {name:<14} {b / GiB:7.2f} GiB" for name, b in self.phases.items()]
        lines.append(f"  peak           {self.peak / GiB:7.2f} GiB")
        return "\n".join(lines + [f"  ({n})" for n in self.notes])


def run_memory(step: MemoryEstimate, *, vae_bytes: int, text_bytes: int, largest_pixels: int,
               preview_pixels: int, previews: bool, vae_tiling: bool = False, previews_mid_run: bool = False,
               graphs: bool = False, encoders_stay: bool = False, vae_stays: bool = False,
               step_budget: int | None = None, tiled_encode: bool = False,
               unet_while_caching: bool = False, previews_after: bool = False, merged_copies: int = 0) -> RunMemory:
    """Each phase's whole-process peak from the step's estimate and the VAE's and text encoders' sizes as
    they are held (fp32). largest_pixels: the largest bucket's pixels (caching encodes one image at a time);
    preview_pixels: the largest preview's. previews_mid_run: previews also between steps (preview.every),
    when the optimizer state (and with CUDA graphs their memory pool, which other work cannot use) is held.
    previews_after: previews after the last step, beside the optimizer state (the graphs are released first).
    step_budget: train.checkpoint_budget_gb in bytes (the trainer checkpoints blocks until the step fits it).
    vae_tiling, tiled_encode: the VAE decodes (previews), encodes (caching) in VAE_DECODE_TILE tiles.
    unet_while_caching: the frozen UNet is on the device from the start (plan.py: unet_read_on_device).
    merged_copies: bytes of the adapted layers' frozen weights that previews merge the adapter into copies of
    (inject.merged_for_inference), held beside the UNet while a set renders."""
    def whole(allocated: float) -> int:
        return int(CONTEXT + RESERVE * allocated)

    encode_pixels = min(largest_pixels, VAE_DECODE_TILE ** 2) if tiled_encode else largest_pixels
    caching = vae_bytes + max(VAE_ENCODE_PER_PIXEL * encode_pixels, text_bytes + TEXT_ACTIVATIONS)
    if unet_while_caching:
        caching += step.weights_total
    held = (text_bytes if encoders_stay else 0) + (vae_bytes if vae_stays else 0)
    step_total = min(step.total, step_budget) if step_budget else step.total
    phases = {"caching": whole(caching), "training": whole(step_total + held)}
    if previews:
        decode_pixels = min(preview_pixels, VAE_DECODE_TILE ** 2) if vae_tiling else preview_pixels
        unet = step.weights_total + step.adapter + step.quant_overhead + merged_copies
        if previews_mid_run:
            unet += step.optimizer + (step.activations if graphs else 0)
        elif previews_after:
            unet += step.optimizer
        render = max(UNET_INFER_PER_PIXEL * preview_pixels * preview_batch(vae_tiling),
                     VAE_DECODE_PER_PIXEL * decode_pixels)
        # The prompts were encoded at set-up: the text encoders come only when they stay for training anyway.
        phases["previews"] = whole(unet + vae_bytes + render + (text_bytes if encoders_stay else 0))
    phases["export"] = whole(step.weights_total + step.adapter)
    return RunMemory(step, phases)

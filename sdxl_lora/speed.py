"""Speed levers for the training step, each behind a config switch (docs/speed.md has the measurements).

  channels_last     NHWC memory format for the convolutional model: cuDNN's fast conv kernels; the
                    transformer stages keep it instead of copying to NCHW (transformer_io); with
                    compile=regional the up blocks' concatenation, the last GroupNorm, the upsamplers
                    and the backward graphs too (fuse_skip_concat, compile_edges, conv_input_grad).
  compile=regional  torch.compile on each repeated block (transformer and ResNet blocks), not the whole
                    model: the same kernels fused, a fraction of the compile time, and one compiled
                    graph reused by every block of the same shape. Inductor's on-disk cache makes the
                    second launch faster still. compile_activation_budget lets the compiler recompute
                    the cheap part of the blocks' activations in backward (a memory budget inside
                    each compiled block, finer than checkpointing whole units).
  cuda_graphs       the model's forward and backward captured as CUDA graphs, one pair per input shape
                    (bucket): at small batch the step is host-bound (kernel launches, Python), and a
                    graph replay launches the whole pass at once.
  checkpoint_budget selective activation checkpointing: the blocks whose saved activations are largest
                    for the compute they cost to redo are checkpointed, just enough to fit a budget,
                    instead of diffusers' all-or-nothing switch (2.1x the step time).
  fused_geglu       the feed-forward's GEGLU backward as one Triton kernel (sdxl_lora/kernels.py).
  fuse_qkv,         each attention's q/k/v (or k/v) projections as one matmul, and their LoRA (lora_matmul
  lora_matmul       "merged") as one GEMM each way over the weight plus its delta instead of peft's
                    memory-bound rank-r products and adds.
  profile_steps     torch's profiler over N steps, a Chrome/Perfetto trace in the run folder and a table
                    of where the step time goes in the log.

Why not diffusers/peft/accelerate for these: diffusers has only whole-model checkpointing, accelerate's
compile (`dynamo_backend`) compiles the whole model (minutes before the first step for the SDXL UNet), and
`torch.cuda.make_graphed_callables` takes positional tensors only, so the UNet's keyword call is wrapped here.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# Blocks repeated through the SDXL UNet (and causal LMs' decoder layers): compiled one by one.
# train.compile="regional" compiles all of them; "transformer" only the attention blocks and decoder layers
# (the ResNets come in many widths, each its own compilation, for a smaller share of the step).
TRANSFORMER_CLASSES = ("BasicTransformerBlock", "LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer",
                       "GemmaDecoderLayer")
REGION_CLASSES = TRANSFORMER_CLASSES + ("ResnetBlock2D",)
# The compile backend; tests use "aot_eager" (same graph capture and autograd split, no C++ build).
COMPILE_BACKEND = "inductor"


def configure_backends(device: torch.device) -> None:
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True


# train.sdpa_backend: the kernels torch's scaled_dot_product_attention may use in the training forward.
# "default" leaves torch's own choice. A named backend restricts it to that one: cuDNN's ran SDXL's attention
# shapes 1.59x faster than flash in isolation (benchmarks/attention_backends.py, 69.8 vs 110.9 ms a batch-8
# step), but preferring it changed the trainer's step by nothing measurable (464.3 vs 464.9 ms at batch 8
# with CUDA graphs): the profiled step shows torch's own choice already runs cuDNN's there (H200, torch 2.11).
def sdpa_context(choice: str):
    """A context in which scaled_dot_product_attention uses only the named backend ("default": torch's own
    choice; torch raises if the named one cannot take a call). Entered around the training forward, so
    compilation and CUDA-graph capture see it too, and around checkpointed blocks' recomputation."""
    if choice == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel([kinds[choice]])


def to_channels_last(model: torch.nn.Module) -> None:
    model.to(memory_format=torch.channels_last)


# Inductor options for the SDXL UNet's compiled regions. combo_kernels: independent small kernels of a graph
# launched as one (H200, compile + graphs: batch 1 61.0 -> 59.0 ms; batch 16 634.7 vs 636.1 ms, compile time
# the same). Not triton.multi_kernel (each reduction built looped and single-pass, the faster chosen at its
# first run; round 7: ~4 ms of batch 16's 566.8 ms): with it, a second compilation on a machine whose
# inductor cache was warm failed in the backend ("'NoneType' object does not support the context manager
# protocol", H200, torch 2.11, round 8: twice, and once more with FlashAttention 4 registered), so a user's
# second run could fail. Its cause is suspected, not proven: every failing compilation had it, the cold ones
# with it worked, and so did the warm ones without it in rounds 6 and 7 (benchmarks/RESULTS.md, round 8).
# Not measured on the causal-LM path, which compiles without them.
UNET_INDUCTOR_OPTIONS = {"combo_kernels": True}

# The widest row inductor reduces with the whole row held at once ("persistent": one read). Inductor's own
# limit is 1024 elements (InductorChoices.should_use_persistent_reduction, torch 2.11-2.13; 16x that with
# multi_kernel, which then times both builds); a wider row reduction is built looped, the row read twice
# (the mean and variance, then the normalisation). SDXL's 32x32 stages are 1280 wide: 60 of its 70
# transformer blocks, whose LayerNorms (three each, forward and backward) were looped. H200, batch 16 with
# compile + graphs, one process: the compiled kernels 105.6 -> 92.3 ms, the step 552.0 -> 540.8 ms; batch 1
# 56.4 ms (benchmarks/RESULTS.md, round 11). 1024 gives inductor's own rule back.
PERSISTENT_ROW_MAX = 2048


@functools.cache
def _persistent_rows_key() -> object | None:
    """Inductor's persistent-reduction rule widened to PERSISTENT_ROW_MAX, installed on first use; returns a
    do-nothing graph pass whose uuid() carries the limit into inductor's cache key (compiled graphs are cached
    by their inductor options, and the rule is not one of them).

    Torch 2.11 has no option for this rule (2.13's `inductor_choices_class` is one, but a handler set by hand
    is per thread, and backward graphs compile on autograd's thread), so the rule is set on InductorChoices
    itself, for every compilation in the process: below or at 1024 it is inductor's own. None (with a
    warning) where inductor's rule is not the staticmethod it is in torch 2.11-2.13."""
    from torch._inductor.choices import InductorChoices
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V
    import torch._inductor.config as inductor_config

    if not isinstance(InductorChoices.__dict__.get("should_use_persistent_reduction"), staticmethod):
        log.warning("torch %s decides inductor's persistent reductions in a way this version does not know: "
                    "compiling with inductor's own rule (the compiled LayerNorms are slower, the results the same)",
                    torch.__version__)
        return None
    inductors = InductorChoices.should_use_persistent_reduction  # a staticmethod: the plain function

    def should_use_persistent_reduction(features, cooperative_reduction, *args, **kwargs) -> bool:
        if inductors(features, cooperative_reduction, *args, **kwargs):
            return True
        if (PERSISTENT_ROW_MAX <= 1024 or cooperative_reduction or not inductor_config.triton.persistent_reductions
                or features.get_reduction_hint() != ReductionHint.INNER):
            return False
        return V.graph.sizevars.statically_known_leq(features.reduction_numel, PERSISTENT_ROW_MAX)

    InductorChoices.should_use_persistent_reduction = staticmethod(should_use_persistent_reduction)

    class RowsKey(CustomGraphPass):
        def __call__(self, graph) -> None:
            pass

        def uuid(self) -> str:
            return f"sdxl_lora.persistent_row_max={PERSISTENT_ROW_MAX}"

    return RowsKey()


def unet_inductor_options() -> dict:
    """UNET_INDUCTOR_OPTIONS, and the persistent row limit where it is not inductor's own."""
    key = _persistent_rows_key() if PERSISTENT_ROW_MAX > 1024 else None
    return {**UNET_INDUCTOR_OPTIONS, **({"post_grad_custom_post_pass": key} if key else {})}


def compile_options(backend: str | None = None, options: dict | None = None) -> dict:
    """torch.compile's arguments for a region: static shapes, and inductor `options` (the only backend that
    takes options)."""
    backend = backend or COMPILE_BACKEND
    return {"backend": backend, "dynamic": False,
            **({"options": options} if options and backend == "inductor" else {})}


@functools.cache
def _compiled_for_unet(fn: Callable, backend: str) -> Callable:
    """`fn` compiled once per backend for the UNet's regions (shared by every block it serves)."""
    _raise_recompile_limits()
    return torch.compile(fn, **compile_options(backend, unet_inductor_options()))


def _raise_recompile_limits() -> None:
    # One compiled function serves many blocks of several shapes (and with and without grad, for previews):
    # torch's default of 8 graphs per function would send the rest back to eager, silently.
    import torch._dynamo

    dyn = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dyn, name):
            setattr(dyn, name, max(getattr(dyn, name), 64))
    if hasattr(dyn, "accumulated_recompile_limit"):
        dyn.accumulated_recompile_limit = max(dyn.accumulated_recompile_limit, 1024)


def compile_regions(model: torch.nn.Module, backend: str | None = None,
                    classes: tuple[str, ...] = REGION_CLASSES, activation_budget: float | None = None,
                    options: dict | None = None) -> int:
    """Compile every repeated block in place; returns how many. ResNet blocks come in several widths, so
    the recompile limit is raised to hold one graph per shape. activation_budget: the fraction of each
    compiled block's activations kept for backward (torch's partitioner chooses what to recompute by its
    cost; process-wide, read when the blocks compile at their first call); None: torch's default (1.0).
    options: inductor's (unet_inductor_options() for the UNet)."""
    import torch._functorch.config

    torch._functorch.config.activation_memory_budget = 1.0 if activation_budget is None else activation_budget
    _raise_recompile_limits()
    n = 0
    for module in model.modules():
        if type(module).__name__ in classes:
            module.compile(**compile_options(backend, options))
            n += 1
    if n == 0:
        log.warning("train.compile: no repeated blocks (%s) found in %s; nothing compiled",
                    ", ".join(classes), type(model).__name__)
    return n


class GraphedCall:
    """`fn(*tensors)` replayed from CUDA graphs (forward and backward), one pair per set of input shapes.

    The first call with a new shape captures (after warm-up iterations on a side stream); later calls copy
    the inputs into the captured buffers and replay. `fn` must not synchronise with the host and must read
    its parameters, not rebind them. Autocast inside `fn` must run with cache_enabled=False."""

    def __init__(self, module: torch.nn.Module, fn: Callable[..., torch.Tensor], warmup: int = 3):
        self.module, self.fn, self.warmup = module, fn, warmup
        self.graphs: dict[tuple, Callable] = {}

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        key = tuple((tuple(a.shape), a.dtype) for a in args)
        graphed = self.graphs.get(key)
        if graphed is None:
            log.info("capturing CUDA graphs for input shapes %s", [k[0] for k in key])
            wrapper = _Positional(self.module, self.fn)
            graphed = torch.cuda.make_graphed_callables(wrapper, tuple(a.detach().clone() for a in args),
                                                        num_warmup_iters=self.warmup, allow_unused_input=True)
            # The warm-up iterations ran in the ordinary pool and the captured ones live in the graph's own:
            # give the warm-up's (and any earlier eager pass's) cached blocks back to the device. (The peak
            # reserved is reached during the capture itself: 29.1 GiB before this, 28.4 after, for a 15.5
            # GiB step; what stays reserved afterwards was not measured.)
            torch.cuda.empty_cache()
            self.graphs[key] = graphed
        return graphed(*args)


class _Positional(torch.nn.Module):
    # make_graphed_callables wants a module (so it finds the trainable parameters) called with tensors.
    def __init__(self, module: torch.nn.Module, fn: Callable[..., torch.Tensor]):
        super().__init__()
        self.inner = module
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)


# ---- fused q/k/v projections ----
#
# Each attention of the UNet projects its input three times (to_q, to_k, to_v; cross-attention: to_k and
# to_v on the text tokens), each with its own LoRA: six small matmuls and three reads of the same input
# per projection set, which at small batch cost more in launches than in FLOPs. diffusers can fuse the base
# projections (Attention.fuse_projections) but its fused processor then skips peft's LoRA layers, so this
# is ours: one matmul for the frozen weights (the three base weights become views of one buffer: no extra
# memory), one for the LoRA A factors side by side and one for the B factors as a block-diagonal matrix
# (scaling folded in). The trainable parameters stay peft's own, so saving and export are unchanged.

class _FusedWeight(torch.nn.Module):
    # A module, so model.to() moves the buffer with the rest; not persistent, so state_dict is unchanged.
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)


class _QuantizedProjections(torch.nn.Module):
    """fused_qkv/fused_kv for quantized bases (bitsandbytes 4-bit, our fp8): nothing stored; the "merged" way
    dequantizes their weights into one buffer per call (_dequantized). A tuple, so the layers are not
    registered a second time (state_dict and model.to() see them once, where they are)."""

    def __init__(self, bases: list[torch.nn.Module]):
        super().__init__()
        self.bases = tuple(bases)
        self.in_features = bases[0].in_features


def _base_linear(layer: torch.nn.Module) -> torch.nn.Module:
    return getattr(layer, "base_layer", layer)


def _dequantizable(base: torch.nn.Module) -> bool:
    """A frozen quantized Linear of ours that rebuilds its weight (`dequantized(dtype, out=)`): bitsandbytes
    4-bit (nf4/fp4) or fp8 (sdxl_lora.quantize). LLM.int8 is not: its product splits outlier columns off,
    which one dequantized weight does not reproduce."""
    return hasattr(base, "dequantized") and hasattr(base, "in_features")


def _dequantized(bases: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The weights of `bases` dequantized to `dtype`, stacked along the output dimension into one new buffer."""
    out = torch.empty(sum(b.out_features for b in bases), bases[0].in_features, dtype=dtype,
                      device=bases[0].weight.device)
    for base, part in zip(bases, out.split([b.out_features for b in bases])):
        base.dequantized(dtype, out=part)
    return out


_NO_LORA = ()


def _lora_factors(layer: torch.nn.Module) -> tuple | None:
    """The active plain-LoRA factors of a projection as (A, B, scaling), _NO_LORA without LoRA, or None where
    fusing would not reproduce its forward: dropout, DoRA or another variant, several adapters, a merged or
    disabled adapter."""
    if not hasattr(layer, "lora_A"):
        return _NO_LORA if type(layer) is torch.nn.Linear else None
    if layer.merged or layer.disable_adapters:
        return None
    names = [a for a in layer.active_adapters if a in layer.lora_A]
    if not names:
        return _NO_LORA
    a = names[0]
    if len(names) > 1 or a in layer.lora_variant or not isinstance(layer.lora_dropout[a], torch.nn.Identity) \
            or layer.lora_bias.get(a, False):
        return None
    return layer.lora_A[a].weight, layer.lora_B[a].weight, layer.scaling[a]


def _fused_projections(x: torch.Tensor, fused: torch.nn.Module, layers: tuple, matmul: str = "peft"
                       ) -> list[torch.Tensor]:
    factors = [_lora_factors(layer) for layer in layers]
    quantized = isinstance(fused, _QuantizedProjections)
    if any(f is None for f in factors) or (quantized and (
            not any(factors) or _lora_way(matmul, x, fused.in_features) != "merged")):
        return [layer(x) for layer in layers]  # a quantized base's other ways: peft's own layers
    widths = [_base_linear(layer).out_features for layer in layers]
    if not any(factors):
        out = F.linear(x, fused.weight)
    else:
        a = torch.cat([f[0] for f in factors if f])
        b = torch.block_diag(*[f[1] * f[2] if f else a.new_zeros(n, 0) for f, n in zip(factors, widths)])
        if quantized:
            out = lora_linear(x, fused.bases, None, a, b, "merged")
        elif (way := _lora_way(matmul, x, fused.weight.shape[1])) == "peft":
            out = F.linear(x, fused.weight) + F.linear(F.linear(x, a), b)
        else:
            out = lora_linear(x, fused.weight, None, a, b, way)
    return list(out.split(widths, dim=-1))


def _projection(layer: torch.nn.Module, x: torch.Tensor, matmul: str) -> torch.Tensor:
    """A single projection of the fused processor (the cross-attention's to_q, to_out.0): peft's forward, or
    train.lora_matmul's where the layer is a plain LoRA'd Linear with a frozen base ("merged" only, for a
    quantized base)."""
    base = _base_linear(layer)
    way = _lora_way(matmul, x, base.in_features)
    if _dequantizable(base):
        weight, way = (base,), way if way == "merged" else "peft"
    elif type(base) is torch.nn.Linear and not base.weight.requires_grad:
        weight = base.weight
    else:
        way = "peft"
    factors = _lora_factors(layer) if way != "peft" else None
    if not factors:
        return layer(x)
    return lora_linear(x, weight, base.bias, factors[0], factors[1] * factors[2], way)


# train.lora_matmul's other ways read and write a weight-sized tensor per call: they pay only where the
# activation has at least this many rows (tokens) per column of the weight.
LORA_WAY_MIN_ROWS_PER_COLUMN = 1.0


def _lora_way(matmul: str, x: torch.Tensor, in_features: int) -> str:
    """train.lora_matmul's way for one product, or "peft" where it would cost more than it saves (SDXL: the
    cross-attention's k/v over 77 text tokens, the 32x32 stages at batch 1). Shapes are fixed per compiled
    graph, so is the choice."""
    rows = x.numel() // x.shape[-1]
    return matmul if rows >= LORA_WAY_MIN_ROWS_PER_COLUMN * in_features else "peft"


# ---- LoRA's products (train.lora_matmul) ----
#
# peft computes a LoRA'd projection as base(x) + B(A(x)) * s: besides the frozen GEMM, a rank-r product
# that writes a whole output-sized tensor, an add that reads it and the base output again, and in the
# backward a rank-r product that reads the output's gradient once more. These are memory-bound matmuls
# (N or K = r: ~40-50 TFLOP/s at batch 16's shapes on an H200, at the memory's bandwidth), 37.6 ms of batch
# 16's step. Two ways with fewer of them (neither peft nor diffusers has one: peft's Linear always adds
# its LoRA output to the base layer's):
#   "concat"  the B product joins the frozen GEMM along its reduction: y = [x, x A^T] @ [W, s B]^T (K grows
#             by r), and in the backward dy @ [W, s B] gives the input's gradient through W and dy s B in
#             one GEMM. Exact (peft's products summed in another order), but [x, x A^T] is a copy of x.
#   "merged"  y = x @ (W + s B A)^T: the delta added to the frozen weight (one small GEMM over the weight,
#             rounded once to the compute dtype) and one GEMM each way; A's and B's gradients are exact
#             products of the output's gradient, as peft's. The forward sees the delta at the weight's
#             precision (bf16: 2^-9 of each weight), not at its own; peft's bf16 output, rounded at 2^-9 of
#             its own size, loses as much of a small delta: merged's output and gradients are as close to
#             fp32 as peft's (tests/test_speed.py). In fp32 both are exact. The default.

class _LoRAConcat(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, a, b):
        x2 = x.reshape(-1, x.shape[-1])
        xc = torch.cat([x2, x2 @ a.t()], dim=1)
        y = F.linear(xc, torch.cat([w, b], dim=1), bias)
        ctx.save_for_backward(xc, w, a, b)
        ctx.x_shape = x.shape
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        xc, w, a, b = ctx.saved_tensors
        k = w.shape[1]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dxc = dy2 @ torch.cat([w, b], dim=1)  # [dy W, dy s B]: the input's gradient through W, and h's
        dh = dxc[:, k:]
        dx = (dxc[:, :k] + dh @ a).reshape(ctx.x_shape) if ctx.needs_input_grad[0] else None
        return dx, None, None, dh.t() @ xc[:, :k], dy2.t() @ xc[:, k:]


class _LoRAMerged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, a, b):
        x2 = x.reshape(-1, x.shape[-1])
        h = x2 @ a.t()
        y = F.linear(x2, torch.addmm(w, b, a), bias)
        ctx.save_for_backward(x2, h, w, a, b)  # what peft's keeps; W + s B A is made again in the backward
        ctx.x_shape = x.shape
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, h, w, a, b = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dh = dy2 @ b
        dx = (dy2 @ torch.addmm(w, b, a)).reshape(ctx.x_shape) if ctx.needs_input_grad[0] else None
        return dx, None, None, dh.t() @ x2, dy2.t() @ h


class _LoRAMergedQuantized(torch.autograd.Function):
    """"merged" for quantized frozen bases (a tuple of them, stacked along the output): the weight
    dequantized into a new buffer, the delta added to it in place, one GEMM each way; the backward
    dequantizes again instead of saving the weight, as bitsandbytes' own 4-bit matmul does: a saved
    compute-dtype copy of every quantized weight would undo the quantization's memory saving."""

    @staticmethod
    def forward(ctx, x, bias, a, b, bases):
        x2 = x.reshape(-1, x.shape[-1])
        h = x2 @ a.t()
        y = F.linear(x2, _dequantized(bases, x.dtype).addmm_(b, a), bias)
        ctx.save_for_backward(x2, h, a, b)
        ctx.bases, ctx.x_shape = bases, x.shape
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, h, a, b = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dh = dy2 @ b
        dx = (dy2 @ _dequantized(ctx.bases, dy.dtype).addmm_(b, a)).reshape(ctx.x_shape) \
            if ctx.needs_input_grad[0] else None
        return dx, None, dh.t() @ x2, dy2.t() @ h, None


_LORA_MATMULS = {"concat": _LoRAConcat, "merged": _LoRAMerged}


def lora_linear(x: torch.Tensor, w: torch.Tensor | tuple, bias: torch.Tensor | None, a: torch.Tensor,
                b: torch.Tensor, matmul: str) -> torch.Tensor:
    """F.linear(x, w, bias) + F.linear(F.linear(x, a), b) (b with the LoRA scaling in it) for a frozen w and
    bias, computed the `matmul` way (above: "concat" or "merged"); in autocast's dtype as F.linear would
    run, the factors' gradients reaching them through the casts. `w` may be a tuple of quantized layers
    (_dequantizable) whose weights, stacked, are W: "merged" only."""
    quantized = isinstance(w, tuple)
    if quantized and matmul != "merged":
        raise ValueError(f"lora_linear over quantized weights is 'merged' only, not {matmul!r}")
    if (not quantized and w.requires_grad) or (bias is not None and bias.requires_grad):
        raise ValueError("lora_linear computes no gradient for the base weight or bias: they must be frozen")
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    bias = None if bias is None else bias.to(dtype)
    with torch.autocast(device, enabled=False):
        if quantized:
            return _LoRAMergedQuantized.apply(x.to(dtype), bias, a.to(dtype), b.to(dtype), w)
        return _LORA_MATMULS[matmul].apply(x.to(dtype), w.to(dtype), bias, a.to(dtype), b.to(dtype))


class FusedProjectionsProcessor:
    """diffusers' AttnProcessor2_0 with the projections of one input made by one matmul (_fused_projections).
    Anything SDXL's attention does not use (masks, spatial or group norms, 4-D input) goes to the stock one."""

    def __init__(self, lora_matmul: str = "peft"):
        from diffusers.models.attention_processor import AttnProcessor2_0

        self.stock = AttnProcessor2_0()
        self.matmul = lora_matmul

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 *args, **kwargs):
        self_attention = encoder_hidden_states is None
        fused = getattr(attn, "fused_qkv" if self_attention else "fused_kv", None)
        if (fused is None or attention_mask is not None or attn.spatial_norm is not None or attn.group_norm is not None
                or attn.norm_cross or attn.norm_q is not None or attn.norm_k is not None or hidden_states.ndim != 3
                or args or kwargs):
            return self.stock(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)
        if self_attention:
            q, k, v = _fused_projections(hidden_states, fused, (attn.to_q, attn.to_k, attn.to_v), self.matmul)
        else:
            q = _projection(attn.to_q, hidden_states, self.matmul)
            k, v = _fused_projections(encoder_hidden_states, fused, (attn.to_k, attn.to_v), self.matmul)
        b, heads = hidden_states.shape[0], attn.heads
        d = k.shape[-1] // heads
        q, k, v = (t.reshape(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))
        h = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        h = h.transpose(1, 2).reshape(b, -1, heads * d).to(q.dtype)
        h = attn.to_out[1](_projection(attn.to_out[0], h, self.matmul))
        if attn.residual_connection:
            h = h + hidden_states
        return h / attn.rescale_output_factor


def fuse_projections(model: torch.nn.Module, lora_matmul: str = "peft") -> int:
    """train.fuse_qkv: every diffusers Attention on the stock SDPA processor gets FusedProjectionsProcessor,
    its base q/k/v (self-attention) or k/v (cross-attention) weights moved into one buffer they are views
    of. Projections with a bias or of another kind are left alone. `lora_matmul` (train.lora_matmul) is how
    the processor computes its projections' LoRA: "peft" (peft's products), "concat" or "merged" (above).
    Quantized bases (_dequantizable: QLoRA's nf4/fp4, fp8) are fused for "merged" only: their weights are
    dequantized into one buffer per call, the LoRA delta added to it (_LoRAMergedQuantized).
    Returns the number of attentions fused."""
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    n = 0
    for attn in model.modules():
        if not isinstance(attn, Attention) or type(attn.processor) is not AttnProcessor2_0:
            continue
        names = ("to_k", "to_v") if attn.is_cross_attention else ("to_q", "to_k", "to_v")
        bases = [_base_linear(getattr(attn, name)) for name in names]
        if any(b.bias is not None for b in bases) or len({(b.in_features, b.weight.device) for b in bases}) != 1:
            continue
        if all(_dequantizable(b) for b in bases):
            if lora_matmul != "merged":  # nothing to gain: peft's layers dequantize one by one anyway
                continue
            holder = _QuantizedProjections(bases)
        elif all(type(b) is torch.nn.Linear and not b.weight.requires_grad for b in bases) and len(
                {b.weight.dtype for b in bases}) == 1:
            with torch.no_grad():
                fused = torch.cat([b.weight for b in bases])
            offset = 0
            for b in bases:
                b.weight = torch.nn.Parameter(fused[offset:offset + b.out_features], requires_grad=False)
                offset += b.out_features
            holder = _FusedWeight(fused)
        else:
            continue
        attn.add_module("fused_kv" if attn.is_cross_attention else "fused_qkv", holder)
        attn.set_processor(FusedProjectionsProcessor(lora_matmul))
        n += 1
    return n


# ---- the transformers' way in and out ----
#
# diffusers' Transformer2DModel (SDXL's attention stages) runs its GroupNorm and projections outside the
# transformer blocks, so compile=regional leaves them eager, and it ends with `.permute(0, 3, 1, 2)
# .contiguous()`: under channels_last that is a transposing copy to NCHW, then an add of mixed layouts, and
# the next convolution converts back. Here the way out keeps the layout the permute gives (NHWC in memory,
# channels_last, the same values), and with compilation both ways are compiled too (one small graph each,
# shared by every stage of one shape). H200, compile + graphs: eager copies 78 -> 57 and mixed-layout adds
# 39 -> 21 a step (batch 16: 30.7 -> 19.7 ms of them); batch 1 64.1 -> 62.8 ms.

def _transformer_in(self, hidden_states):
    batch, inner_dim, height, width = hidden_states.shape
    hidden_states = self.norm(hidden_states).permute(0, 2, 3, 1).reshape(batch, height * width, inner_dim)
    return self.proj_in(hidden_states), inner_dim


def _transformer_out(self, hidden_states, residual, batch_size, height, width, inner_dim):
    hidden_states = self.proj_out(hidden_states).reshape(batch_size, height, width, inner_dim)
    return hidden_states.permute(0, 3, 1, 2) + residual


def transformer_io(model: torch.nn.Module, compile: bool, backend: str | None = None) -> int:
    """With channels_last: every Transformer2DModel with continuous input and linear projections (SDXL's) gets
    the ways in and out above, compiled with `compile`. Returns how many."""
    import types

    fns = (_transformer_in, _transformer_out)
    if compile:
        fns = tuple(_compiled_for_unet(fn, backend or COMPILE_BACKEND) for fn in fns)
    n = 0
    for m in model.modules():
        if type(m).__name__ == "Transformer2DModel" and m.is_input_continuous and m.use_linear_projection:
            m._operate_on_continuous_inputs = types.MethodType(fns[0], m)
            m._get_output_for_continuous_inputs = types.MethodType(fns[1], m)
            n += 1
    return n


# ---- the up blocks' skip concatenation ----
#
# Each ResNet of the UNet's up blocks takes torch.cat([hidden_states, skip], dim=1). Under channels_last the
# gradient of each part is a channel slice of the concatenation's gradient, which is not channels_last in
# memory; the compiled block that made that part expects its output's gradient in its own layout, and
# AOTAutograd copies every such gradient into it before the block's backward (on the tiny UNet: 7 of a
# step's 53 incoming gradients; on SDXL at batch 16, 55 -> 48 eager copies, 593.9 against ~596 ms: most of
# the copies were inside the compiled backward graphs, see conv_input_grad). Here the concatenation runs
# inside the ResNet's compiled graph and hands back each part's gradient channels_last-contiguous, which the
# compiler can write directly from the kernel that computes it. With compile only; checkpointed blocks and FreeU keep
# diffusers' own forward.

class _SkipConcat(torch.autograd.Function):
    @staticmethod
    def forward(hidden_states, skip):
        return torch.cat([hidden_states, skip], dim=1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.split = inputs[0].shape[1]

    @staticmethod
    def backward(ctx, grad):
        layout = torch.channels_last
        return (grad[:, :ctx.split].contiguous(memory_format=layout),
                grad[:, ctx.split:].contiguous(memory_format=layout))


def _cat_resnet(resnet, hidden_states, skip, temb):
    return resnet(_SkipConcat.apply(hidden_states, skip), temb)


def _up_block_forward(self, hidden_states, res_hidden_states_tuple, temb=None, upsample_size=None, **kwargs):
    attentions = getattr(self, "attentions", None)
    freeu = all(getattr(self, k, None) for k in ("s1", "s2", "b1", "b2"))
    if freeu or (torch.is_grad_enabled() and self.gradient_checkpointing) or (attentions is None and kwargs):
        return type(self).forward(self, hidden_states=hidden_states, res_hidden_states_tuple=res_hidden_states_tuple,
                                  temb=temb, upsample_size=upsample_size, **kwargs)
    for i, resnet in enumerate(self.resnets):
        skip, res_hidden_states_tuple = res_hidden_states_tuple[-1], res_hidden_states_tuple[:-1]
        hidden_states = self._cat_resnet(resnet, hidden_states, skip, temb)
        if attentions is not None:
            hidden_states = attentions[i](
                hidden_states, encoder_hidden_states=kwargs.get("encoder_hidden_states"),
                cross_attention_kwargs=kwargs.get("cross_attention_kwargs"),
                attention_mask=kwargs.get("attention_mask"),
                encoder_attention_mask=kwargs.get("encoder_attention_mask"), return_dict=False)[0]
    for upsampler in self.upsamplers or ():
        hidden_states = upsampler(hidden_states, upsample_size)
    return hidden_states


def fuse_skip_concat(model: torch.nn.Module, backend: str | None = None) -> int:
    """With channels_last and compile: every diffusers up block (CrossAttnUpBlock2D, UpBlock2D) concatenates
    its skip connections inside its ResNets' compiled graphs (above). Returns how many blocks."""
    import types

    cat_resnet = _compiled_for_unet(_cat_resnet, backend or COMPILE_BACKEND)
    n = 0
    for m in model.modules():
        if type(m).__name__ in ("CrossAttnUpBlock2D", "UpBlock2D"):
            m._cat_resnet = cat_resnet
            m.forward = types.MethodType(_up_block_forward, m)
            n += 1
    return n


def _group_norm(norm, x):
    return F.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps)


def _compiled_group_norm(self, x):
    return self._group_norm_fn(self, x)


def _nearest2x(x: torch.Tensor) -> torch.Tensor:
    """F.interpolate(x, scale_factor=2, mode="nearest") for a channels_last x, as a broadcast: its gradient is
    a sum over each 2x2 block, where inductor builds upsample_nearest2d's backward as a scatter-add with
    atomics (H200, batch 16: 3.1 ms for SDXL's two upsamplers, ~0.2 ms read once)."""
    b, c, h, w = x.shape
    nhwc = x.permute(0, 2, 3, 1)
    return nhwc[:, :, None, :, None, :].expand(b, h, 2, w, 2, c).reshape(b, 2 * h, 2 * w, c).permute(0, 3, 1, 2)


def _upsample(self, hidden_states, output_size=None, *args, **kwargs):
    """diffusers' Upsample2D with the plain case (interpolate 2x, then the convolution) through _nearest2x."""
    if (args or kwargs or output_size is not None or self.norm is not None or self.use_conv_transpose
            or not self.interpolate or not self.use_conv or self.name != "conv"):
        return type(self).forward(self, hidden_states, output_size, *args, **kwargs)
    return self.conv(_nearest2x(hidden_states))


def compile_edges(model: torch.nn.Module, backend: str | None = None) -> int:
    """With channels_last and compile: the UNet's last GroupNorm (conv_norm_out) and its upsamplers compiled as
    regions too. On CUDA, torch's eager GroupNorm copies a channels_last input to NCHW and hands back an NCHW
    gradient (which the compiled ResNet before it copies again), and diffusers' Upsample2D interpolates bf16 in
    fp32 (two casts around it); compiled, each is one channels_last kernel (the upsampling as a broadcast,
    _nearest2x). The GroupNorm goes through a function of ours: torch.compile does not trace a torch.nn
    module's own forward as its top frame (it ran eager when compiled with Module.compile). Returns how many
    modules."""
    import types

    n = 0
    for name, m in model.named_modules():
        if name == "conv_norm_out" and type(m) is torch.nn.GroupNorm:
            m._group_norm_fn = _compiled_for_unet(_group_norm, backend or COMPILE_BACKEND)
            m.forward = types.MethodType(_compiled_group_norm, m)
            n += 1
        elif type(m).__name__ == "Upsample2D":
            m.forward = types.MethodType(_upsample, m)
            m.compile(**compile_options(backend, unet_inductor_options()))
            n += 1
    return n


# ---- the convolutions' input gradient, channels_last in compiled backward graphs ----
#
# Inductor lays out a graph's tensors channels_last around its convolutions only when the graph holds an
# aten.convolution (GraphLowering.decide_layout_opt); a compiled ResNet's backward graph holds
# aten.convolution_backward instead, so the gradient it hands to each convolution's backward is written
# NCHW and cuDNN copies it (and the saved input) to channels_last first: on SDXL at batch 16, 13.7 ms of
# copies a step (H200, `sdxl_step.py --shapes`). Here the input's gradient is the transposed convolution of
# the output's gradient with the same weight (the same cuDNN dgrad kernel): an aten.convolution in the
# backward graph, so inductor keeps its chain channels_last (torch.nn.grad.conv2d_input would not do: it calls
# convolution_backward). The weight's gradient, where one is needed (a LoRA factor's convolution), is torch's
# (torch.nn.grad.conv2d_weight).

class _Conv2dGrad(torch.autograd.Function):
    @staticmethod
    def forward(x, weight, bias, stride, padding, dilation, groups):
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, stride, padding, dilation, groups = inputs
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        ctx.conv = (stride, padding, dilation, groups)
        ctx.x_size = x.shape[2:]
        ctx.bias = bias is not None

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.conv
        # Under autocast the forward ran in the autocast dtype (the gradient's) while the saved tensors are the
        # originals (an fp32 LoRA factor's weight, say): the backward computes in the gradient's dtype, and
        # autograd casts each result to its input's dtype.
        weight = weight.to(grad.dtype)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            # output_padding: what a strided convolution's output size leaves out of the input's
            extra = [n - ((g - 1) * s - 2 * p + d * (k - 1) + 1) for n, g, s, p, d, k in zip(
                ctx.x_size, grad.shape[2:], stride, padding, dilation, weight.shape[2:])]
            dx = F.conv_transpose2d(grad, weight, None, stride, padding, extra, groups, dilation)
        if ctx.needs_input_grad[1]:
            dw = torch.nn.grad.conv2d_weight(x.to(grad.dtype), weight.shape, grad, stride, padding, dilation, groups)
        if ctx.bias and ctx.needs_input_grad[2]:
            db = grad.sum((0, 2, 3))
        return dx, dw, db, None, None, None, None


def _conv_forward(self, x):
    return _Conv2dGrad.apply(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


def conv_input_grad(model: torch.nn.Module) -> int:
    """With channels_last and compile: the Conv2d layers inside ResNet blocks and upsamplers (what
    compile="regional" and compile_edges compile) compute their input's gradient as above. Plain zero-padded
    2-D convolutions only (SDXL's); others keep torch's. Returns how many."""
    import types

    n = 0
    for block in model.modules():
        if type(block).__name__ not in ("ResnetBlock2D", "Upsample2D"):
            continue
        for m in block.modules():
            if type(m) is torch.nn.Conv2d and m.padding_mode == "zeros" and not isinstance(m.padding, str):
                m.forward = types.MethodType(_conv_forward, m)
                n += 1
    return n


# ---- selective activation checkpointing ----
#
# diffusers checkpoints a UNet in units, each behind a `gradient_checkpointing` switch: a block's switch
# checkpoints its ResNets one by one, a Transformer2DModel's switch its transformer layers. diffusers only
# turns them all on or all off (2.1x the step time); here each unit is switched on its own, the units that
# free the most memory per FLOP of recomputation first, until a measured step fits the budget.

@dataclass
class CheckpointUnit:
    name: str                 # "down_blocks.1.resnets", "mid_block.attentions.0"
    switch: torch.nn.Module   # the module whose gradient_checkpointing flag checkpoints the unit
    members: list[str]        # names (in the UNet) of the modules that run checkpointed
    saved: int = 0            # bytes the members save for backward, at the measured batch
    flops: int = 0            # forward FLOPs of the members, at the measured batch

    @property
    def bytes_per_flop(self) -> float:
        return self.saved / max(self.flops, 1)


def checkpoint_units(unet: torch.nn.Module) -> list[CheckpointUnit]:
    """Every unit of the UNet that diffusers can checkpoint on its own, in forward order."""
    blocks = [(f"down_blocks.{i}", b) for i, b in enumerate(getattr(unet, "down_blocks", []))]
    if getattr(unet, "mid_block", None) is not None:
        blocks.append(("mid_block", unet.mid_block))
    blocks += [(f"up_blocks.{i}", b) for i, b in enumerate(getattr(unet, "up_blocks", []))]
    units = []
    for name, block in blocks:
        resnets = getattr(block, "resnets", None) or []
        if hasattr(block, "gradient_checkpointing") and len(resnets):
            units.append(CheckpointUnit(f"{name}.resnets", block, [f"{name}.resnets.{j}" for j in range(len(resnets))]))
        for j, attn in enumerate(getattr(block, "attentions", None) or []):
            if hasattr(attn, "gradient_checkpointing"):
                units.append(CheckpointUnit(f"{name}.attentions.{j}", attn, [f"{name}.attentions.{j}"]))
    return units


def measure_units(unet: torch.nn.Module, units: list[CheckpointUnit], call: Callable[[], torch.Tensor]) -> None:
    """Fill each unit's `saved` (bytes its modules save for backward: saved-tensor hooks; the frozen weights,
    which are not copies, and tensors already counted are left out) and `flops` (torch's FlopCounterMode)
    from one forward of `call()`."""
    from torch.utils.flop_counter import FlopCounterMode

    modules = dict(unet.named_modules())
    current: list[CheckpointUnit] = []
    seen: set[int] = set()
    params = {p.data_ptr() for p in unet.parameters()}

    def pack(t: torch.Tensor):
        if current and t.data_ptr() not in params and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            current[-1].saved += t.numel() * t.element_size()
        # Detached: a pack hook that returns the tensor itself ties saved outputs to their own graph nodes,
        # and the whole measured graph (every activation, and the adapter's gradient accumulators) then
        # outlives the pass, even a gc.collect(). Nothing is unpacked here: there is no backward.
        return t.detach()

    def enter(unit):
        return lambda module, args: current.append(unit)

    def leave(module, args, output):
        current.pop()

    handles = []
    for unit in units:
        unit.saved = unit.flops = 0
        for member in unit.members:
            handles.append(modules[member].register_forward_pre_hook(enter(unit)))
            handles.append(modules[member].register_forward_hook(leave))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), FlopCounterMode(display=False) as fc:
            out = call()
        del out
    finally:
        for h in handles:
            h.remove()
    counts = fc.get_flop_counts()
    root = type(unet).__name__
    for unit in units:
        unit.flops = sum(sum(counts.get(f"{root}.{m}", {}).values()) for m in unit.members)


def checkpoint_order(units: list[CheckpointUnit]) -> list[CheckpointUnit]:
    """The order in which units are checkpointed: most bytes freed per FLOP recomputed first (ties by
    name); units that save nothing (no adapter in or before them) never."""
    return sorted((u for u in units if u.saved > 0), key=lambda u: (-u.bytes_per_flop, u.name))


def choose_checkpointed(units: list[CheckpointUnit], budget_bytes: int, other_bytes: int,
                        scale: float = 1.0) -> list[str]:
    """Units to checkpoint so that other_bytes + scale x the activations left fit the budget (each
    checkpointed unit keeps only its input, so the saving is nearly its whole activation), taken in
    checkpoint_order. Deterministic."""
    chosen: list[str] = []
    total = other_bytes + scale * sum(u.saved for u in units)
    for unit in checkpoint_order(units):
        if total <= budget_bytes:
            break
        chosen.append(unit.name)
        total -= scale * unit.saved
    return chosen


def enable_checkpointing(model: torch.nn.Module, graph_safe: bool = False, sdpa_backend: str = "default") -> None:
    """diffusers' gradient checkpointing, non-reentrant. graph_safe: without saving and restoring the RNG
    state around each block (a host sync, which a CUDA graph capture cannot hold); only right when nothing
    random runs inside the blocks (no LoRA dropout). sdpa_backend: the attention kernels (sdpa_context) of
    the forward, entered again for the recomputation in backward: a block recomputed with another kernel
    saves other tensors (cuDNN keeps its softmax statistics as [b, h, n, 1], flash as [b, h, n]), which
    torch's checkpoint rejects."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    kwargs: dict = {"use_reentrant": False}
    if graph_safe:
        kwargs["preserve_rng_state"] = False
    if sdpa_backend != "default":
        kwargs["context_fn"] = lambda: (sdpa_context(sdpa_backend), sdpa_context(sdpa_backend))
    model.enable_gradient_checkpointing(partial(checkpoint, **kwargs))


def apply_selective_checkpointing(unet: torch.nn.Module, names: list[str], graph_safe: bool = False,
                                  sdpa_backend: str = "default") -> None:
    """diffusers' checkpointing on the named units (checkpoint_units) only."""
    units = checkpoint_units(unet)
    unknown = set(names) - {u.name for u in units}
    if unknown:
        raise ValueError(f"no checkpointable unit named {sorted(unknown)} in {type(unet).__name__}")
    enable_checkpointing(unet, graph_safe, sdpa_backend)
    for m in unet.modules():
        if hasattr(m, "gradient_checkpointing"):
            m.gradient_checkpointing = False
    for unit in units:
        unit.switch.gradient_checkpointing = unit.name in names


# ---- profiling ----

class StepProfiler:
    """torch.profiler over `steps` training steps after `skip` warm-up steps; named phases per step
    (data, forward, backward, optimizer). Writes <run>/profile/trace.json (Perfetto, chrome://tracing) and
    logs where the step time went."""

    PHASES = ("data", "forward", "backward", "optimizer")

    def __init__(self, out_dir: Path | None, steps: int, skip: int = 2, device: torch.device | None = None):
        self.out_dir, self.steps, self.skip, self.device = out_dir, steps, skip, device
        self.prof = None
        self.done = steps <= 0 or out_dir is None
        self.summary: str | None = None

    def phase(self, name: str):
        if self.prof is None:
            return contextlib.nullcontext()
        return torch.profiler.record_function(f"phase:{name}")

    def before_step(self, step: int) -> None:
        """Called with the number of the step about to run (0-based count of steps done)."""
        if self.done or self.prof is not None or step < self.skip:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device is not None and self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
        self.prof.__enter__()
        self.start = step

    def after_step(self, step: int, last: bool = False) -> Path | None:
        """Called with the number of steps done; ends the recording after `steps` of them (or at the last)."""
        if self.prof is None or (step - self.start < self.steps and not last):
            return None
        self.steps = step - self.start
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / "trace.json"
        self.prof.export_chrome_trace(str(trace))
        self.summary = self._summary()
        log.info("profile of %d steps written to %s\n%s", self.steps, trace, self.summary)
        self.prof, self.done = None, True
        return trace

    def _summary(self) -> str:
        events = self.prof.key_averages()
        use_cuda = self.device is not None and self.device.type == "cuda"

        def total_us(e) -> float:
            # Self time: an operator's children are listed on their own.
            return (getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)) if use_cuda \
                else e.self_cpu_time_total

        phases = {e.key.split(":", 1)[1]: e.cpu_time_total for e in events if e.key.startswith("phase:")}
        lines = ["where the step time goes (host time per phase, per step):"]
        for p in self.PHASES:
            if p in phases:
                lines.append(f"  {p:<10} {phases[p] / 1000 / self.steps:9.2f} ms")
        if use_cuda and (kinds := kernel_kinds(events, self.steps)):
            lines.append(f"GPU time by kind of kernel (per step, {sum(kinds.values()):.2f} ms busy):")
            lines.extend(f"  {ms:9.2f} ms  {kind}" for kind, ms in kinds.items())
        ops = sorted((e for e in events if not e.key.startswith(("phase:", "ProfilerStep"))),
                     key=total_us, reverse=True)[:10]
        lines.append(f"top operators by {'GPU' if use_cuda else 'CPU'} time (per step):")
        for e in ops:
            lines.append(f"  {total_us(e) / 1000 / self.steps:9.2f} ms  {e.count // self.steps:5d}x  {e.key[:70]}")
        return "\n".join(lines)


# Kernel names (cuBLAS, cuDNN, flash/cuDNN attention, inductor's Triton) to what they do; first match wins:
# cuDNN's attention helpers (dO.O, the dQ conversion) before the convolutions' "conv"/"cudnn", inductor's
# kernels (whose names can hold "convolution") before both, cuDNN's implicit-GEMM convolutions before the GEMM
# patterns.
KERNEL_KINDS = (("attention", ("flash", "fmha", "attention", "sdpa", "dot_do_o", "convert_dq")),
                ("fused (compiled)", ("triton", "geglu")),  # inductor's kernels and ours (sdxl_lora/kernels.py)
                ("convolution", ("conv", "fprop", "dgrad", "wgrad", "cudnn")),
                ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "gemv")),
                ("optimizer", ("multi_tensor", "adam")),
                ("communication", ("nccl",)))


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, patterns in KERNEL_KINDS:
        if any(p in low for p in patterns):
            return kind
    return "other (element-wise, copies, norms)"


def kernel_kinds(events, steps: int) -> dict[str, float]:
    """GPU milliseconds per step by kind of kernel, largest first, from a profiler's key_averages(). Ranges
    named on the GPU's timeline (record_function, the optimizer's step) span kernels counted already: left out."""
    kinds: dict[str, float] = {}
    for e in events:
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        kind = kernel_kind(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + us / 1000 / max(steps, 1)
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))

"""Speed levers of the SDXL UNet (diffusers' blocks), each behind a train.* switch (docs/speed.md):

  channels_last     NHWC memory format for the convolutional model: cuDNN's fast conv kernels; the
                    transformer stages keep it instead of copying to NCHW (transformer_io); with
                    compile=regional the ResNets' backward graphs too (conv_input_grad).
  compile=regional  torch.compile on each repeated block (transformer and ResNet blocks), not the whole
                    model: the same kernels fused, a fraction of the compile time, and one compiled
                    graph reused by every block of the same shape (core/speed.py compiles them).
  checkpoint_budget selective activation checkpointing over the UNet's units (checkpoint_units), chosen
                    by core/speed.py for a budget, instead of diffusers' all-or-nothing switch.
  fuse_qkv,         each attention's q/k/v (or k/v) projections as one matmul, and their LoRA (lora_matmul,
  lora_matmul       sdxl/lora_matmul.py) as one GEMM each way over the weight plus its delta; the
                    ResNets' LoRA'd convolutions (LoCon) as one convolution each way (merge_lora_convs),
                    the other LoRA'd Linears (feed-forward, proj_in/out) merged too (merge_lora_linears).
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Callable

import torch
import torch.nn.functional as F

from .lora_matmul import (base_linear, dequantizable, lora_factors, lora_way, conv_input_gradient,
                                dora_scale, lora_conv2d, lora_conv_pays, lora_linear, use_tensor_scaling)
from ..core import speed as core_speed
from ..core.speed import CheckpointUnit, _raise_recompile_limits, compile_options, compile_varying, sdpa_context

log = logging.getLogger(__name__)

# The UNet's repeated blocks, compiled one by one: train.compile="regional" compiles all of them;
# "transformer" only the attention blocks (the ResNets come in many widths, each its own compilation, for
# a smaller share of the step).
TRANSFORMER_CLASSES = ("BasicTransformerBlock",)
REGION_CLASSES = TRANSFORMER_CLASSES + ("ResnetBlock2D",)
# What changes between aspect buckets in each repeated block's input: the token count of a transformer
# block's hidden states, the height and width of a ResNet's feature map (core/speed.py: compile_regions).
BUCKET_VARYING = {"BasicTransformerBlock": ("hidden_states", 0, (1,)),
                  "ResnetBlock2D": ("input_tensor", 0, (2, 3))}

# train.speed="auto" compiles a run that trains at least this many images, by the smallest batch size each
# row applies from: (on a cold compile cache, on a warm one). Compiling pays once the compiled steps' time
# saved, against the graphed uncompiled steps, repays the compilation, which the first step waits for; a warm
# compile cache shortens the compilation several-fold. Derived from the measured rates and compile times
# (benchmarks/RESULTS.md#when-compiling-pays; docs/speed.md).
COMPILE_PAYS_FROM = ((1, 5_500, 1_700), (4, 22_000, 6_600))
# The train fields that change what the compiled regions are (with the model, the adapter and the data):
# a run that matches an earlier one's finds its compiled code in the compile cache. Not the levers auto
# chooses itself, which follow from these.
_COMPILED_TRAIN_FIELDS = ("batch_size", "mixed_precision", "fuse_qkv", "lora_matmul", "fused_geglu", "sdpa_backend",
                          "compile_activation_budget", "gradient_checkpointing", "checkpoint_budget_gb")


def compile_min_images(batch_size: int, warm: bool) -> int:
    """COMPILE_PAYS_FROM's threshold for this batch size and cache."""
    row = [r for r in COMPILE_PAYS_FROM if r[0] <= batch_size][-1]
    return row[2] if warm else row[1]


def _compiled_marker(cfg):
    """Where a run that compiled leaves its mark: in inductor's cache folder (clearing the cache clears the
    mark), named by what the compiled code depends on (torch's version, the model, adapter, data, and
    _COMPILED_TRAIN_FIELDS)."""
    from pathlib import Path

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    key = cfg.settings_key(_COMPILED_TRAIN_FIELDS, {"torch": torch.__version__})
    return Path(cache_dir()) / "sdxl_lora_compiled" / key


def compile_cache_warm(cfg) -> bool:
    """Whether a run with this config's model, adapter, data and step shapes compiled on this machine before
    (mark_compiled), so that its compilation now mostly reads inductor's cache."""
    return _compiled_marker(cfg).exists()


def mark_compiled(cfg) -> None:
    """After a run's regions compiled: the next run of the same kind finds the cache warm (compile_cache_warm)."""
    marker = _compiled_marker(cfg)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"torch {torch.__version__}\n")
    except OSError as e:  # the run goes on; a later run like it only counts the compile cache as cold
        log.warning("could not note in %s that this run compiled (%s): train.speed='auto' will count the compile "
                    "cache as cold for the next run like this one", marker.parent, e)


def auto_levers(cfg, device_type: str, processes: int):
    """train.speed="auto": the config with CUDA graphs, regional compilation and channels_last chosen for
    this device and run, and why each was chosen, as {field: reason}. A lever the config sets explicitly is
    kept as set; off a CUDA GPU, or with speed="off", nothing changes."""
    tc = cfg.train
    if tc.speed != "auto" or device_type != "cuda":
        return cfg, {}
    update, why = {}, {}

    def choose(name: str, value, reason: str) -> None:
        if name in tc.model_fields_set:
            why[name] = f"{getattr(tc, name)!r}, as set"
        else:
            update[name], why[name] = value, f"{value!r}: {reason}"

    checkpointed = tc.gradient_checkpointing or tc.checkpoint_budget_gb
    if checkpointed and cfg.adapter.dropout:
        choose("cuda_graphs", False, "adapter.dropout with checkpointing draws random numbers a graph cannot replay")
    elif processes > 1 and tc.gradient_sync == "ddp":
        choose("cuda_graphs", False, "train.gradient_sync='ddp' (DDP's hooks cannot be captured)")
    else:
        choose("cuda_graphs", True, "each bucket's forward and backward replayed at once, no launch overhead")
    images = tc.steps * tc.batch_size * tc.grad_accum * processes
    if cfg.model.quantize != "none" or cfg.model.quantize_convs != "none":
        choose("compile", "none", "not yet measured with a quantized base")
    else:
        warm = compile_cache_warm(cfg)
        least = compile_min_images(tc.batch_size, warm)
        cache = ("warm (this model, adapter, data and batch compiled here before)" if warm else
                 f"cold; {compile_min_images(tc.batch_size, True):,} once a run like this one has compiled here")
        if images < least:
            choose("compile", "none", f"the run trains {images:,} images, fewer than compiling pays for at batch "
                                      f"{tc.batch_size} ({least:,}; the compile cache is {cache})")
        else:
            choose("compile", "regional", f"the run trains {images:,} images, enough to repay compiling at batch "
                                          f"{tc.batch_size} ({least:,}; the compile cache is {cache})")
    compiled = update.get("compile", tc.compile) == "regional"
    choose("channels_last", compiled, "the compiled blocks' layout levers" if compiled
           else "it pays together with regional compilation")
    return cfg.model_copy(update={"train": tc.model_copy(update=update)}), why


# Inductor options for the UNet's compiled regions. combo_kernels: independent small kernels of a graph
# launched as one. Not triton.multi_kernel: a second compilation with it on a warm inductor cache fails in
# the backend, so a user's second run could fail (benchmarks/RESULTS.md#levers-measured-and-not-kept).
UNET_INDUCTOR_OPTIONS = {"combo_kernels": True}

# The widest row inductor reduces with the whole row held at once ("persistent": one read). Inductor's own
# limit is 1024 elements (InductorChoices.should_use_persistent_reduction); a wider row reduction is built
# looped, the row read twice (the mean and variance, then the normalisation). SDXL's 32x32 stages are 1280
# wide, so most of its transformer blocks' LayerNorms would be looped (benchmarks/RESULTS.md#what-each-lever-buys).
# 1024 gives inductor's own rule back.
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


@functools.cache
def _compiled_for_unet(fn: Callable, backend: str, varying: bool = False) -> Callable:
    """`fn` compiled once per backend for the UNet's regions (shared by every block it serves). varying:
    its feature maps' height and width (and a token sequence's length) differ between calls (several
    buckets), compiled as symbols."""
    _raise_recompile_limits()
    if not varying:
        return torch.compile(fn, **compile_options(backend, unet_inductor_options()))

    def feature_maps(args, kw):  # a token sequence's length, a feature map's height and width
        return [(a, (1,) if a.ndim == 3 else (2, 3)) for a in args if isinstance(a, torch.Tensor) and a.ndim in (3, 4)]

    return compile_varying(fn, feature_maps, **compile_options(backend, unet_inductor_options(), dynamic=None))


# ---- fused q/k/v projections ----
#
# Each attention of the UNet projects its input three times (to_q, to_k, to_v; cross-attention: to_k and
# to_v on the text tokens), each with its own LoRA: six small matmuls and three reads of the same input
# per projection set, which at small batch cost more in launches than in FLOPs. diffusers can fuse the base
# projections (Attention.fuse_projections) but its fused processor then skips peft's LoRA layers, so this
# is ours: one matmul for the frozen weights (the three base weights become views of one buffer: no extra
# memory), one for the LoRA A factors side by side and one for the B factors as a block-diagonal matrix
# (scaling folded in, read as a tensor: sdxl/lora_matmul.py TensorScaling). The trainable parameters stay
# peft's own, so saving and export are unchanged.

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


def _fused_projections(x: torch.Tensor, fused: torch.nn.Module, layers: tuple, matmul: str = "peft"
                       ) -> list[torch.Tensor]:
    factors = [lora_factors(layer, dora=True) for layer in layers]
    quantized = isinstance(fused, _QuantizedProjections)
    if any(f is None for f in factors) or (quantized and (
            not any(factors) or lora_way(matmul, x, fused.in_features) != "merged")):
        return [layer(x) for layer in layers]  # a quantized base's other ways: peft's own layers
    widths = [base_linear(layer).out_features for layer in layers]
    if not any(factors):
        out = F.linear(x, fused.weight)
    else:
        a = torch.cat([f[0] for f in factors if f])
        b = torch.block_diag(*[f[1] * f[2] if f else a.new_zeros(n, 0) for f, n in zip(factors, widths)])
        if quantized:
            out = lora_linear(x, fused.bases, None, a, b, "merged")
        else:
            out = lora_linear(x, fused.weight, None, a, b, lora_way(matmul, x, fused.weight.shape[1]))
        if any(f and f[3] is not None for f in factors):  # DoRA: each projection's columns by its own scale
            out = out * dora_scale(fused.bases if quantized else fused.weight, a, b,
                                   [f[3] if f else None for f in factors], widths, out.dtype).to(out.dtype)
    return list(out.split(widths, dim=-1))


def _projection(layer: torch.nn.Module, x: torch.Tensor, matmul: str, peft: Callable | None = None) -> torch.Tensor:
    """A single projection of the fused processor (the cross-attention's to_q, to_out.0) or a LoRA'd Linear
    elsewhere (merge_lora_linears): train.lora_matmul's way (or peft's products where it does not pay) where the
    layer is a plain LoRA'd or DoRA Linear with a frozen base ("merged" only, for a quantized base), else peft's
    forward (`peft`, else the layer's call)."""
    peft = peft or layer
    base = base_linear(layer)
    way = lora_way(matmul, x, base.in_features)
    if dequantizable(base) and way == "merged":
        weight = (base,)
    elif type(base) is torch.nn.Linear and not base.weight.requires_grad:
        weight = base.weight
    else:
        return peft(x)
    factors = lora_factors(layer, dora=True)
    if not factors:
        return peft(x)
    a, b, magnitude = factors[0], factors[1] * factors[2], factors[3]
    if magnitude is None:
        return lora_linear(x, weight, base.bias, a, b, way)
    y = lora_linear(x, weight, None, a, b, way)  # DoRA: the bias is added after the scale, as in peft
    y = y * dora_scale(weight, a, b, [magnitude], [base.out_features], y.dtype).to(y.dtype)
    return y if base.bias is None else y + base.bias.to(y.dtype)



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
    the processor computes its projections' LoRA: "peft" (peft's products) or "merged" (above).
    Quantized bases (dequantizable: QLoRA's nf4/fp4, fp8) are fused for "merged" only: their weights are
    dequantized into one buffer per call, the LoRA delta added to it (_LoRAMergedQuantized).
    Returns the number of attentions fused."""
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    n = 0
    for attn in model.modules():
        if not isinstance(attn, Attention) or type(attn.processor) is not AttnProcessor2_0:
            continue
        names = ("to_k", "to_v") if attn.is_cross_attention else ("to_q", "to_k", "to_v")
        bases = [base_linear(getattr(attn, name)) for name in names]
        if any(b.bias is not None for b in bases) or len({(b.in_features, b.weight.device) for b in bases}) != 1:
            continue
        if all(dequantizable(b) for b in bases):
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
        for layer in (attn.to_q, attn.to_k, attn.to_v, attn.to_out[0]):
            use_tensor_scaling(layer)
        n += 1
    return n


@contextlib.contextmanager
def stock_attention(model: torch.nn.Module):
    """Every attention fused over plain weights on diffusers' stock processor for the duration (then back on the
    fused one): the fused processor computes from the one buffer its base weights were made views of, which does
    not hold an adapter merged into copies of them (inject.merged_for_inference); the stock one calls the
    projections. So does every attention fused over quantized bases where any of its projections is not over them
    any more (inject.dequantized_for_inference replaced it by a 16-bit copy, the adapter folded in): the fused
    processor would compute from the quantized bases with only the adapters still in place, and the stock one
    calls whatever modules are in place, copies and quantized layers alike. The rest stay fused."""
    from diffusers.models.attention_processor import Attention

    def moves(attn: Attention) -> bool:
        holder = getattr(attn, "fused_kv" if attn.is_cross_attention else "fused_qkv", None)
        if isinstance(holder, _QuantizedProjections):
            names = ("to_k", "to_v") if attn.is_cross_attention else ("to_q", "to_k", "to_v")
            return any(base_linear(getattr(attn, n)) is not b for n, b in zip(names, holder.bases))
        return isinstance(holder, _FusedWeight)

    fused = [m for m in model.modules() if isinstance(m, Attention)
             and isinstance(m.processor, FusedProjectionsProcessor) and moves(m)]
    processors = [attn.processor for attn in fused]
    try:
        for attn, processor in zip(fused, processors):
            attn.processor = processor.stock
        yield len(fused)
    finally:
        for attn, processor in zip(fused, processors):
            attn.processor = processor


def _lora_linear_forward(self, x, *args, **kwargs):
    if args or kwargs:
        return type(self).forward(self, x, *args, **kwargs)
    return _projection(self, x, "merged", peft=lambda x: type(self).forward(self, x))


def merge_lora_linears(model: torch.nn.Module) -> int:
    """train.lora_matmul="merged" for the LoRA'd Linears outside the attentions (the feed-forward's, the
    transformer stages' proj_in/proj_out: presets full and locon), where the fused processor does not reach:
    peft's forward adds an output-sized LoRA product to the base's (the GEGLU's is 8x the width), merged folds
    it into the weight. Each call takes _projection's way for its shape, DoRA included, and peft's where that
    cannot. Returns how many."""
    import types

    from diffusers.models.attention_processor import Attention

    inside = {id(m) for attn in model.modules() if isinstance(attn, Attention) for m in attn.modules()}
    n = 0
    for m in model.modules():
        base = getattr(m, "base_layer", None)
        if (hasattr(m, "lora_A") and id(m) not in inside and base is not None
                and (dequantizable(base) or (type(base) is torch.nn.Linear and not base.weight.requires_grad))):
            m.forward = types.MethodType(_lora_linear_forward, m)
            use_tensor_scaling(m)
            n += 1
    return n


# ---- the transformers' way in and out ----
#
# diffusers' Transformer2DModel (SDXL's attention stages) runs its GroupNorm and projections outside the
# transformer blocks, so compile=regional leaves them eager, and it ends with `.permute(0, 3, 1, 2)
# .contiguous()`: under channels_last that is a transposing copy to NCHW, then an add of mixed layouts, and
# the next convolution converts back. Here the way out keeps the layout the permute gives (NHWC in memory,
# channels_last, the same values), and with compilation both ways are compiled too (one small graph each,
# shared by every stage of one shape): fewer eager copies and mixed-layout adds a step
# (benchmarks/RESULTS.md#what-each-lever-buys).

def _transformer_in(self, hidden_states):
    batch, inner_dim, height, width = hidden_states.shape
    hidden_states = self.norm(hidden_states).permute(0, 2, 3, 1).reshape(batch, height * width, inner_dim)
    return self.proj_in(hidden_states), inner_dim


def _transformer_out(self, hidden_states, residual):
    # The feature map's shape from the residual, not from the ints diffusers passes: a compiled graph would
    # be specialised to each bucket's ints.
    batch_size, _, height, width = residual.shape
    hidden_states = self.proj_out(hidden_states).reshape(batch_size, height, width, -1)
    return hidden_states.permute(0, 3, 1, 2) + residual


def _way_out(fn: Callable) -> Callable:
    """diffusers' _get_output_for_continuous_inputs(hidden_states, residual, batch, height, width, inner_dim)
    as `fn(self, hidden_states, residual)`."""
    def way_out(self, hidden_states, residual, *shape, **named_shape):
        return fn(self, hidden_states, residual)
    return way_out


def transformer_io(model: torch.nn.Module, compile: bool, backend: str | None = None, varying: bool = False) -> int:
    """With channels_last: every Transformer2DModel with continuous input and linear projections (SDXL's) gets
    the ways in and out above, compiled with `compile` (their shapes varying across buckets with `varying`).
    Returns how many."""
    import types

    fns = (_transformer_in, _transformer_out)
    if compile:
        fns = tuple(_compiled_for_unet(fn, backend or core_speed.COMPILE_BACKEND, varying) for fn in fns)
    n = 0
    for m in model.modules():
        if type(m).__name__ == "Transformer2DModel" and m.is_input_continuous and m.use_linear_projection:
            m._operate_on_continuous_inputs = types.MethodType(fns[0], m)
            m._get_output_for_continuous_inputs = types.MethodType(_way_out(fns[1]), m)
            n += 1
    return n


# ---- the convolutions' input gradient, channels_last in compiled backward graphs ----
#
# Inductor lays out a graph's tensors channels_last around its convolutions only when the graph holds an
# aten.convolution (GraphLowering.decide_layout_opt); a compiled ResNet's backward graph holds
# aten.convolution_backward instead, so the gradient it hands to each convolution's backward is written
# NCHW and cuDNN copies it (and the saved input) to channels_last first, at each convolution every step
# (benchmarks/RESULTS.md#what-each-lever-buys). Here the input's gradient is the transposed convolution of
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
            dx = conv_input_gradient(grad, weight, ctx.x_size, stride, padding, dilation, groups)
        if ctx.needs_input_grad[1]:
            dw = torch.nn.grad.conv2d_weight(x.to(grad.dtype), weight.shape, grad, stride, padding, dilation, groups)
        if ctx.bias and ctx.needs_input_grad[2]:
            db = grad.sum((0, 2, 3))
        return dx, dw, db, None, None, None, None


def _conv_forward(self, x):
    return _Conv2dGrad.apply(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


def conv_input_grad(model: torch.nn.Module) -> int:
    """With channels_last and compile: the Conv2d layers inside ResNet blocks (what compile="regional" compiles)
    and upsamplers compute their input's gradient as above; a frozen one then keeps no input for its backward.
    Plain zero-padded 2-D convolutions only (SDXL's); others keep torch's. Returns how many."""
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


# ---- the ResNets' LoRA'd convolutions (LoCon), merged ----
#
# peft computes a LoRA'd convolution as base(x) + B(A(x)) * s: three cuDNN convolutions each way, A's with r
# output channels (and its weight gradient) far below the memory bandwidth, and two adds of base-sized tensors.
# train.lora_matmul="merged" computes it as one convolution with W + s B A each way and A's products as GEMMs
# (sdxl/lora_matmul.py: _LoRAConvMerged), where the feature map is large enough to repay the merged weight,
# and peft's three convolutions where it is not. Both read the scaling as a tensor (sdxl/lora_matmul.py:
# TensorScaling), so ResNets whose convolutions scale differently share one compiled graph.

def _lora_conv_forward(self, x, *args, **kwargs):
    factors = lora_factors(self) if not (args or kwargs) else None
    if not factors:
        return type(self).forward(self, x, *args, **kwargs)
    a, b, scaling = factors
    base = self.base_layer
    b = b * scaling
    if lora_conv_pays(x, base.weight, base.stride):
        return lora_conv2d(x, base.weight, base.bias, a, b, base.stride, base.padding)
    # peft's three convolutions, with B's weight scaled by the scaling tensor instead of B's output by peft's float
    # (a float's value is guarded in compiled code); through _Conv2dGrad as conv_input_grad runs peft's.
    y = base(x)
    h = _Conv2dGrad.apply(self._cast_input_dtype(x, a.dtype), a, None, base.stride, base.padding, (1, 1), 1)
    return (y + _Conv2dGrad.apply(h, b, None, (1, 1), (0, 0), (1, 1), 1)).to(y.dtype)


def merge_lora_convs(model: torch.nn.Module) -> int:
    """train.lora_matmul="merged" for the LoRA'd convolutions inside ResNet blocks: peft's Conv2d LoRA layers
    over a frozen plain zero-padded 2-D convolution (no groups, no dilation). A small feature map takes peft's
    products; the layer falls back to peft's forward at each call it cannot take (dropout, DoRA, several or
    disabled adapters). Returns how many."""
    import types

    n = 0
    for block in model.modules():
        if type(block).__name__ != "ResnetBlock2D":
            continue
        for m in block.modules():
            base = getattr(m, "base_layer", None)
            if (hasattr(m, "lora_A") and type(base) is torch.nn.Conv2d and not base.weight.requires_grad
                    and base.groups == 1 and base.dilation == (1, 1) and base.padding_mode == "zeros"
                    and not isinstance(base.padding, str)):
                m.forward = types.MethodType(_lora_conv_forward, m)
                use_tensor_scaling(m)
                n += 1
    return n


# ---- selective activation checkpointing ----
#
# diffusers checkpoints a UNet in units, each behind a `gradient_checkpointing` switch: a block's switch
# checkpoints its ResNets one by one, a Transformer2DModel's switch its transformer layers. diffusers only
# turns them all on or all off (at a large cost in step time); here each unit is switched on its own, the units that
# free the most memory per FLOP of recomputation first, until a measured step fits the budget.
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

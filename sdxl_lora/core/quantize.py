"""Frozen-base quantization (QLoRA): the Linear layers of a model stored in 4, 8 or fp8 bits, the
LoRA adapters on top kept in full precision.

  nf4, fp4   bitsandbytes Linear4bit (NormalFloat4 / FP4, blocks of 64, optional double quantization
             of the block scales): ~0.52 bytes a weight.
  int8       bitsandbytes Linear8bitLt (LLM.int8, outliers above 6 sigma kept in 16 bits): ~1 byte.
  fp8        float8_e4m3fn storage with one fp32 scale per output channel, dequantized to the compute
             dtype in each forward and again in backward: ~1 byte. bitsandbytes has no fp8 Linear, so
             this one is ours (Float8Linear below).

quantize_model quantizes nn.Linear only (bitsandbytes has no quantized convolution); quantize_convs
(model.quantize_convs="fp8") stores the frozen nn.Conv2d layers in fp8 the same way (Float8Conv2d below),
else SDXL's convolutions (13% of its weights) stay in the compute dtype. Layers are quantized one at a
time on the target device, so the full-precision model never sits there whole. peft puts LoRA on
bitsandbytes layers with its own bnb classes (it looks for the `is_loaded_in_4bit` / `is_loaded_in_8bit`
flags set here), on Float8Linear with its plain Linear (it is an nn.Linear with in_features/out_features)
and on Float8Conv2d with its plain Conv2d.
"""
from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

METHODS = ("none", "nf4", "fp4", "int8", "fp8")
CONV_METHODS = ("none", "fp8")  # model.quantize_convs
_BNB_METHODS = ("nf4", "fp4", "int8")
# Outlier threshold of LLM.int8 (transformers' default): activations above it go through a 16-bit path.
INT8_THRESHOLD = 6.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class QuantizationError(RuntimeError):
    """Quantization cannot be done as asked; the message says why and what to do."""


@dataclass
class QuantReport:
    method: str
    layers: int = 0                 # layers quantized
    skipped: list[str] = field(default_factory=list)   # layers left as they were (skip(name) was True)
    params: int = 0                 # weights in the quantized layers
    bytes_before: int = 0           # those weights as they were stored before
    bytes_after: int = 0            # their quantized storage, scales and quantization state included
    compute_dtype: torch.dtype = torch.bfloat16
    kind: str = "Linear"            # what was quantized: "Linear" (quantize_model) or "Conv2d" (quantize_convs)

    @property
    def bytes_compute(self) -> int:
        """What the quantized layers' weights would take in the compute dtype (the unquantized baseline)."""
        return self.params * torch.empty((), dtype=self.compute_dtype).element_size()

    def __str__(self) -> str:
        gib = 2**30
        ratio = self.bytes_compute / self.bytes_after if self.bytes_after else 0.0
        return (f"{self.method}: {self.layers} {self.kind} layers quantized ({len(self.skipped)} kept), "
                f"{self.params / 1e6:.1f}M weights: {self.bytes_before / gib:.3f} GiB as loaded, "
                f"{self.bytes_compute / gib:.3f} GiB in {str(self.compute_dtype).removeprefix('torch.')}, "
                f"{self.bytes_after / gib:.3f} GiB {self.method} ({ratio:.1f}x smaller)")


def bitsandbytes_installed() -> bool:
    """Whether the qlora extra is installed."""
    return importlib.util.find_spec("bitsandbytes") is not None


def plannable_bases(kind: str, candidates: tuple[str, ...]) -> list[str]:
    """The quantized bases out of `candidates` a memory planner may choose for an adapter of `kind`: those this
    install loads (bitsandbytes' only with the qlora extra; fp8 needs torch alone) and the kind trains over."""
    from .config import kind_refuses_base

    return [q for q in candidates
            if (q == "fp8" or bitsandbytes_installed()) and not kind_refuses_base(kind, q)]


def require_bitsandbytes(method: str, field_name: str = "model.quantize"):
    """bitsandbytes, or a clear error naming the extra that installs it."""
    if not bitsandbytes_installed():
        raise QuantizationError(f"{field_name}={method!r} needs bitsandbytes, which is not installed; install the "
                                "qlora extra (pip install 'sdxl_lora[qlora]'), or set "
                                f"{field_name}='fp8' (torch only) or 'none'")
    import bitsandbytes

    return bitsandbytes


def resolve_compute_dtype(name: str, mixed_precision: str | None) -> torch.dtype:
    """model.quant_compute_dtype: 'auto' follows the training precision (bf16/fp16), else fp32."""
    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if name == "auto":
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision or "no", torch.float32)
    if name not in table:
        raise QuantizationError(f"model.quant_compute_dtype={name!r}: must be one of auto, bf16, fp16, fp32")
    return table[name]


def _check_device(method: str, device: torch.device, field_name: str = "model.quantize") -> None:
    if method == "fp8":
        if not hasattr(torch, "float8_e4m3fn"):
            raise QuantizationError(f"{field_name}='fp8' needs torch.float8_e4m3fn (torch >= 2.1); "
                                    f"this torch is {torch.__version__}")
        return
    if device.type not in ("cpu", "cuda"):
        raise QuantizationError(f"model.quantize={method!r}: bitsandbytes here runs on CPU and CUDA, not on "
                                f"{device.type}; use model.quantize='fp8' or 'none' there")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (5, 0):
            raise QuantizationError(f"model.quantize={method!r}: this GPU ({torch.cuda.get_device_name(device)}, "
                                    f"compute capability {major}.{minor}) is older than bitsandbytes supports (5.0)")


# ---- fp8 ----------------------------------------------------------------------------------------
# torch has float8 tensors but no fp8 layers that train on every device, and bitsandbytes has no fp8 at all
# (nor any quantized convolution), so these layers are ours. Shared by Float8Linear and Float8Conv2d: one
# fp32 scale per output channel (dim 0), the bits as uint8 and the scales as int32 views of fp32, because
# `model.to(torch.bfloat16)` and peft's adapter placement cast every floating-point tensor of a module,
# which would silently turn fp8 weights back into 16-bit ones; integer tensors they leave alone.

def _fp8_store(layer: nn.Module, weight: torch.Tensor, device: torch.device | str) -> None:
    """Set layer.weight (float8_e4m3fn bits as uint8) and layer.weight_scale (fp32 bits as int32) from `weight`."""
    w = weight.detach().to(device, torch.float32)
    scale = (w.abs().flatten(1).amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w / scale.view(-1, *[1] * (w.dim() - 1))).to(torch.float8_e4m3fn)
    layer.weight = nn.Parameter(q.view(torch.uint8), requires_grad=False)
    layer.register_buffer("weight_scale", scale.contiguous().view(torch.int32))


def _fp8_dequantized(layer: nn.Module, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    scale = layer.weight_scale.view(torch.float32).view(-1, *[1] * (layer.weight.dim() - 1))
    # e4m3 values are exact in bf16/fp16, so the product in the target dtype rounds once, like a
    # 16-bit weight would; no full-size fp32 temporary on the device.
    return torch.mul(layer.weight.view(torch.float8_e4m3fn).to(dtype), scale.to(dtype), out=out)


def _forward_dtype(layer: nn.Module, x: torch.Tensor) -> tuple[bool, torch.dtype]:
    """(autocast on?, the dtype to compute in): under autocast its dtype, which the layer also returns (as
    torch's own Linear and Conv2d do); otherwise the layer's compute dtype, and the output in the input's."""
    if torch.is_autocast_enabled(x.device.type):
        return True, torch.get_autocast_dtype(x.device.type)
    return False, layer.compute_dtype


class _Fp8Weights:
    """Mixed into Float8Linear and Float8Conv2d: fp8 storage of a frozen layer's weight (_fp8_store), its
    bias in the compute dtype, and the weight dequantized on demand."""

    def _store_fp8(self, source: nn.Module, compute_dtype: torch.dtype, device: torch.device | str) -> None:
        self.compute_dtype = compute_dtype
        _fp8_store(self, source.weight, device)
        self.bias = (None if source.bias is None else
                     nn.Parameter(source.bias.detach().to(device, compute_dtype), requires_grad=False))

    def dequantized(self, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        return _fp8_dequantized(self, dtype or self.compute_dtype, out=out)


class _DequantizedMatmul(torch.autograd.Function):
    """x @ W^T + bias with W dequantized on the fly (layer.dequantized: fp8, or bitsandbytes 4-bit) and the
    frozen bias added by the GEMM (a separate add is a pass over every output:
    benchmarks/RESULTS.md#what-each-lever-buys). Saving
    only the quantized weight for backward (not the dequantized one, as F.linear would) keeps a compute-dtype
    copy of every weight off the device."""

    @staticmethod
    def forward(ctx, x, layer, bias):
        ctx.layer = layer
        return F.linear(x, layer.dequantized(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        dbias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None  # a trained bias
        return grad @ ctx.layer.dequantized(grad.dtype), None, dbias


class Float8Linear(_Fp8Weights, nn.Linear):
    """A frozen Linear with float8_e4m3fn weights and one fp32 scale per output channel (stored as
    uint8/int32, see _fp8_store)."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype, device: torch.device | str):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._store_fp8(linear, compute_dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _dequantized_linear(self, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3fn"


class _Fp8Conv(torch.autograd.Function):
    """conv2d(x, W) with W dequantized from fp8 on the fly; padding already applied, no bias. Backward
    needs only the input's shape and the layer (for a freshly dequantized W): F.conv2d would save the
    input and the dequantized weight, a compute-dtype copy of every frozen convolution."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer, ctx.input_shape = layer, x.shape
        return F.conv2d(x, layer.dequantized(x.dtype), None, layer.stride, 0, layer.dilation, layer.groups)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:  # e.g. conv_in: the noisy latents need no gradient
            return None, None
        layer = ctx.layer
        return torch.nn.grad.conv2d_input(ctx.input_shape, layer.dequantized(grad.dtype), grad, layer.stride, 0,
                                          layer.dilation, layer.groups), None


class Float8Conv2d(_Fp8Weights, nn.Conv2d):
    """A frozen Conv2d with float8_e4m3fn weights and one fp32 scale per output channel (stored as
    uint8/int32, see _fp8_store); the bias stays in the compute dtype. Any padding (numbers, "same",
    "valid") and padding_mode are applied with F.pad before the convolution, which then pads nothing."""

    def __new__(cls, *args, **kwargs):
        # peft builds a Conv2d LoRA's A and B as `type(base_layer)(in_channels, r, kernel_size, ...)`: with
        # nn.Conv2d's arguments this gives a plain (trainable) nn.Conv2d, not an fp8 one.
        if args and not isinstance(args[0], nn.Conv2d):
            return nn.Conv2d(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, conv: nn.Conv2d, compute_dtype: torch.dtype, device: torch.device | str):
        nn.Module.__init__(self)
        for attr in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "transposed",
                     "output_padding", "groups", "padding_mode", "_reversed_padding_repeated_twice"):
            setattr(self, attr, getattr(conv, attr))
        self._store_fp8(conv, compute_dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        autocast, dtype = _forward_dtype(self, x)
        unbatched = x.dim() == 3
        with torch.autocast(x.device.type, enabled=False):
            h = x.to(dtype)
            h = h.unsqueeze(0) if unbatched else h
            if any(self._reversed_padding_repeated_twice):
                mode = "constant" if self.padding_mode == "zeros" else self.padding_mode
                h = F.pad(h, self._reversed_padding_repeated_twice, mode=mode)
            out = _Fp8Conv.apply(h, self)
            if self.bias is not None:
                out = out + self.bias.to(dtype)[:, None, None]
            out = out.squeeze(0) if unbatched else out
        return out if autocast else out.to(x.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fp8_e4m3fn"


# ---- bitsandbytes -------------------------------------------------------------------------------

class _AutocastOutput:
    """Mixed into bitsandbytes' Linear4bit/Linear8bitLt: under autocast the layer computes in the autocast
    dtype and returns it, as torch's own Linear does.

    Why: bitsandbytes casts its output back to the input's dtype, and under autocast the input is often
    fp32 (LayerNorm and GroupNorm run in fp32 there). So every quantized projection after a norm (SDXL's
    to_q/k/v, the feed-forward's input projection, proj_in/proj_out) gave fp32 activations, which the next
    ops then saved for backward at twice the size and computed on in fp32: more memory an image and a much
    slower step than bf16 (benchmarks/RESULTS.md#qlora-memory)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if torch.is_autocast_enabled(device):
            with torch.autocast(device, enabled=False):
                return super().forward(x.to(torch.get_autocast_dtype(device)))
        return super().forward(x)


def _dequantize_4bit_fn(device: torch.device) -> Callable | None:
    """kernels.dequantize_4bit (one Triton kernel where bitsandbytes launches three with double quantization)
    on CUDA with Triton; None elsewhere: bitsandbytes' own kernels then."""
    from . import kernels

    return kernels.dequantize_4bit if device.type == "cuda" and kernels.triton is not None else None


def dequantize_4bit(weight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """A bitsandbytes Params4bit dequantized to `dtype` in its (out, in) shape, into `out` when given."""
    import bitsandbytes.functional as bnbf

    state = weight.quant_state
    fn = _dequantize_4bit_fn(weight.device)
    if fn is not None:
        out = torch.empty(state.shape, dtype=dtype, device=weight.device) if out is None else out
        s2 = state.state2 if state.nested else None
        fn(out, weight.data, state.code, state.absmax, state.blocksize,
           *((s2.code, s2.absmax, state.offset, s2.blocksize) if s2 is not None else (None, None, None, 0)))
        return out
    if out is not None and state.dtype == dtype and out.is_cuda:  # bitsandbytes' CPU backend has no `out=`
        return bnbf.dequantize_4bit(weight.data, state, out=out)
    w = bnbf.dequantize_4bit(weight.data, state).to(dtype)
    return w if out is None else out.copy_(w)


def _dequantized_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A frozen quantized Linear's forward through _DequantizedMatmul, in autocast's dtype under autocast."""
    autocast, dtype = _forward_dtype(layer, x)
    with torch.autocast(x.device.type, enabled=False):
        out = _DequantizedMatmul.apply(x.to(dtype), layer, None if layer.bias is None else layer.bias.to(dtype))
    return out if autocast else out.to(x.dtype)


class _Trains4bit(_AutocastOutput):
    """Mixed into bitsandbytes' Linear4bit: where it trains (more than one row of input) on CUDA, its
    product is _DequantizedMatmul over dequantize_4bit (one kernel: kernels.dequantize_4bit) instead of
    bitsandbytes' matmul_4bit: the same dequantized weight and GEMM each way. A single row (generation) keeps
    bitsandbytes' own path, its 4-bit GEMV; so does the CPU."""

    def dequantized(self, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        return dequantize_4bit(self.weight, dtype or self.compute_dtype, out=out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[-1] or _dequantize_4bit_fn(x.device) is None:
            return super().forward(x)
        return _dequantized_linear(self, x)


_AUTOCAST_CLASSES: dict[type, type] = {}


def _autocast_class(base: type, mixin: type = _AutocastOutput) -> type:
    """`base` with `mixin` (_AutocastOutput or a subclass) mixed in (a subclass: peft and isinstance checks
    still see `base`)."""
    if base not in _AUTOCAST_CLASSES:
        _AUTOCAST_CLASSES[base] = type(base.__name__, (mixin, base), {"__module__": __name__})
    return _AUTOCAST_CLASSES[base]


def _bnb_layer(bnb, linear: nn.Linear, method: str, compute_dtype: torch.dtype, double_quant: bool,
               device: torch.device) -> nn.Module:
    w = linear.weight.detach().to(compute_dtype)
    if method in ("nf4", "fp4"):
        q = _autocast_class(bnb.nn.Linear4bit, _Trains4bit)(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              compute_dtype=compute_dtype, compress_statistics=double_quant, quant_type=method,
                              device="meta")
        q.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=double_quant, quant_type=method,
                                     module=q)
        # On CPUs with AVX512-BF16, bitsandbytes (0.49+) repacks a 4-bit weight in place for an inference-only
        # kernel the first time the layer runs in eval mode without gradients; a training forward after that
        # fails in its in-place bias add, and the weight no longer dequantizes as 4-bit. A run evaluates and
        # trains the same layers, so they keep the layout that trains.
        if hasattr(q, "support_avx512bf16_for_cpu"):
            q.support_avx512bf16_for_cpu = False
    else:
        q = _autocast_class(bnb.nn.Linear8bitLt)(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                has_fp16_weights=False, threshold=INT8_THRESHOLD, device="meta")
        q.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
        q.compute_dtype = compute_dtype  # Linear8bitLt has none of its own; dequantize_model reads it
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.detach().to(compute_dtype), requires_grad=False)
    # Moving the parameters to the device is what quantizes them (bitsandbytes does it in .to()).
    return q.to(device)


def _quantized_bytes(mod: nn.Module) -> int:
    w = mod.weight
    n = w.numel() * w.element_size()
    qs = getattr(w, "quant_state", None)
    if qs is not None:  # 4-bit: block scales (and, with double quantization, their own scales)
        n += qs.absmax.numel() * qs.absmax.element_size()
        if qs.nested and qs.state2 is not None:
            n += qs.state2.absmax.numel() * qs.state2.absmax.element_size() + qs.state2.code.numel() * 4
        n += qs.code.numel() * qs.code.element_size()
    scb = getattr(w, "SCB", None)
    if scb is not None:
        n += scb.numel() * scb.element_size()
    scale = getattr(mod, "weight_scale", None)
    if scale is not None:
        n += scale.numel() * scale.element_size()
    return n


def quantized_classes() -> tuple[type, ...]:
    """The layer classes a quantized base is made of (bitsandbytes' only where it is loaded)."""
    classes: list[type] = [Float8Linear, Float8Conv2d]
    bnb = sys.modules.get("bitsandbytes")  # loaded if anything was quantized with it
    if bnb is not None:
        classes += [bnb.nn.Linear4bit, bnb.nn.Linear8bitLt]
    return tuple(classes)


def _set_child(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _replace_layers(model: nn.Module, cls: type, make: Callable[[nn.Module, str], nn.Module], report: QuantReport,
                    skip: Callable[[str], bool] | None) -> None:
    """Replace every `cls` layer of the model (not already quantized, not a LoRA layer, not skipped) by
    make(layer, name), one at a time, filling in the report."""
    done = quantized_classes()
    todo = []
    for name, mod in model.named_modules():
        if not isinstance(mod, cls) or isinstance(mod, done) or "lora_" in name:
            continue
        if mod.weight.device.type == "meta":
            raise QuantizationError(f"{name}: the model is on the meta device (no weights); load it first")
        if skip is not None and skip(name):
            report.skipped.append(name)
        else:
            todo.append(name)
    for name in tqdm(todo, desc=f"quantizing {report.kind} ({report.method})", unit="layer", disable=len(todo) < 50):
        layer = model.get_submodule(name)
        report.params += layer.weight.numel()
        report.bytes_before += layer.weight.numel() * layer.weight.element_size()
        q = make(layer, name)
        q.train(layer.training)
        _set_child(model, name, q)
        report.bytes_after += _quantized_bytes(q)
        report.layers += 1


def quantize_model(model: nn.Module, method: str, *, compute_dtype: torch.dtype = torch.bfloat16,
                   double_quant: bool = True, device: torch.device | str = "cpu",
                   skip: Callable[[str], bool] | None = None) -> QuantReport:
    """Replace the model's nn.Linear layers in place by quantized ones on `device`, one layer at a time
    (each is moved there and quantized there; the full-precision copy is dropped before the next), except
    those whose module path `skip` accepts. Everything else stays where and as it is. Returns what changed."""
    if method not in METHODS:
        raise QuantizationError(f"model.quantize={method!r}: must be one of {', '.join(METHODS)}")
    report = QuantReport(method, compute_dtype=compute_dtype)
    if method == "none":
        return report
    device = torch.device(device)
    _check_device(method, device)
    bnb = require_bitsandbytes(method) if method in _BNB_METHODS else None

    def make(linear: nn.Linear, name: str) -> nn.Module:
        try:
            return (Float8Linear(linear, compute_dtype, device) if bnb is None
                    else _bnb_layer(bnb, linear, method, compute_dtype, double_quant, device))
        except (RuntimeError, NotImplementedError) as e:
            raise QuantizationError(f"model.quantize={method!r} failed on {name} ({device}): {e}. bitsandbytes "
                                    f"{getattr(bnb, '__version__', '')} may not support {method} on this device; "
                                    "try another model.quantize or model.quant_compute_dtype") from e

    _replace_layers(model, nn.Linear, make, report, skip)
    # peft picks its bitsandbytes LoRA layers by these flags (as transformers sets them).
    if method in ("nf4", "fp4"):
        model.is_loaded_in_4bit = True
    elif method == "int8":
        model.is_loaded_in_8bit = True
    model.sdxl_lora_quantize = method
    return report


def quantize_convs(model: nn.Module, method: str = "fp8", *, compute_dtype: torch.dtype = torch.bfloat16,
                   device: torch.device | str = "cpu", skip: Callable[[str], bool] | None = None) -> QuantReport:
    """Replace the model's frozen nn.Conv2d layers in place by Float8Conv2d on `device`, one at a time, as
    quantize_model does for Linears (the two combine: any model.quantize with model.quantize_convs="fp8").
    Their weights become frozen, as quantize_model's Linears do. Convolutions inside LoRA layers (module paths
    with "lora_") are left alone; a Float8Conv2d can itself get a LoRA from peft."""
    if method not in CONV_METHODS:
        raise QuantizationError(f"model.quantize_convs={method!r}: must be one of {', '.join(CONV_METHODS)}")
    report = QuantReport(method, compute_dtype=compute_dtype, kind="Conv2d")
    if method == "none":
        return report
    device = torch.device(device)
    _check_device(method, device, "model.quantize_convs")
    _replace_layers(model, nn.Conv2d, lambda conv, name: Float8Conv2d(conv, compute_dtype, device), report, skip)
    return report


def dequantize_weight(mod: nn.Module) -> torch.Tensor:
    """A quantized layer's weight in full precision (fp32), as its forward sees it."""
    if isinstance(mod, (Float8Linear, Float8Conv2d)):
        return mod.dequantized(torch.float32)
    bnb = sys.modules["bitsandbytes"]
    w = mod.weight
    if isinstance(mod, bnb.nn.Linear4bit):
        return bnb.functional.dequantize_4bit(w.data, w.quant_state).float()
    if isinstance(mod, bnb.nn.Linear8bitLt):
        # The row scales move from the weight to the layer's state at its first forward.
        scb = w.SCB if w.SCB is not None else mod.state.SCB
        return w.data.float() * scb.float()[:, None] / 127.0
    raise TypeError(f"{type(mod).__name__} is not a quantized layer")


def plain_layer(mod: nn.Module, weight: torch.Tensor) -> nn.Module:
    """A plain nn.Linear (nn.Conv2d for Float8Conv2d) in place of the quantized layer `mod`, frozen, holding
    `weight` (its dequantized weight, changed or not) and its bias in the layer's compute dtype."""
    dtype = getattr(mod, "compute_dtype", None) or torch.float32
    if isinstance(mod, Float8Conv2d):
        plain = nn.Conv2d(mod.in_channels, mod.out_channels, mod.kernel_size, mod.stride, mod.padding,
                          mod.dilation, mod.groups, bias=mod.bias is not None, padding_mode=mod.padding_mode,
                          device="meta")
    else:
        plain = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
    plain.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    if mod.bias is not None:
        plain.bias = nn.Parameter(mod.bias.detach().to(dtype), requires_grad=False)
    plain.train(mod.training)
    return plain


@torch.no_grad()
def dequantize_model(model: nn.Module) -> None:
    """Turn every quantized layer back into a plain nn.Linear (or nn.Conv2d) in its compute dtype (for
    merging, or to compare against). peft LoRA layers keep their adapters; only their base layers change."""
    classes = quantized_classes()
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, classes):
            continue
        _set_child(model, name, plain_layer(mod, dequantize_weight(mod)))
    for flag in ("is_loaded_in_4bit", "is_loaded_in_8bit", "sdxl_lora_quantize"):
        if flag in model.__dict__:
            delattr(model, flag)


def is_quantized(model: nn.Module) -> bool:
    classes = quantized_classes()
    return any(isinstance(m, classes) for m in model.modules())

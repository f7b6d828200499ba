"""Frozen-base quantization (QLoRA): the Linear layers of a model stored in 4, 8 or fp8 bits, the
LoRA adapters on top kept in full precision.

  nf4, fp4   bitsandbytes Linear4bit (NormalFloat4 / FP4, blocks of 64, optional double quantization
             of the block scales): ~0.52 bytes a weight.
  int8       bitsandbytes Linear8bitLt (LLM.int8, outliers above 6 sigma kept in 16 bits): ~1 byte.
  fp8        float8_e4m3fn storage with one fp32 scale per output channel, dequantized to the compute
             dtype in each forward and again in backward: ~1 byte. bitsandbytes has no fp8 Linear, so
             this one is ours (Float8Linear below).

Only nn.Linear is quantized (bitsandbytes has no quantized convolution): SDXL's convolutions (13% of
its weights) stay in the compute dtype. Layers are quantized one at a time on the target device, so the
full-precision model never sits there whole. peft puts LoRA on bitsandbytes layers with its own bnb
classes (it looks for the `is_loaded_in_4bit` / `is_loaded_in_8bit` flags set here), and on Float8Linear
with its plain Linear (it is an nn.Linear with in_features/out_features).
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
_BNB_METHODS = ("nf4", "fp4", "int8")
# Outlier threshold of LLM.int8 (transformers' default): activations above it go through a 16-bit path.
INT8_THRESHOLD = 6.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class QuantizationError(RuntimeError):
    """Quantization cannot be done as asked; the message says why and what to do."""


@dataclass
class QuantReport:
    method: str
    layers: int = 0                 # Linear layers quantized
    skipped: list[str] = field(default_factory=list)   # Linear layers left as they were (skip(name) was True)
    params: int = 0                 # weights in the quantized layers
    bytes_before: int = 0           # those weights as they were stored before
    bytes_after: int = 0            # their quantized storage, scales and quantization state included
    compute_dtype: torch.dtype = torch.bfloat16

    @property
    def bytes_compute(self) -> int:
        """What the quantized layers' weights would take in the compute dtype (the unquantized baseline)."""
        return self.params * torch.empty((), dtype=self.compute_dtype).element_size()

    def __str__(self) -> str:
        gib = 2**30
        ratio = self.bytes_compute / self.bytes_after if self.bytes_after else 0.0
        return (f"{self.method}: {self.layers} Linear layers quantized ({len(self.skipped)} kept), "
                f"{self.params / 1e6:.1f}M weights: {self.bytes_before / gib:.3f} GiB as loaded, "
                f"{self.bytes_compute / gib:.3f} GiB in {str(self.compute_dtype).removeprefix('torch.')}, "
                f"{self.bytes_after / gib:.3f} GiB {self.method} ({ratio:.1f}x smaller)")


def require_bitsandbytes(method: str, field_name: str = "model.quantize"):
    """bitsandbytes, or a clear error naming the extra that installs it."""
    if importlib.util.find_spec("bitsandbytes") is None:
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


def _check_device(method: str, device: torch.device) -> None:
    if method == "fp8":
        if not hasattr(torch, "float8_e4m3fn"):
            raise QuantizationError(f"model.quantize='fp8' needs torch.float8_e4m3fn (torch >= 2.1); "
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

class _Fp8Matmul(torch.autograd.Function):
    """x @ W^T with W dequantized from fp8 on the fly. Saving only the fp8 weight for backward (not the
    dequantized one, as F.linear would) keeps a compute-dtype copy of every weight off the device."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        return F.linear(x, layer.dequantized(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.layer.dequantized(grad.dtype), None


class Float8Linear(nn.Linear):
    """A frozen Linear with float8_e4m3fn weights and one fp32 scale per output channel.

    The bits are stored as uint8 and the scales as int32 views of fp32: `model.to(torch.bfloat16)` and
    peft's adapter placement cast every floating-point tensor of a module, which would silently turn
    fp8 weights back into 16-bit ones; integer tensors they leave alone."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype, device: torch.device | str):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = compute_dtype
        w = linear.weight.detach().to(device, torch.float32)
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        q = (w / scale).to(torch.float8_e4m3fn)
        self.weight = nn.Parameter(q.view(torch.uint8), requires_grad=False)
        self.register_buffer("weight_scale", scale.reshape(-1).contiguous().view(torch.int32))
        self.bias = (None if linear.bias is None else
                     nn.Parameter(linear.bias.detach().to(device, compute_dtype), requires_grad=False))

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.compute_dtype
        scale = self.weight_scale.view(torch.float32)[:, None]
        # e4m3 values are exact in bf16/fp16, so the product in the target dtype rounds once, like a
        # 16-bit weight would; no full-size fp32 temporary on the device.
        return self.weight.view(torch.float8_e4m3fn).to(dtype) * scale.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        autocast = torch.is_autocast_enabled(x.device.type)
        dtype = torch.get_autocast_dtype(x.device.type) if autocast else self.compute_dtype
        with torch.autocast(x.device.type, enabled=False):
            out = _Fp8Matmul.apply(x.to(dtype), self)
            if self.bias is not None:
                out = out + self.bias.to(dtype)
        return out if autocast else out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3fn"


# ---- bitsandbytes -------------------------------------------------------------------------------

def _bnb_layer(bnb, linear: nn.Linear, method: str, compute_dtype: torch.dtype, double_quant: bool,
               device: torch.device) -> nn.Module:
    w = linear.weight.detach().to(compute_dtype)
    if method in ("nf4", "fp4"):
        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              compute_dtype=compute_dtype, compress_statistics=double_quant, quant_type=method,
                              device="meta")
        q.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=double_quant, quant_type=method,
                                     module=q)
    else:
        q = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
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


def _quantized_classes() -> tuple[type, ...]:
    classes: list[type] = [Float8Linear]
    bnb = sys.modules.get("bitsandbytes")  # loaded if anything was quantized with it
    if bnb is not None:
        classes += [bnb.nn.Linear4bit, bnb.nn.Linear8bitLt]
    return tuple(classes)


def _set_child(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


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
    done = _quantized_classes()
    todo = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or isinstance(mod, done) or "lora_" in name:
            continue
        if mod.weight.device.type == "meta":
            raise QuantizationError(f"{name}: the model is on the meta device (no weights); load it first")
        if skip is not None and skip(name):
            report.skipped.append(name)
        else:
            todo.append(name)
    for name in tqdm(todo, desc=f"quantizing ({method})", unit="layer", disable=len(todo) < 50):
        linear = model.get_submodule(name)
        report.params += linear.weight.numel()
        report.bytes_before += linear.weight.numel() * linear.weight.element_size()
        try:
            q = (Float8Linear(linear, compute_dtype, device) if bnb is None
                 else _bnb_layer(bnb, linear, method, compute_dtype, double_quant, device))
        except (RuntimeError, NotImplementedError) as e:
            raise QuantizationError(f"model.quantize={method!r} failed on {name} ({device}): {e}. bitsandbytes "
                                    f"{getattr(bnb, '__version__', '')} may not support {method} on this device; "
                                    "try another model.quantize or model.quant_compute_dtype") from e
        q.train(linear.training)
        _set_child(model, name, q)
        report.bytes_after += _quantized_bytes(q)
        report.layers += 1
    # peft picks its bitsandbytes LoRA layers by these flags (as transformers sets them).
    if method in ("nf4", "fp4"):
        model.is_loaded_in_4bit = True
    elif method == "int8":
        model.is_loaded_in_8bit = True
    model.sdxl_lora_quantize = method
    return report


def dequantize_weight(mod: nn.Module) -> torch.Tensor:
    """A quantized layer's weight in full precision (fp32), as its forward sees it."""
    if isinstance(mod, Float8Linear):
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


@torch.no_grad()
def dequantize_model(model: nn.Module) -> None:
    """Turn every quantized layer back into a plain nn.Linear in its compute dtype (for merging, or to
    compare against). peft LoRA layers keep their adapters; only their base layers change."""
    classes = _quantized_classes()
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, classes):
            continue
        dtype = getattr(mod, "compute_dtype", None) or torch.float32
        w = dequantize_weight(mod)
        lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
        lin.weight = nn.Parameter(w.to(dtype), requires_grad=False)
        if mod.bias is not None:
            lin.bias = nn.Parameter(mod.bias.detach().to(dtype), requires_grad=False)
        _set_child(model, name, lin)
    for flag in ("is_loaded_in_4bit", "is_loaded_in_8bit", "sdxl_lora_quantize"):
        if flag in model.__dict__:
            delattr(model, flag)


def is_quantized(model: nn.Module) -> bool:
    classes = _quantized_classes()
    return any(isinstance(m, classes) for m in model.modules())


def unet_skip(name: str) -> bool:
    """Layers of an SDXL UNet kept in the compute dtype: the timestep and size/crop embeddings (7M of
    2.2B Linear weights) condition every block, so their error would reach everything, for nothing saved."""
    return name.startswith(("time_embedding.", "add_embedding."))


def quantize_unet(unet: nn.Module, model_cfg, mixed_precision: str | None, device, run=None) -> QuantReport:
    """model.quantize for a training run's UNet: its Linears quantized on `device` (embeddings kept),
    the report logged and, with a run, recorded as a "quantize" event."""
    import logging

    compute = resolve_compute_dtype(model_cfg.quant_compute_dtype, mixed_precision)
    report = quantize_model(unet, model_cfg.quantize, compute_dtype=compute, double_quant=model_cfg.quant_double,
                            device=device, skip=unet_skip)
    logging.getLogger(__name__).info("quantized the UNet: %s", report)
    if run is not None:
        run.event("quantize", method=report.method, layers=report.layers, kept=report.skipped, params=report.params,
                  bytes_before=report.bytes_before, bytes_after=report.bytes_after,
                  compute_dtype=str(compute).removeprefix("torch."), double_quant=model_cfg.quant_double)
    return report

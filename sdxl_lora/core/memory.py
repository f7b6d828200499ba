"""Bytes of a training run's state that any model has: frozen weights by storage (quantized or not), the
adapter, its gradients and the optimizer's state. A task adds its activation model (sdxl/memory.py)."""
from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import nn

from .accel import indexed

log = logging.getLogger(__name__)
T = TypeVar("T")

GiB = 2**30
# The whole process on a GPU, beyond what a task's estimate counts: the CUDA context and library handles
# (cuBLAS, cuDNN) outside torch's allocator, and the allocator's reserve over what is allocated at the peak.
CONTEXT = int(0.85 * GiB)
# What the cap (cap_process_memory) leaves outside torch's allocator: the largest context measured under a
# budget rather than the usual one, so that the whole process stays within the budget
# (benchmarks/RESULTS.md#memory-budgets).
CAP_CONTEXT = int(0.95 * GiB)
RESERVE = 1.05
# The share of a memory budget (train.vram_gb) a plan fills: the estimates are within about this of measured peaks.
BUDGET_FILL = 0.9

# Optimizer state in bytes per trainable parameter.
OPTIMIZER_BYTES = {"adamw": 8.0, "adamw8bit": 2.0, "paged_adamw8bit": 2.0, "paged_adamw": 8.0,
                   "lion": 4.0, "prodigy": 16.0,
                   # z and the second moment, as AdamW's two moments
                   "adamw_schedulefree": 8.0,
                   # the first moment, plus factored second moments and residuals (twice adafactor's)
                   "came": 4.5,
                   # factored second moments: (rows + columns) per matrix, ~4/rank bytes for LoRA at rank 16
                   "adafactor": 0.25}


def fp8_conv_bytes(conv: nn.Conv2d) -> int:
    """Storage of a Float8Conv2d: 1 byte a weight and one fp32 scale per output channel."""
    return conv.weight.numel() + 4 * conv.out_channels


def quantized_bytes_per_weight(method: str, double_quant: bool, in_features: int) -> float:
    """Storage of one weight of a quantized Linear, its scales included."""
    if method in ("nf4", "fp4"):
        # 4 bits, one scale per block of 64: fp32, or (double) 8-bit with an fp32 scale per 256 blocks.
        return 0.5 + ((1 + 4 / 256) / 64 if double_quant else 4 / 64)
    if method in ("int8", "fp8"):
        return 1.0 + 4.0 / in_features  # one fp32 scale per output row
    raise ValueError(f"model.quantize={method!r} is not a quantization method")



def state_bytes(trainable_params: int, optimizer: str) -> dict[str, int]:
    """The fp32 adapter, its gradients and the optimizer's state, in bytes."""
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"train.optimizer={optimizer!r}: no memory model for it; known: {', '.join(OPTIMIZER_BYTES)}")
    return {"adapter": 4 * trainable_params, "gradients": 4 * trainable_params,
            "optimizer": int(trainable_params * OPTIMIZER_BYTES[optimizer])}


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def quantized_layers(model: nn.Module, quantize: str, skip=None, quantize_convs: str = "none",
                     conv_skip=None) -> tuple[list[nn.Linear], list[nn.Conv2d]]:
    """The layers a model's quantization stores quantized, unquantized as yet (the meta device will do): the Linear
    layers with `quantize`, the convolutions with quantize_convs="fp8", adapters' own layers and skipped names left
    out."""
    linears, convs = [], []
    for name, mod in model.named_modules():
        if "lora_" in name:
            continue
        if quantize != "none" and isinstance(mod, nn.Linear) and not (skip and skip(name)):
            linears.append(mod)
        elif quantize_convs == "fp8" and isinstance(mod, nn.Conv2d) and not (conv_skip and conv_skip(name)):
            convs.append(mod)
    return linears, convs


def weight_bytes(unet: nn.Module, quantize: str, double_quant: bool, compute_dtype: torch.dtype,
                 skip=None, quantize_convs: str = "none", conv_skip=None) -> dict[str, int]:
    """The frozen model's bytes by storage: quantized Linear weights, with quantize_convs="fp8" the
    convolutions (key "fp8 conv"), everything else in the compute dtype."""
    elt = torch.empty((), dtype=compute_dtype).element_size()
    plain_name = DTYPE_NAMES.get(compute_dtype, str(compute_dtype))
    out = {quantize: 0} if quantize != "none" else {}
    out[plain_name] = 0
    quantized = set()
    linears, convs = quantized_layers(unet, quantize, skip, quantize_convs, conv_skip)
    for mod in linears:
        out[quantize] += round(mod.weight.numel() * quantized_bytes_per_weight(quantize, double_quant, mod.in_features))
        quantized.add(id(mod.weight))
    if quantize_convs == "fp8":
        out["fp8 conv"] = 0
        for mod in convs:
            out["fp8 conv"] += fp8_conv_bytes(mod)
            quantized.add(id(mod.weight))
    out[plain_name] = out.pop(plain_name)  # listed last
    for name, p in unet.named_parameters():
        if id(p) not in quantized and "lora_" not in name:
            out[plain_name] += p.numel() * elt
    return out


def cap_process_memory(device: torch.device, gib: float) -> bool:
    """train.vram_gb on a GPU: torch's allocator capped so that the process (its CUDA context besides) stays
    within `gib`; a larger GPU then behaves as a card of that size, raising out-of-memory where that card
    would instead of using more. False (and nothing capped) when the GPU is no larger than the budget."""
    index = indexed(device).index  # the cap needs the index that "cuda" leaves out
    total = torch.cuda.get_device_properties(index).total_memory
    if gib * GiB >= total:
        return False
    torch.cuda.set_per_process_memory_fraction((gib * GiB - CAP_CONTEXT) / total, index)
    return True


def first_that_fits(ways: Sequence[tuple[str, Callable[[], T]]], *, device: torch.device, run, step: int,
                    what: str) -> T | None:
    """For work a run can do without (previews): each of `ways` (what the log calls it, the call) in turn until one
    does not run out of GPU memory, and its result; None where every one ran out. Between tries the memory a
    failed one held goes back to the device, and each failure is a warning and a `<what>_out_of_memory` event
    naming what comes next ("skipped" after the last): training goes on."""
    for i, (_, call) in enumerate(ways):
        try:
            return call()
        except torch.OutOfMemoryError as e:
            oom = str(e).strip().splitlines()[0] if str(e).strip() else "CUDA out of memory"
        # Outside the handler: its traceback no longer holds the failed try's tensors.
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        then = ways[i + 1][0] if i + 1 < len(ways) else "skipped"
        log.warning("%s at step %d: the GPU ran out of memory (%s); %s", what, step, oom[:200], then)
        run.event(f"{what}_out_of_memory", step=step, error=oom[:300], then=then)
    return None

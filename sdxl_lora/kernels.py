"""Hand-written GPU kernels where the compiled ones or the libraries' measured slow (docs/speed.md,
benchmarks/RESULTS.md): GEGLU's backward, and the 4-bit dequantization of QLoRA's Linears (at the end).

GEGLU's backward (train.fused_geglu). SDXL's feed-forward projects to [hidden | gate] (2 x 5120 wide at
1280 channels) and multiplies hidden by gelu(gate). Autograd's backward of the chunk is a concatenation, and
inductor builds it as one element-wise kernel over the concatenated output that loads both halves for every
element: on the H200 it ran at ~1.2-1.4 TB/s, 48 ms of a 634 ms batch-16 step (70 calls) and 3 ms of a 64
ms batch-1 step. The kernel here reads each input once and writes both halves of the gradient from the same
program. The forward stays torch's own ops, so the compiler fuses it as before.

On the CPU (and without Triton) the same custom op runs torch's element-wise ops: the same function.
"""
from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F

try:  # Triton comes with CUDA builds of torch; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only installs
    triton = None


def _geglu_backward_reference(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """d(hidden * gelu(gate)) / d[hidden | gate], computed in fp32 and returned in x's dtype."""
    h, g = x.float().chunk(2, dim=-1)
    go = grad.float()
    cdf = 0.5 * (1.0 + torch.erf(g * (1.0 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * g * g) * (1.0 / math.sqrt(2.0 * math.pi))
    return torch.cat([go * g * cdf, go * h * (cdf + g * pdf)], dim=-1).to(x.dtype)


if triton is not None:
    @triton.jit
    def _geglu_backward_kernel(x_ptr, grad_ptr, out_ptr, n, BLOCK: tl.constexpr):
        # One program: BLOCK columns of one row. Row r of x (and of the output) is [hidden | gate], 2n wide.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        xi = row * 2 * n + cols
        h = tl.load(x_ptr + xi, mask=mask).to(tl.float32)
        g = tl.load(x_ptr + xi + n, mask=mask).to(tl.float32)
        go = tl.load(grad_ptr + row * n + cols, mask=mask).to(tl.float32)
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        pdf = tl.exp(-0.5 * g * g) * 0.3989422804014327
        tl.store(out_ptr + xi, (go * g * cdf).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + xi + n, (go * h * (cdf + g * pdf)).to(out_ptr.dtype.element_ty), mask=mask)


@torch.library.custom_op("sdxl_lora::geglu_backward", mutates_args=())
def geglu_backward(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    if not (x.is_cuda and triton is not None):
        return _geglu_backward_reference(x, grad)
    x, grad = x.contiguous(), grad.contiguous()
    n = grad.shape[-1]
    out = torch.empty_like(x)
    rows = x.numel() // (2 * n)
    block = min(1024, triton.next_power_of_2(n))
    _geglu_backward_kernel[(rows, triton.cdiv(n, block))](x, grad, out, n, BLOCK=block, num_warps=4)
    return out


@geglu_backward.register_fake
def _(x, grad):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


class _GEGLU(torch.autograd.Function):
    @staticmethod
    def forward(x):
        h, g = x.chunk(2, dim=-1)
        return h * F.gelu(g)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return geglu_backward(x, grad)


def geglu(x: torch.Tensor) -> torch.Tensor:
    """hidden * gelu(gate) for x = [hidden | gate] on the last dimension, with the backward above."""
    return _GEGLU.apply(x)


def _geglu_forward(self, hidden_states, *args, **kwargs):
    return geglu(self.proj(hidden_states))


def use_fused_geglu(model: torch.nn.Module) -> int:
    """train.fused_geglu: every diffusers GEGLU (exact gelu) computes through geglu() above. Returns how many."""
    n = 0
    for m in model.modules():
        if type(m).__name__ == "GEGLU":
            m.forward = types.MethodType(_geglu_forward, m)
            n += 1
    return n


# ---- 4-bit dequantization (QLoRA: model.quantize = "nf4"/"fp4") ----
#
# bitsandbytes stores a 4-bit weight as two values a byte (the first in the high nibble), indices into a
# 16-value code (nf4 or fp4), with one fp32 scale per block of 64 values; with double quantization (our
# model.quant_double, on by default) the scales are themselves 8-bit codes into a 256-value code, with one
# fp32 scale per 256 of them plus an offset. bitsandbytes dequantizes those in three kernels (the scales'
# codes, the offset, then the weight) and a QLoRA step dequantizes every 4-bit Linear two or three times
# (forward, the checkpointed recompute, backward): ~1,000 calls a batch-4 SDXL step. Here it is one kernel.
# (A torch.compile of the reference below was 10-16x slower than bitsandbytes' kernels on the H200:
# benchmarks/RESULTS.md, session 10.)

def _dequantize_4bit_reference(out: torch.Tensor, packed: torch.Tensor, code: torch.Tensor, absmax: torch.Tensor,
                               blocksize: int, code2: torch.Tensor | None, absmax2: torch.Tensor | None,
                               offset: torch.Tensor | None, blocksize2: int) -> None:
    """The dequantization as torch ops over the flat output index, into `out` (contiguous, any shape)."""
    flat = out.view(-1)
    i = torch.arange(flat.numel(), device=out.device)
    byte = packed.reshape(-1)[i // 2].to(torch.int32)
    nibble = torch.where(i % 2 == 0, byte >> 4, byte & 0xF)
    block = i // blocksize
    if code2 is None:
        scale = absmax[block]
    else:
        scale = code2[absmax[block].to(torch.int32)] * absmax2[block // blocksize2]
        scale = scale + offset  # rounded apart, as bitsandbytes does (no fused multiply-add)
    flat.copy_(code[nibble] * scale)


if triton is not None:
    @triton.jit
    def _dequantize_4bit_kernel(packed_ptr, code_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, out_ptr,
                                n_out, BYTES_PER_BLOCK: tl.constexpr, BLOCKSIZE2: tl.constexpr,
                                NESTED: tl.constexpr, BLOCK: tl.constexpr):
        # One program: BLOCK bytes in, 2 x BLOCK values out (byte i gives values 2i and 2i + 1).
        start = tl.program_id(0).to(tl.int64) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        mask = 2 * offs < n_out
        byte = tl.load(packed_ptr + offs, mask=mask, other=0).to(tl.int32)
        block = offs // BYTES_PER_BLOCK
        if NESTED:
            q = tl.load(absmax_ptr + block, mask=mask, other=0).to(tl.int32)
            # Multiply, then add: launched without fp fusion, so no fused multiply-add rounds differently
            # from bitsandbytes' two kernels.
            scale = tl.load(code2_ptr + q) * tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=mask, other=0.0)
            scale = scale + tl.load(offset_ptr)
        else:
            scale = tl.load(absmax_ptr + block, mask=mask, other=0.0)
        hi = tl.load(code_ptr + (byte >> 4)) * scale
        lo = tl.load(code_ptr + (byte & 0xF)) * scale
        out_offs = 2 * start + tl.arange(0, 2 * BLOCK)
        tl.store(out_ptr + out_offs, tl.interleave(hi, lo).to(out_ptr.dtype.element_ty), mask=out_offs < n_out)


@torch.library.custom_op("sdxl_lora::dequantize_4bit", mutates_args=("out",))
def dequantize_4bit(out: torch.Tensor, packed: torch.Tensor, code: torch.Tensor, absmax: torch.Tensor,
                    blocksize: int, code2: torch.Tensor | None, absmax2: torch.Tensor | None,
                    offset: torch.Tensor | None, blocksize2: int) -> None:
    """bitsandbytes' 4-bit dequantization into `out` (contiguous): one Triton kernel on CUDA, the same
    values as bitsandbytes.functional.dequantize_4bit (tested against it on the CPU through the reference,
    checked on the GPU by benchmarks/dequant4bit.py)."""
    if not (out.is_cuda and triton is not None):
        return _dequantize_4bit_reference(out, packed, code, absmax, blocksize, code2, absmax2, offset, blocksize2)
    nested = code2 is not None
    n_out, block = out.numel(), 1024
    _dequantize_4bit_kernel[(triton.cdiv(n_out, 2 * block),)](
        packed, code, absmax, code2 if nested else code, absmax2 if nested else absmax,
        offset if nested else absmax, out, n_out, BYTES_PER_BLOCK=blocksize // 2, BLOCKSIZE2=max(blocksize2, 1),
        NESTED=nested, BLOCK=block, num_warps=4, enable_fp_fusion=False)

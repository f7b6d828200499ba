"""GEGLU's backward as one hand-written Triton kernel (train.fused_geglu), for the SDXL UNet's feed-forward.

SDXL's feed-forward projects to [hidden | gate] (2 x 5120 wide at 1280 channels) and multiplies hidden by
gelu(gate). Autograd's backward of the chunk is a concatenation, and inductor builds it as one element-wise
kernel over the concatenated output that loads both halves for every element. The kernel here reads each
input once and writes both halves of the gradient from the same program
(benchmarks/RESULTS.md#kernels-measured-alone). The forward stays torch's own ops, so the compiler fuses it as before.

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

"""What a LoRA'd Linear costs beside its frozen base at SDXL's batch-16 shapes, forward and backward, in
the ways it can be written, so a change to the trainer's projections rests on a measurement (round 7 of
issue 9 measured addmm, slower in the compiled step; round 9 the trainer's train.lora_matmul ways):

    python benchmarks/lora_linear.py [--batch 16] [--iters 20] [--compile]

Variants (x: tokens x K, W: N x K frozen, A: r x K, B: N x r trainable, s the scaling):
  base     F.linear(x, W) alone (the floor: a frozen layer without LoRA)
  peft     F.linear(x, W) + F.linear(F.linear(x, A), B) * s, as peft's Linear does
  addmm    the B product accumulated into the base product by the GEMM (addmm, beta = 1), and in the
           backward the A product into the input's gradient, instead of separate tensors and adds
  merged   x @ (W + s B A)^T: one GEMM each way with the delta folded into the weight (bf16)
           (the trainer's train.lora_matmul = "merged")
  concat   [x, xA^T] @ [W, sB]^T: the B product inside the base GEMM (K grows by r), no separate LoRA output
           or add; backward: dy @ [W, sB] gives the input's gradient and dy B s in one GEMM, then + (dy B s) A
           (the trainer's train.lora_matmul = "concat" until it was removed, slower than merged in the step)
  concat_fold  the same forward (exact); backward: dy @ [W + sBA, sB], the A product folded into the weight
           (rounded to bf16) for the input's gradient alone: one GEMM, no (dy B s) A product and no add
  merged_fusedgrad  merged, with dy B and B's gradient from one Triton kernel that reads dy once
           (benchmarks/lora_grad.py; round 9, measured in session 10 and not kept)
  merged_extf  merged with x A^T from the base GEMM, x @ [W + sBA; A]^T (N grows by r): one rank-r product
           and its read of x fewer (session 10: the same GPU time as merged, not kept)
  merged_extb  merged with dy sB from the input's-gradient GEMM, dy @ [W + sBA, sB] (K grows by r; session
           10: 14% slower per batch-16 step's projections, not kept)
  merged_ext   both
Prints one JSON row per shape and variant: ms for forward + backward (wall time; --kernel-time: the GPU time
of its kernels, what a CUDA-graphed step pays), the largest difference of the output and of the gradients
from peft's in fp32. --tiny runs small shapes on the CPU (a smoke test).
"""
from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F

from lora_grad import lora_dy_products  # benchmarks/lora_grad.py
from sdxl_lora.sdxl.lora_matmul import _LoRAMerged, lora_linear as trainer_lora_linear
from timing import lora_variant_row  # benchmarks/timing.py (this script's folder is on the path)


class _AddmmLoRA(torch.autograd.Function):
    """F.linear(x, w) + F.linear(F.linear(x, a), b) with the B product accumulated into the base product by
    the GEMM (addmm, beta = 1), and in the backward the A product into the input's gradient (b scaled)."""

    @staticmethod
    def forward(ctx, x, w, bias, a, b):
        x2 = x.reshape(-1, x.shape[-1])
        h = x2 @ a.t()
        y = torch.addmm(x2 @ w.t(), h, b.t())
        ctx.save_for_backward(x2, w, a, b, h)
        ctx.x_shape = x.shape
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, w, a, b, h = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        g = dy2 @ b
        dx = torch.addmm(dy2 @ w, g, a)
        return dx.reshape(ctx.x_shape), None, None, g.t() @ x2, dy2.t() @ h


class _Concat(torch.autograd.Function):
    """[x, x a^T] @ [w, b]^T (b scaled), and in the backward dy @ [w, b] for the input's gradient and dy b."""

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
        return (dxc[:, :k] + dh @ a).reshape(ctx.x_shape), None, None, dh.t() @ xc[:, :k], dy2.t() @ xc[:, k:]


class _ConcatFold(_Concat):
    """_Concat's forward; backward: the input's gradient through w + b a (rounded to the compute dtype) and dy b
    in one GEMM, no (dy b) a product and no add."""

    @staticmethod
    def backward(ctx, dy):
        xc, w, a, b = ctx.saved_tensors
        k = w.shape[1]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dxc = dy2 @ torch.cat([torch.addmm(w, b, a), b], dim=1)
        return dxc[:, :k].reshape(ctx.x_shape), None, None, dxc[:, k:].t() @ xc[:, :k], dy2.t() @ xc[:, k:]


class _MergedFusedGrad(_LoRAMerged):
    """The trainer's "merged" forward; backward: dy B and B's gradient by one kernel reading dy once
    (benchmarks/lora_grad.py)."""

    @staticmethod
    def backward(ctx, dy):
        x2, h, w, a, b = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dh, db = lora_dy_products(dy2, b, h)
        return (dy2 @ torch.addmm(w, b, a)).reshape(ctx.x_shape), None, None, dh.t() @ x2, db


def _ext_forward(ctx, x, w, bias, a, b):
    """merged's forward with x A^T from the base GEMM: x @ [W + sBA; A; 0]^T, A's rows padded with zeros to a
    multiple of 8 (16 bytes) so the output's row stride stays aligned for the attention kernels."""
    x2 = x.reshape(-1, x.shape[-1])
    n, r = w.shape[0], a.shape[0]
    wx = torch.cat([torch.addmm(w, b, a), a, a.new_zeros(-r % 8, a.shape[1])])
    yh = F.linear(x2, wx, None if bias is None else F.pad(bias, (0, wx.shape[0] - n)))
    ctx.save_for_backward(x2, yh[:, n:n + r].contiguous(), w, a, b)  # not a view: yh would stay alive
    ctx.x_shape = x.shape
    return yh[:, :n].reshape(*x.shape[:-1], n)


def _ext_backward(ctx, dy):
    """merged's backward with dy sB from the input's-gradient GEMM: dy @ [W + sBA, sB, 0]."""
    x2, h, w, a, b = ctx.saved_tensors
    k, r = w.shape[1], a.shape[0]
    dy2 = dy.reshape(-1, dy.shape[-1])
    dxh = dy2 @ torch.cat([torch.addmm(w, b, a), b, b.new_zeros(w.shape[0], -r % 8)], dim=1)
    dh = dxh[:, k:k + r]
    return dxh[:, :k].reshape(ctx.x_shape), None, None, dh.t() @ x2, dy2.t() @ h


class _MergedExtF(_LoRAMerged):
    """The trainer's "merged" with _ext_forward (x A^T from the base GEMM)."""
    forward = staticmethod(_ext_forward)


class _MergedExtB(_LoRAMerged):
    """The trainer's "merged" with _ext_backward (dy sB from the input's-gradient GEMM)."""
    backward = staticmethod(_ext_backward)


class _MergedExt(_LoRAMerged):
    """The trainer's "merged" with both: two of its four rank-r products (and their reads of x and dy) gone."""
    forward = staticmethod(_ext_forward)
    backward = staticmethod(_ext_backward)


def _own(fn, x, w, a, b, s):
    """One of this script's functions in autocast's dtype, as F.linear would run (the factors' gradients
    reach them through the casts)."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    with torch.autocast(x.device.type, enabled=False):
        return fn.apply(x.to(dtype), w.to(dtype), None, a.to(dtype), (b * s).to(dtype))


def merged(x, w, a, b, s):
    return trainer_lora_linear(x, w, None, a, b * s, "merged")


# This script's own autograd functions, each called as the variants above: f(x, w, a, b, s)
concat, concat_fold, addmm, merged_fusedgrad, merged_extf, merged_extb, merged_ext = (
    functools.partial(_own, fn) for fn in (_Concat, _ConcatFold, _AddmmLoRA, _MergedFusedGrad, _MergedExtF,
                                           _MergedExtB, _MergedExt))


# name: (tokens per image, K, N, factors side by side): the fused q/k/v (N = 3K, the three A factors side by
# side and B block-diagonal, as train.fuse_qkv multiplies them) and a single projection, at both levels
SHAPES = {
    "32 q/k/v fused": (1024, 1280, 3 * 1280, 3),
    "32 out": (1024, 1280, 1280, 1),
    "64 q/k/v fused": (4096, 640, 3 * 640, 3),
    "64 out": (4096, 640, 640, 1),
    "32 ff in (GEGLU)": (1024, 1280, 8 * 1280, 1),
    "32 ff out": (1024, 4 * 1280, 1280, 1),
}


def peft(x, w, a, b, s):
    return F.linear(x, w) + F.linear(F.linear(x, a), b) * s


def base(x, w, a, b, s):
    return F.linear(x, w)


VARIANTS = {"base": base, "peft": peft, "addmm": addmm, "merged": merged, "concat": concat, "concat_fold": concat_fold,
            "merged_fusedgrad": merged_fusedgrad, "merged_extf": merged_extf, "merged_extb": merged_extb,
            "merged_ext": merged_ext}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--compile", action="store_true", help="torch.compile each variant's forward")
    p.add_argument("--tiny", action="store_true", help="small shapes on the CPU")
    p.add_argument("--kernel-time", action="store_true",
                   help="GPU time of the kernels (torch's profiler) instead of wall time per call")
    p.add_argument("--only", nargs="+", choices=list(VARIANTS), help="these variants (peft always runs first)")
    args = p.parse_args(argv)
    dev = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    shapes = {"tiny": (8, 32, 96, 3)} if args.tiny else SHAPES
    for name, (tokens, k, n, factors) in shapes.items():
        r = args.rank * factors
        m = tokens * args.batch
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(m, k, generator=g).to(dev, dtype).requires_grad_()
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dev, dtype)
        a = (torch.randn(r, k, generator=g) / k ** 0.5).to(dev).requires_grad_()
        b = (torch.randn(n, r, generator=g) * 0.01).to(dev).requires_grad_()
        dy = torch.randn(m, n, generator=g).to(dev, dtype)
        s = 1.0
        ref = None
        for vname, fn in VARIANTS.items():
            if args.only and vname not in args.only and vname != "peft":
                continue
            f = torch.compile(fn) if args.compile else fn

            def step():
                for t in (x, a, b):
                    t.grad = None
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                    y = f(x, w, a, b, s)
                y.backward(dy)
                return y

            row = {"shape": name, "M": m, "K": k, "N": n, "r": r, "variant": vname}
            row, ref = lora_variant_row(row, step, x, a, b, ref, args.kernel_time and dev.type == "cuda", args.iters,
                                        sync)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""What a LoRA'd Linear costs beside its frozen base at SDXL's batch-16 shapes, forward and backward, in
the ways it can be written, so a change to the trainer's projections rests on a measurement (round 7 of
issue 9: neither rewrite beat peft's in the compiled step, so the trainer keeps peft's; they live here):

    python benchmarks/lora_linear.py [--batch 16] [--iters 20] [--compile]

Variants (x: tokens x K, W: N x K frozen, A: r x K, B: N x r trainable, s the scaling):
  base     F.linear(x, W) alone (the floor: a frozen layer without LoRA)
  peft     F.linear(x, W) + F.linear(F.linear(x, A), B) * s, as peft's Linear does
  addmm    the B product accumulated into the base product by the GEMM (addmm, beta = 1), and in the
           backward the A product into the input's gradient, instead of separate tensors and adds
  merged   x @ (W + s B A)^T: one GEMM each way with the delta folded into the weight (bf16)
Prints one JSON row per shape and variant: ms for forward + backward, the largest difference of the
output and of the gradients from peft's in fp32. --tiny runs small shapes on the CPU (a smoke test).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from timing import timed  # benchmarks/timing.py (this script's folder is on the path)


class _LoRALinear(torch.autograd.Function):
    """F.linear(x, w, bias) + F.linear(F.linear(x, a), b) * scale with the gradients of x, a and b written out
    (the frozen w and bias get none): `merged` multiplies by w + scale b a instead (one GEMM each way, the
    delta rounded into the bf16 weight), otherwise the GEMMs accumulate (addmm)."""

    @staticmethod
    def forward(ctx, x, w, a, b, scale, merged):
        x2 = x.reshape(-1, x.shape[-1])
        h = x2 @ a.t()
        if merged:
            y = x2 @ torch.addmm(w, b, a, alpha=scale).t()
        else:
            y = torch.addmm(x2 @ w.t(), h, b.t(), alpha=scale)
        ctx.save_for_backward(x2, w, a, b, h)
        ctx.scale, ctx.merged, ctx.x_shape = scale, merged, x.shape
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, w, a, b, h = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        g = (dy2 @ b) * ctx.scale
        if ctx.merged:
            dx = dy2 @ torch.addmm(w, b, a, alpha=ctx.scale)
        else:
            dx = torch.addmm(dy2 @ w, g, a)
        return dx.reshape(ctx.x_shape), None, g.t() @ x2, (dy2.t() @ h) * ctx.scale, None, None


def lora_linear(x, w, a, b, scale, merged=False):
    """Everything in autocast's dtype, as F.linear would run; the factors' gradients reach them through the casts."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    with torch.autocast(x.device.type, enabled=False):
        return _LoRALinear.apply(x.to(dtype), w.to(dtype), a.to(dtype), b.to(dtype), scale, merged)

# name: (tokens per image, K, N, factors side by side): the fused q/k/v (N = 3K, the three A factors side by
# side and B block-diagonal, as train.fuse_qkv multiplies them) and a single projection, at both levels
SHAPES = {
    "32 q/k/v fused": (1024, 1280, 3 * 1280, 3),
    "32 out": (1024, 1280, 1280, 1),
    "64 q/k/v fused": (4096, 640, 3 * 640, 3),
    "64 out": (4096, 640, 640, 1),
}


def peft(x, w, a, b, s):
    return F.linear(x, w) + F.linear(F.linear(x, a), b) * s


def merged(x, w, a, b, s):
    return lora_linear(x, w, a, b, s, merged=True)


def base(x, w, a, b, s):
    return F.linear(x, w)


def addmm(x, w, a, b, s):
    return lora_linear(x, w, a, b, s)


VARIANTS = {"base": base, "peft": peft, "addmm": addmm, "merged": merged}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--compile", action="store_true", help="torch.compile each variant's forward")
    p.add_argument("--tiny", action="store_true", help="small shapes on the CPU")
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
            f = torch.compile(fn) if args.compile else fn

            def step():
                for t in (x, a, b):
                    t.grad = None
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                    y = f(x, w, a, b, s)
                y.backward(dy)
                return y

            y = step()
            got = [y.float(), x.grad.float(), a.grad, b.grad]
            row = {"shape": name, "M": m, "K": k, "N": n, "r": r, "variant": vname}
            if vname == "peft":
                ref = got
            elif ref is not None and vname != "base":
                row["max_diff"] = [round((u - v).abs().max().item(), 5) for u, v in zip(got, ref)]
                row["ref_max"] = [round(v.abs().max().item(), 3) for v in ref]
            row["ms_fwd_bwd"] = round(timed(step, args.iters, sync), 4)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

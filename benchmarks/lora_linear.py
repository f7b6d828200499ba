"""What a LoRA'd Linear costs beside its frozen base at SDXL's batch-16 shapes, forward and backward, in
the ways it can be written, so a change to the trainer's projections rests on a measurement:

    python benchmarks/lora_linear.py [--batch 16] [--iters 20] [--compile]

Variants (x: tokens x K, W: N x K frozen, A: r x K, B: N x r trainable, s the scaling):
  base     F.linear(x, W) alone (the floor: a frozen layer without LoRA)
  peft     F.linear(x, W) + F.linear(F.linear(x, A), B) * s, as peft's Linear does
  addmm    sdxl_lora.speed's LoRA function: the B product accumulated into the base product by the GEMM
           (addmm), and in the backward the A product into the input's gradient, instead of separate
           tensors and adds
  merged   x @ (W + s B A)^T: one GEMM each way with the delta folded into the weight (bf16)
Prints one JSON row per shape and variant: ms for forward + backward, the largest difference of the
output and of the gradients from peft's in fp32. --tiny runs small shapes on the CPU (a smoke test).
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from sdxl_lora.speed import lora_linear

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
    return lora_linear(x, w, None, a, b, s, merged=True)


def base(x, w, a, b, s):
    return F.linear(x, w)


def addmm(x, w, a, b, s):
    return lora_linear(x, w, None, a, b, s)


VARIANTS = {"base": base, "peft": peft, "addmm": addmm, "merged": merged}


def timed(fn, iters, sync):
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters * 1000


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

"""What a LoRA'd convolution (LoCon) costs beside its frozen base at SDXL's ResNet shapes, forward and backward,
channels_last in bf16, in the ways the trainer can compute it:

    python benchmarks/lora_conv.py [--batch 16] [--rank 16] [--iters 20] [--compile] [--kernel-time]

Variants (x: N x C_in x H x W, W: C_out x C_in x k x k frozen, A: r x C_in x k x k, B: C_out x r x 1 x 1
trainable, s the scaling):
  base     F.conv2d(x, W) alone (the floor: a frozen layer without LoRA)
  peft     F.conv2d(x, W) + F.conv2d(F.conv2d(x, A), B) * s, as peft's Conv2d does
  merged   F.conv2d(x, W + s B A): one convolution each way with the delta folded into the weight (the
           trainer's train.lora_matmul = "merged" for the ResNets' convolutions, sdxl_lora.sdxl.lora_matmul)
Prints one JSON row per shape and variant: ms for forward + backward (wall time; --kernel-time: the GPU time of
its kernels, what a CUDA-graphed step pays), the largest difference of the output and of the gradients from
peft's. --tiny runs small shapes on the CPU (a smoke test).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from sdxl_lora.sdxl.lora_matmul import lora_conv2d
from timing import lora_variant_row  # benchmarks/timing.py (this script's folder is on the path)

# name: (C_in, C_out, feature map side at 1024 px, kernel): SDXL's ResNet convolutions at each level, the up
# blocks' wider inputs (the skip concatenation) and a shortcut
SHAPES = {
    "128 320->320 3x3": (320, 320, 128, 3),
    "64 640->640 3x3": (640, 640, 64, 3),
    "64 960->640 3x3": (960, 640, 64, 3),
    "32 1280->1280 3x3": (1280, 1280, 32, 3),
    "32 2560->1280 3x3": (2560, 1280, 32, 3),
    "32 2560->1280 1x1": (2560, 1280, 32, 1),
}


def base(x, w, a, b, s):
    return F.conv2d(x, w, None, 1, w.shape[-1] // 2)


def peft(x, w, a, b, s):
    p = w.shape[-1] // 2
    return F.conv2d(x, w, None, 1, p) + F.conv2d(F.conv2d(x, a, None, 1, p), b) * s


def merged(x, w, a, b, s):
    p = w.shape[-1] // 2
    return lora_conv2d(x, w, None, a, b * s, (1, 1), (p, p))


VARIANTS = {"base": base, "peft": peft, "merged": merged}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--compile", action="store_true", help="torch.compile each variant")
    p.add_argument("--tiny", action="store_true", help="small shapes on the CPU")
    p.add_argument("--kernel-time", action="store_true",
                   help="GPU time of the kernels (torch's profiler) instead of wall time per call")
    args = p.parse_args(argv)
    dev = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    shapes = {"tiny": (8, 16, 8, 3)} if args.tiny else SHAPES
    cl = torch.channels_last
    for name, (cin, cout, side, k) in shapes.items():
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(args.batch, cin, side, side, generator=g).to(dev, dtype, memory_format=cl).requires_grad_()
        w = (torch.randn(cout, cin, k, k, generator=g) / (cin * k * k) ** 0.5).to(dev, dtype, memory_format=cl)
        a = (torch.randn(args.rank, cin, k, k, generator=g) / (cin * k * k) ** 0.5).to(dev, memory_format=cl)
        b = (torch.randn(cout, args.rank, 1, 1, generator=g) * 0.01).to(dev, memory_format=cl)
        a.requires_grad_(), b.requires_grad_()
        dy = torch.randn(args.batch, cout, side, side, generator=g).to(dev, dtype, memory_format=cl)
        ref = None
        for vname, fn in VARIANTS.items():
            f = torch.compile(fn) if args.compile else fn

            def step():
                for t in (x, a, b):
                    t.grad = None
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                    y = f(x, w, a, b, 1.0)
                y.backward(dy)
                return y

            row = {"shape": name, "batch": args.batch, "r": args.rank, "variant": vname}
            row, ref = lora_variant_row(row, step, x, a, b, ref, args.kernel_time and dev.type == "cuda", args.iters,
                                        sync)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""The 4-bit (nf4) dequantization a QLoRA step runs two or three times per Linear: bitsandbytes' own against
sdxl_lora.core.quantize.dequantize_4bit (core/kernels.py: one Triton kernel on CUDA), at SDXL's Linear shapes,
with and without double quantization of the block scales. Written in session 10 of issue 9:

    python benchmarks/dequant4bit.py [--iters 50]
    python benchmarks/dequant4bit.py --tiny      # the CPU: ours eagerly against bitsandbytes' (a smoke test)

Prints one JSON row per shape: GPU time per call of each (torch's profiler: what a CUDA-graphed step pays),
the number of kernels each launches, and whether the values are identical.
"""
from __future__ import annotations

import argparse
import json

import torch

from sdxl_lora.core import quantize
from timing import gpu_ms  # benchmarks/timing.py (this script's folder is on the path)

# (out, in): the attention projections at both levels, the feed-forward's in (GEGLU: 2 x 4 x dim) and out
SHAPES = [(640, 640), (1280, 1280), (1280, 2048), (10240, 1280), (1280, 5120)]


def kernels_per_call(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--tiny", action="store_true", help="small shapes on the CPU")
    args = p.parse_args(argv)
    import bitsandbytes.functional as bnbf

    dev = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:  # the CUDA path's custom op, which runs its torch reference on the CPU
        from sdxl_lora.core import kernels

        quantize._dequantize_4bit_fn = lambda device: kernels.dequantize_4bit
    for double in (True, False):
        for shape in [(320, 72)] if args.tiny else SHAPES:
            linear = torch.nn.Sequential(torch.nn.Linear(shape[1], shape[0], bias=False))
            quantize.quantize_model(linear, "nf4", compute_dtype=torch.bfloat16, double_quant=double, device=dev)
            w = linear[0].weight

            def theirs():
                return bnbf.dequantize_4bit(w.data, w.quant_state)

            def ours():
                return quantize.dequantize_4bit(w, torch.bfloat16)

            row = {"shape": list(shape), "double_quant": double, "identical": torch.equal(ours(), theirs())}
            if dev.type == "cuda":
                row.update(bnb_us=round(gpu_ms(theirs, args.iters) * 1000, 1),
                           ours_us=round(gpu_ms(ours, args.iters) * 1000, 1),
                           bnb_kernels=kernels_per_call(theirs), ours_kernels=kernels_per_call(ours))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""PyTorch SDPA backends on the SDXL UNet's attention shapes at 1024x1024: forward + backward time per
backend (flash, cuDNN, memory-efficient; and FlexAttention, torch's Triton-generated attention, compiled),
bf16, so the trainer's attention choice rests on a measurement.

    python benchmarks/attention_backends.py [--batch 8] [--iters 20] [--layout bhsd|bshd]

Shapes (batch, heads, query tokens, key tokens, head dim 64): self-attention at the 64x64 level (640
channels, 10 heads, 4096 tokens) and at the 32x32 level (1280 channels, 20 heads, 1024 tokens), and the
cross-attention to the 77 text tokens at both. Prints one JSON row per shape and backend (ms for
forward + backward), and the per-image total over SDXL's layers (10 transformer layers at 64x64, 60 at
32x32) for each backend. --tiny runs small shapes on the CPU (a smoke test of the script).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from timing import timed  # benchmarks/timing.py (this script's folder is on the path)

# name: (heads, query tokens, key tokens, layers of it in the SDXL UNet)
SHAPES = {"self 64x64": (10, 4096, 4096, 10), "cross 64x64": (10, 4096, 77, 10),
          "self 32x32": (20, 1024, 1024, 60), "cross 32x32": (20, 1024, 77, 60)}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH, "flex": "flex"}


def _flex():
    """torch's FlexAttention, compiled (it is a template for inductor; uncompiled it runs the math path)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def time_backend(backend, b, h, q, k, d, iters, device, dtype, layout="bhsd"):
    """ms for forward + backward. layout "bhsd": contiguous (batch, heads, tokens, dim) tensors; "bshd": the
    (batch, tokens, heads, dim) tensors diffusers' attention processor makes, viewed with transpose(1, 2)."""
    g = torch.Generator(device).manual_seed(0)
    if layout == "bhsd":
        leaves = [torch.randn(b, h, n, d, device=device, dtype=dtype, generator=g).requires_grad_() for n in (q, k, k)]
        qt, kt, vt = leaves
    else:
        leaves = [torch.randn(b, n, h, d, device=device, dtype=dtype, generator=g).requires_grad_() for n in (q, k, k)]
        qt, kt, vt = (x.transpose(1, 2) for x in leaves)
    grad = torch.randn(b, h, q, d, device=device, dtype=dtype, generator=g)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    flex = _flex() if backend == "flex" else None

    def once():
        if flex is not None:
            out = flex(qt, kt, vt)
        else:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(qt, kt, vt)
        out.backward(grad)
        for x in leaves:
            x.grad = None

    return timed(once, iters, sync)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--layout", choices=["bhsd", "bshd"], default="bhsd",
                    help="bshd: the transposed views diffusers' attention processor passes (see time_backend)")
    ap.add_argument("--only", nargs="+", choices=list(BACKENDS), help="these backends (default: all but math)")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    shapes = {k: (h, q // 16, min(kv, 77) if kv == 77 else kv // 16, n) for k, (h, q, kv, n) in SHAPES.items()} \
        if args.tiny else SHAPES
    backends = {k: BACKENDS[k] for k in (args.only or ([] if args.tiny else [k for k in BACKENDS if k != "math"]))} \
        or {"math": BACKENDS["math"]}
    if device == "cuda":
        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} batch {args.batch}", flush=True)
    totals: dict[str, float] = {}
    for name, (h, q, kv, layers) in shapes.items():
        for bname, backend in backends.items():
            try:
                ms = time_backend(backend, args.batch, h, q, kv, 64, args.iters, device, dtype, args.layout)
            except RuntimeError as e:  # a backend that does not take this shape/device: say so, time the rest
                print(json.dumps({"shape": name, "backend": bname, "error": str(e).splitlines()[0][:200]}), flush=True)
                totals[bname] = float("nan")
                continue
            totals[bname] = totals.get(bname, 0.0) + ms * layers
            print(json.dumps({"shape": name, "backend": bname, "ms_fwd_bwd": round(ms, 3), "layers": layers}), flush=True)
    print(json.dumps({"sdxl_attention_ms_per_step": {k: round(v, 1) for k, v in totals.items()},
                      "batch": args.batch, "layout": args.layout}), flush=True)


if __name__ == "__main__":
    main()

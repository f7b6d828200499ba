"""fp8 against bf16 for the SDXL UNet's Linear layers at 1024x1024: the frozen base's x @ W^T (forward) and
grad @ W (backward, the input's gradient; the frozen weight has none), so train.fp8_matmul rests on a
measurement of these shapes and not on the hardware's datasheet.

    python benchmarks/fp8_matmul.py [--batch 16] [--iters 20]

For each shape (tokens M = batch x tokens per image, in features K, out features N; the layers of it in
SDXL) it times: bf16 F.linear; fp8 "rowwise" (one scale per token row of the activation and one per output
channel of the weight, torch._scaled_mm into bf16) and fp8 "tensorwise" (one scale each), both with the
activation's quantization (amax, scale, cast: compiled, as it is inside the trainer's compiled blocks)
counted in. Prints one JSON row per shape and pass with ms and TFLOP/s, the quantized product's error
relative to the bf16 one, and the per-image total over SDXL's linear layers. --tiny runs small shapes on
the CPU (a smoke test of the script).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from timing import timed  # benchmarks/timing.py (this script's folder is on the path)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# name: (tokens per image, K, N, layers of it in the SDXL UNet), the Linear layers of its transformer blocks
# (10 blocks at 64x64 with 640 channels, 60 at 32x32 with 1280; proj_in/proj_out per Transformer2DModel:
# 4 at 64x64, 12 at 32x32). Cross-attention's to_k/to_v see the 77 text tokens.
SHAPES = {
    "64 attn q/k/v/out": (4096, 640, 640, 10 * 4),
    "64 ff in (geglu)": (4096, 640, 5120, 10),
    "64 ff out": (4096, 2560, 640, 10),
    "64 proj in/out": (4096, 640, 640, 4 * 2),
    "64 cross k/v": (77, 2048, 640, 10 * 2),
    "32 attn q/k/v/out": (1024, 1280, 1280, 60 * 4),
    "32 ff in (geglu)": (1024, 1280, 10240, 60),
    "32 ff out": (1024, 5120, 1280, 60),
    "32 proj in/out": (1024, 1280, 1280, 12 * 2),
    "32 cross k/v": (77, 2048, 1280, 60 * 2),
}


def quant_rows(x):
    """One scale per row: fp8 values and the [M, 1] fp32 scales."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quant_tensor(x):
    scale = (x.abs().amax().float() / FP8_MAX).clamp(min=1e-12)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU (a smoke test)")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} batch {args.batch}", flush=True)
    qrows = quant_rows if args.tiny else torch.compile(quant_rows)
    qtens = quant_tensor if args.tiny else torch.compile(quant_tensor)
    totals: dict[str, float] = {}
    g = torch.Generator(device).manual_seed(0)
    for name, (tokens, k, n, layers) in SHAPES.items():
        m = tokens * args.batch
        if args.tiny:
            m, k, n = min(m, 64), min(k, 64), min(n, 64)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) * 0.02
        gy = torch.randn(m, n, device=device, dtype=torch.bfloat16, generator=g)
        # The weight is frozen: quantized once, per output channel for forward and per input channel
        # (stored transposed, so _scaled_mm sees it column-major) for backward.
        wq, ws = quant_rows(w)                   # [N, K], [N, 1]
        wtq, wts = quant_rows(w.t().contiguous())  # [K, N], [K, 1]
        wq_t, wqs_t = quant_tensor(w)
        wtq_t, wtqs_t = quant_tensor(w.t().contiguous())

        def fp8(quant, a, b, b_scale):
            q, s = quant(a)
            return torch._scaled_mm(q, b, scale_a=s, scale_b=b_scale, out_dtype=torch.bfloat16)

        passes = {
            "forward": (lambda: F.linear(x, w),
                        lambda: fp8(qrows, x, wq.t(), ws.view(1, -1)),
                        lambda: fp8(qtens, x, wq_t.t(), wqs_t)),
            "backward": (lambda: gy @ w,
                         lambda: fp8(qrows, gy, wtq.t(), wts.view(1, -1)),
                         lambda: fp8(qtens, gy, wtq_t.t(), wtqs_t)),
        }
        flops = 2 * m * k * n
        for pname, (bf16, rowwise, tensorwise) in passes.items():
            ref = bf16().float()
            row = {"shape": name, "pass": pname, "M": m, "K": k, "N": n}
            for label, fn in (("bf16", bf16), ("rowwise", rowwise), ("tensorwise", tensorwise)):
                ms = timed(fn, args.iters, sync)
                row[f"{label}_ms"] = round(ms, 4)
                row[f"{label}_tflops"] = round(flops / ms / 1e9, 1)
                if label != "bf16":
                    row[f"{label}_rel_err"] = round(((fn().float() - ref).norm() / ref.norm()).item(), 4)
                totals[label] = totals.get(label, 0.0) + ms * layers / args.batch
            row["rowwise_speedup"] = round(row["bf16_ms"] / row["rowwise_ms"], 2)
            row["tensorwise_speedup"] = round(row["bf16_ms"] / row["tensorwise_ms"], 2)
            print(json.dumps(row), flush=True)
    print(json.dumps({"per_image_ms_over_sdxl_linears": {k: round(v, 2) for k, v in totals.items()},
                      "rowwise_speedup": round(totals["bf16"] / totals["rowwise"], 2),
                      "tensorwise_speedup": round(totals["bf16"] / totals["tensorwise"], 2)}), flush=True)


if __name__ == "__main__":
    main()

"""Where the first training passes of a launch go: the full-size SDXL UNet (SDXL base's real config, random
weights) with the trainer's adapter and default step levers, forward + backward at each of three bucket shapes
(1024x1024, 1152x896, 896x1152), timed pass by pass, as the warm-up before the CUDA graphs' captures runs them.
Then the steady eager step at the first shape.

    python benchmarks/first_pass.py [--batch 4] [--passes 2] [--no-cudnn-benchmark | --benchmark-limit N]
                                    [--profile-first]

A launch pays the first pass's one-time costs (CUDA's lazy kernel loading, cuBLAS' and cuDNN's set-up, cuDNN's
algorithm search when torch.backends.cudnn.benchmark is on, as the trainer sets it) before it can capture;
`--no-cudnn-benchmark` leaves cuDNN on its heuristics, to see what the search costs at launch and what it
gains per step; `--benchmark-limit N` keeps the search but tries at most N of cuDNN's candidates a convolution
(torch.backends.cudnn.benchmark_limit). `--profile-first` records the first pass under torch's profiler and
prints its longest host-side operators. Prints one JSON row. --tiny: the embedded tiny UNet on the CPU (a smoke
test of the script).
Figures: benchmarks/RESULTS.md#launch-to-first-step.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sdxl_step import build_unet, inputs, our_task, prepare, setting_config  # noqa: E402

# (height, width) of the three buckets, in pixels.
BUCKETS = ((1024, 1024), (1152, 896), (896, 1152))


def shaped(data: dict, height: int, width: int) -> dict:
    """The batch `data` at another latent size (a bucket), the same values where the sizes overlap."""
    out = dict(data)
    for key in ("latent_mean", "latent_std"):
        out[key] = torch.nn.functional.interpolate(data[key], size=(height // 8, width // 8), mode="nearest")
    ids = data["time_ids"]
    out["time_ids"] = torch.tensor([[height, width, 0, 0, height, width]] * ids.shape[0], device=ids.device,
                                   dtype=ids.dtype)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--passes", type=int, default=2, help="timed passes per bucket")
    ap.add_argument("--steps", type=int, default=5, help="steady eager passes at the first bucket, after them")
    ap.add_argument("--no-cudnn-benchmark", action="store_true", help="cuDNN's heuristics, no algorithm search")
    ap.add_argument("--benchmark-limit", type=int, help="torch.backends.cudnn.benchmark_limit (candidates tried)")
    ap.add_argument("--profile-first", action="store_true", help="the first pass under torch's profiler")
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny UNet on the CPU")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    started = time.perf_counter()
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    unet = build_unet(device, args.tiny)
    cfg = setting_config({}, [], 16, cpu=not cuda)
    prepare(unet, "ours", cfg, device)
    unet.train()
    data = inputs(unet, args.batch, device)
    task, run = our_task(cfg, device, data)
    task.unet_call.setup(unet, run)  # the trainer's levers; sets cudnn.benchmark as a run does
    if args.no_cudnn_benchmark:
        torch.backends.cudnn.benchmark = False
    if args.benchmark_limit is not None:
        torch.backends.cudnn.benchmark_limit = args.benchmark_limit
    params = tuple(p for p in unet.parameters() if p.requires_grad)
    sync()
    row = {"device": torch.cuda.get_device_name() if cuda else "cpu", "batch": args.batch,
           "cudnn_benchmark": torch.backends.cudnn.benchmark, "benchmark_limit": torch.backends.cudnn.benchmark_limit,
           "set_up_s": round(time.perf_counter() - started, 1)}

    def one_pass(batch: dict) -> float:
        sync()
        t0 = time.perf_counter()
        with task.accelerator.autocast():
            loss = task.loss(unet, batch)
        torch.autograd.grad(loss, params, allow_unused=True)
        sync()
        return time.perf_counter() - t0

    buckets = BUCKETS if not args.tiny else ((64, 64), (72, 56), (56, 72))
    batches = [shaped(data, h, w) for h, w in buckets]
    if args.profile_first:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            first = one_pass(batches[0])
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
        row["first_pass_top_host_ops_ms"] = {e.key[:60]: round(e.self_cpu_time_total / 1000, 1) for e in events}
        passes = {f"{buckets[0][1]}x{buckets[0][0]}": [round(first, 2)] + [
            round(one_pass(batches[0]), 2) for _ in range(args.passes - 1)]}
        rest = zip(buckets[1:], batches[1:])
    else:
        passes, rest = {}, zip(buckets, batches)
    for (h, w), batch in rest:
        passes[f"{w}x{h}"] = [round(one_pass(batch), 2) for _ in range(args.passes)]
    row["passes_s"] = passes
    row["steady_ms"] = round(1000 * sum(one_pass(batches[0]) for _ in range(args.steps)) / args.steps, 1)
    if cuda:
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        row["reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    row["total_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

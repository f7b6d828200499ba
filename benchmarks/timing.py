"""The benchmarks' shared timers: after a few warm-up calls, the mean wall time of `iters` calls (synchronised)
or the GPU time of their kernels (torch's profiler)."""
from __future__ import annotations

import time


def timed(fn, iters, sync):
    """Milliseconds per call of fn() over `iters` calls, after 3 warm-up calls; sync() waits for the device."""
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters * 1000


def gpu_ms(fn, iters):
    """GPU time per call of fn() (every kernel it launches, summed; host time left out), from torch's
    profiler over `iters` calls after 3 warm-up calls: what a call costs inside a CUDA-graphed step, where
    a small kernel's launch is not paid per call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1000 / iters


def lora_variant_row(row: dict, step, x, a, b, ref: list | None, kernel_time: bool, iters: int, sync) -> tuple[dict, list]:
    """One LoRA benchmark row (benchmarks/lora_linear.py, lora_conv.py): runs `step()` (forward + backward of the
    variant `row["variant"]` over input x and factors a, b), compares its output and gradients with `ref` (peft's,
    which becomes the reference when this row is peft's), and times it. Returns the row and the reference."""
    y = step()
    base = row["variant"] == "base"
    got = [y.float(), x.grad.float()] + ([] if base else [a.grad, b.grad])
    if row["variant"] == "peft":
        ref = got
    elif ref is not None and not base:
        row["max_diff"] = [round((u - v).abs().max().item(), 5) for u, v in zip(got, ref)]
        row["ref_max"] = [round(v.abs().max().item(), 3) for v in ref]
    row["gpu_ms_fwd_bwd" if kernel_time else "ms_fwd_bwd"] = round(
        gpu_ms(step, iters) if kernel_time else timed(step, iters, sync), 4)
    return row, ref

"""The step profiler (`--profile N`, train.profile_steps): torch.profiler over a few training steps, a
Chrome/Perfetto trace in the run folder and a table of where the step time goes."""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

class StepProfiler:
    """torch.profiler over `steps` training steps after `skip` warm-up steps; named phases per step
    (data, forward, backward, optimizer). Writes <run>/profile/trace.json (Perfetto, chrome://tracing) and
    logs where the step time went."""

    PHASES = ("data", "forward", "backward", "optimizer")

    def __init__(self, out_dir: Path | None, steps: int, skip: int = 2, device: torch.device | None = None):
        self.out_dir, self.steps, self.skip, self.device = out_dir, steps, skip, device
        self.prof = None
        self.done = steps <= 0 or out_dir is None
        self.summary: str | None = None

    def phase(self, name: str):
        if self.prof is None:
            return contextlib.nullcontext()
        return torch.profiler.record_function(f"phase:{name}")

    def before_step(self, step: int) -> None:
        """Called with the number of the step about to run (0-based count of steps done)."""
        if self.done or self.prof is not None or step < self.skip:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device is not None and self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
        self.prof.__enter__()
        self.start = step

    def after_step(self, step: int, last: bool = False) -> Path | None:
        """Called with the number of steps done; ends the recording after `steps` of them (or at the last)."""
        if self.prof is None or (step - self.start < self.steps and not last):
            return None
        self.steps = step - self.start
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / "trace.json"
        self.prof.export_chrome_trace(str(trace))
        self.summary = self._summary()
        log.info("profile of %d steps written to %s\n%s", self.steps, trace, self.summary)
        self.prof, self.done = None, True
        return trace

    def _summary(self) -> str:
        events = self.prof.key_averages()
        use_cuda = self.device is not None and self.device.type == "cuda"

        def total_us(e) -> float:
            # Self time: an operator's children are listed on their own.
            return (getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)) if use_cuda \
                else e.self_cpu_time_total

        phases = {e.key.split(":", 1)[1]: e.cpu_time_total for e in events if e.key.startswith("phase:")}
        lines = ["where the step time goes (host time per phase, per step):"]
        for p in self.PHASES:
            if p in phases:
                lines.append(f"  {p:<10} {phases[p] / 1000 / self.steps:9.2f} ms")
        if use_cuda and (kinds := kernel_kinds(events, self.steps)):
            lines.append(f"GPU time by kind of kernel (per step, {sum(kinds.values()):.2f} ms busy):")
            lines.extend(f"  {ms:9.2f} ms  {kind}" for kind, ms in kinds.items())
        ops = sorted((e for e in events if not e.key.startswith(("phase:", "ProfilerStep"))),
                     key=total_us, reverse=True)[:10]
        lines.append(f"top operators by {'GPU' if use_cuda else 'CPU'} time (per step):")
        for e in ops:
            lines.append(f"  {total_us(e) / 1000 / self.steps:9.2f} ms  {e.count // self.steps:5d}x  {e.key[:70]}")
        return "\n".join(lines)


# Kernel names (cuBLAS, cuDNN, flash/cuDNN attention, inductor's Triton) to what they do; first match wins:
# cuDNN's attention helpers (dO.O, the dQ conversion) before the convolutions' "conv"/"cudnn", inductor's
# kernels (whose names can hold "convolution") before both, cuDNN's implicit-GEMM convolutions before the GEMM
# patterns.
KERNEL_KINDS = (("attention", ("flash", "fmha", "attention", "sdpa", "dot_do_o", "convert_dq")),
                ("fused (compiled)", ("triton", "geglu")),  # inductor's kernels and ours (sdxl/kernels.py)
                ("convolution", ("conv", "fprop", "dgrad", "wgrad", "cudnn")),
                ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "gemv")),
                ("optimizer", ("multi_tensor", "adam")),
                ("communication", ("nccl",)))


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, patterns in KERNEL_KINDS:
        if any(p in low for p in patterns):
            return kind
    return "other (element-wise, copies, norms)"


def kernel_kinds(events, steps: int) -> dict[str, float]:
    """GPU milliseconds per step by kind of kernel, largest first, from a profiler's key_averages(). Ranges
    named on the GPU's timeline (record_function, the optimizer's step) span kernels counted already: left out."""
    kinds: dict[str, float] = {}
    for e in events:
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        kind = kernel_kind(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + us / 1000 / max(steps, 1)
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))

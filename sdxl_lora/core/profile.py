"""The step profiler (`--profile N`, train.profile_steps): torch.profiler over a few training steps, a
Chrome/Perfetto trace in the run folder and a table of where the step time goes."""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from .accel import indexed
from .memory import GiB

log = logging.getLogger(__name__)

class StepProfiler:
    """torch.profiler over `steps` training steps after `skip` warm-up steps; named phases per step
    (data, forward, backward, optimizer). Writes <run>/profile/trace.json (Perfetto, chrome://tracing) and
    logs where the step time went."""

    PHASES = ("data", "forward", "backward", "optimizer")

    def __init__(self, out_dir: Path | None, steps: int, skip: int = 2, device: torch.device | None = None,
                 allocations: bool = True):
        self.out_dir, self.steps, self.skip, self.device = out_dir, steps, skip, device
        # torch's allocation history made a compiled, checkpointed decoder layer's forward fail (SystemError from
        # autograd.Function.apply; pytorch/pytorch#179536, a torch 2.11 regression): a run that compiles is
        # profiled without it.
        self.allocations = allocations and device is not None and device.type == "cuda"
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
        if self.allocations:
            # Every allocation of the profiled steps with its Python stack: where their memory peak is held.
            self.held_before = torch.cuda.memory_allocated(self.device)
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES, stacks="python")
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
        if self.allocations:
            self.summary += "\n" + self._memory(self.out_dir / "memory.pickle")
        elif self.device is not None and self.device.type == "cuda":
            self.summary += ("\nGPU memory: no allocation history (memory.pickle) for a run that compiles; profile "
                             "with train.compile='none' to see where the peak is held")
        log.info("profile of %d steps written to %s\n%s", self.steps, trace, self.summary)
        self.prof, self.done = None, True
        return trace

    def _memory(self, path: Path) -> str:
        """The allocation history written to `path` (open it at pytorch.org/memory_viz) and, as text, what was
        live at the profiled steps' peak by where it was allocated."""
        import pickle

        from .fsutil import atomic_write_bytes

        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        atomic_write_bytes(path, pickle.dumps(snapshot))
        index = indexed(self.device).index
        traces = snapshot.get("device_traces") or []
        peak, sites = peak_sites(traces[index] if index < len(traces) else [])
        lines = [f"GPU memory: {self.held_before / GiB:.2f} GiB held before the profiled steps (weights, state, "
                 f"caches), {peak / GiB:.2f} GiB more at their peak, allocated at ({path.name}, pytorch.org/memory_viz):"]
        lines.extend(f"  {size / GiB:9.3f} GiB  {site}" for site, size in sites[:MEMORY_SITES])
        return "\n".join(lines)

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


# torch's allocation history keeps this many events (a few profiled SDXL steps make tens of thousands).
MEMORY_HISTORY_ENTRIES = 500_000
MEMORY_SITES = 12


def peak_sites(trace: list[dict]) -> tuple[int, list[tuple[str, int]]]:
    """From one device's allocation history (torch.cuda.memory._snapshot()'s device trace: alloc and
    free_completed events with addr, size and frames): the most bytes live at once among the blocks it saw
    allocated, and those bytes at that moment by allocation site (largest first). A site is the innermost
    frame outside torch's own files: the model or trainer code that asked for the memory."""
    live: dict[int, int] = {}
    total = best = best_at = 0
    for i, e in enumerate(trace):
        if e.get("action") == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > best:
                best, best_at = total, i
        elif e.get("action") == "free_completed" and e.get("addr") in live:
            total -= live.pop(e["addr"])
    held: dict[int, dict] = {}
    for e in trace[:best_at + 1]:
        if e.get("action") == "alloc":
            held[e["addr"]] = e
        elif e.get("action") == "free_completed":
            held.pop(e.get("addr"), None)
    sites: dict[str, int] = {}
    for e in held.values():
        site = _site(e.get("frames") or [])
        sites[site] = sites.get(site, 0) + e["size"]
    return best, sorted(sites.items(), key=lambda kv: -kv[1])


def _site(frames: list[dict]) -> str:
    for f in frames:  # innermost first
        name = f.get("filename", "")
        if name and "/torch/" not in name and not name.startswith("??") and "<" not in name:
            return f"{_short(name)}:{f.get('line')} {f.get('name')}"
    return "(torch's own code, or no Python stack)"


def _short(path: str) -> str:
    """The path from the package folder on (site-packages/diffusers/... -> diffusers/...)."""
    parts = Path(path).parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1:])
    if "sdxl_lora" in parts:
        return "/".join(parts[parts.index("sdxl_lora"):])
    return Path(path).name


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

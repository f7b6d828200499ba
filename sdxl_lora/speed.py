"""Speed levers for the training step, each behind a config switch (docs/speed.md has the measurements).

  channels_last     NHWC memory format for the convolutional model: cuDNN's fast conv kernels.
  compile=regional  torch.compile on each repeated block (transformer and ResNet blocks), not the whole
                    model: the same kernels fused, a fraction of the compile time, and one compiled
                    graph reused by every block of the same shape. Inductor's on-disk cache makes the
                    second launch faster still.
  cuda_graphs       the model's forward and backward captured as CUDA graphs, one pair per input shape
                    (bucket): at small batch the step is host-bound (kernel launches, Python), and a
                    graph replay launches the whole pass at once.
  checkpoint_budget selective activation checkpointing: the blocks whose saved activations are largest
                    for the compute they cost to redo are checkpointed, just enough to fit a budget,
                    instead of diffusers' all-or-nothing switch (2.1x the step time).
  profile_steps     torch's profiler over N steps, a Chrome/Perfetto trace in the run folder and a table
                    of where the step time goes in the log.

Why not diffusers/peft/accelerate for these: diffusers has only whole-model checkpointing, accelerate's
compile (`dynamo_backend`) compiles the whole model (minutes before the first step for the SDXL UNet), and
`torch.cuda.make_graphed_callables` takes positional tensors only, so the UNet's keyword call is wrapped here.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)

# Blocks repeated through the SDXL UNet (and causal LMs' decoder layers): compiled one by one.
# train.compile="regional" compiles all of them; "transformer" only the attention blocks and decoder layers
# (the ResNets come in many widths, each its own compilation, for a smaller share of the step).
TRANSFORMER_CLASSES = ("BasicTransformerBlock", "LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer",
                       "GemmaDecoderLayer")
REGION_CLASSES = TRANSFORMER_CLASSES + ("ResnetBlock2D",)
# The compile backend; tests use "aot_eager" (same graph capture and autograd split, no C++ build).
COMPILE_BACKEND = "inductor"


def configure_backends(device: torch.device) -> None:
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True


def to_channels_last(model: torch.nn.Module) -> None:
    model.to(memory_format=torch.channels_last)


def compile_regions(model: torch.nn.Module, backend: str | None = None,
                    classes: tuple[str, ...] = REGION_CLASSES) -> int:
    """Compile every repeated block in place; returns how many. ResNet blocks come in several widths, so
    the recompile limit is raised to hold one graph per shape."""
    import torch._dynamo

    dyn = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dyn, name):
            setattr(dyn, name, max(getattr(dyn, name), 64))
    if hasattr(dyn, "accumulated_recompile_limit"):
        dyn.accumulated_recompile_limit = max(dyn.accumulated_recompile_limit, 1024)
    n = 0
    for module in model.modules():
        if type(module).__name__ in classes:
            module.compile(backend=backend or COMPILE_BACKEND, dynamic=False)
            n += 1
    if n == 0:
        log.warning("train.compile: no repeated blocks (%s) found in %s; nothing compiled",
                    ", ".join(classes), type(model).__name__)
    return n


class GraphedCall:
    """`fn(*tensors)` replayed from CUDA graphs (forward and backward), one pair per set of input shapes.

    The first call with a new shape captures (after warm-up iterations on a side stream); later calls copy
    the inputs into the captured buffers and replay. `fn` must not synchronise with the host and must read
    its parameters, not rebind them. Autocast inside `fn` must run with cache_enabled=False."""

    def __init__(self, module: torch.nn.Module, fn: Callable[..., torch.Tensor], warmup: int = 3):
        self.module, self.fn, self.warmup = module, fn, warmup
        self.graphs: dict[tuple, Callable] = {}

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        key = tuple((tuple(a.shape), a.dtype) for a in args)
        graphed = self.graphs.get(key)
        if graphed is None:
            log.info("capturing CUDA graphs for input shapes %s", [k[0] for k in key])
            wrapper = _Positional(self.module, self.fn)
            graphed = torch.cuda.make_graphed_callables(wrapper, tuple(a.detach().clone() for a in args),
                                                        num_warmup_iters=self.warmup, allow_unused_input=True)
            self.graphs[key] = graphed
        return graphed(*args)


class _Positional(torch.nn.Module):
    # make_graphed_callables wants a module (so it finds the trainable parameters) called with tensors.
    def __init__(self, module: torch.nn.Module, fn: Callable[..., torch.Tensor]):
        super().__init__()
        self.inner = module
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)


# ---- selective activation checkpointing ----

def checkpointable_blocks(unet: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The UNet's blocks that diffusers can checkpoint one by one (each has `gradient_checkpointing`)."""
    out = []
    for prefix in ("down_blocks", "up_blocks"):
        for i, block in enumerate(getattr(unet, prefix, [])):
            if hasattr(block, "gradient_checkpointing"):
                out.append((f"{prefix}.{i}", block))
    mid = getattr(unet, "mid_block", None)
    if mid is not None and hasattr(mid, "gradient_checkpointing"):
        out.append(("mid_block", mid))
    return out


def measure_block_activations(unet: torch.nn.Module, call: Callable[[], torch.Tensor]) -> dict[str, int]:
    """Bytes each block saves for backward in one forward of `call()` (saved-tensor hooks; the frozen
    weights, which are not copies, are not counted twice: only tensors created during the block count)."""
    blocks = checkpointable_blocks(unet)
    current: list[str] = []
    saved: dict[str, int] = {name: 0 for name, _ in blocks}
    seen: set[int] = set()
    params = {p.data_ptr() for p in unet.parameters()}

    def pack(t: torch.Tensor):
        if current and t.data_ptr() not in params and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            saved[current[-1]] += t.numel() * t.element_size()
        return t

    def enter(name):
        def hook(module, args):
            current.append(name)
        return hook

    def leave(module, args, output):
        current.pop()

    handles = []
    for name, block in blocks:
        handles.append(block.register_forward_pre_hook(enter(name)))
        handles.append(block.register_forward_hook(leave))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = call()
        del out
    finally:
        for h in handles:
            h.remove()
    return saved


def choose_checkpointed(saved: dict[str, int], budget_bytes: int, other_bytes: int) -> list[str]:
    """Blocks to checkpoint so that other_bytes + the activations left fit the budget: the largest first
    (each checkpointed block keeps only its input, so the saving is nearly its whole activation). The
    fewest blocks, hence the least recomputation; blocks that save nothing (no adapter in or before them)
    are never checkpointed. Deterministic: ties by name."""
    chosen: list[str] = []
    total = other_bytes + sum(saved.values())
    for name, size in sorted(saved.items(), key=lambda kv: (-kv[1], kv[0])):
        if total <= budget_bytes or size == 0:
            break
        chosen.append(name)
        total -= size
    return chosen


def enable_checkpointing(model: torch.nn.Module, graph_safe: bool = False) -> None:
    """diffusers' gradient checkpointing. graph_safe: without saving and restoring the RNG state around
    each block (a host sync, which a CUDA graph capture cannot hold); only right when nothing random runs
    inside the blocks (no LoRA dropout)."""
    if not graph_safe:
        model.enable_gradient_checkpointing()
        return
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    model.enable_gradient_checkpointing(partial(checkpoint, use_reentrant=False, preserve_rng_state=False))


def apply_selective_checkpointing(unet: torch.nn.Module, names: list[str], graph_safe: bool = False) -> None:
    """diffusers' checkpointing on the named blocks only."""
    enable_checkpointing(unet, graph_safe)
    wanted = set(names)
    for name, block in checkpointable_blocks(unet):
        on = name in wanted
        for m in block.modules():
            if hasattr(m, "gradient_checkpointing"):
                m.gradient_checkpointing = on


# ---- profiling ----

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
        ops = sorted((e for e in events if not e.key.startswith(("phase:", "ProfilerStep"))),
                     key=total_us, reverse=True)[:10]
        lines.append(f"top operators by {'GPU' if use_cuda else 'CPU'} time (per step):")
        for e in ops:
            lines.append(f"  {total_us(e) / 1000 / self.steps:9.2f} ms  {e.count // self.steps:5d}x  {e.key[:70]}")
        return "\n".join(lines)

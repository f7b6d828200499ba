"""Speed levers of the training step that know no model: torch's backend switches, the attention kernel
choice, regional compilation of repeated blocks, CUDA-graph replay of a whole pass, and the choice of
which units to checkpoint for a memory budget. A task says which blocks repeat and which units can be
checkpointed (sdxl/speed.py for the UNet); docs/speed.md says when to use each switch.

Why not accelerate or torch's own helpers for these: accelerate's compile (`dynamo_backend`) compiles the
whole model (minutes before the first step for a large one), and `torch.cuda.make_graphed_callables` takes
positional tensors only, so a keyword call is wrapped here.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .fsutil import error_chain

log = logging.getLogger(__name__)

# The compile backend; tests use "aot_eager" (same graph capture and autograd split, no C++ build).
COMPILE_BACKEND = "inductor"


def configure_backends(device: torch.device) -> None:
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True


@contextlib.contextmanager
def cudnn_search(on: bool):
    """cuDNN's algorithm search (torch.backends.cudnn.benchmark) set to `on` inside, restored after. Training
    searches once per convolution shape and repays it over thousands of steps; evaluation and previews run a
    few calls at shapes of their own, where the search would cost more than its choice saves."""
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = on
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


# train.sdpa_backend: the kernels torch's scaled_dot_product_attention may use in the training forward.
# "default" leaves torch's own choice; a named backend restricts it to that one.
def sdpa_context(choice: str):
    """A context in which scaled_dot_product_attention uses only the named backend ("default": torch's own
    choice; torch raises if the named one cannot take a call). Entered around the training forward, so
    compilation and CUDA-graph capture see it too, and around checkpointed blocks' recomputation."""
    if choice == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel([kinds[choice]])


def to_channels_last(model: torch.nn.Module) -> None:
    model.to(memory_format=torch.channels_last)


def compile_options(backend: str | None = None, options: dict | None = None, dynamic: bool | None = False) -> dict:
    """torch.compile's arguments for a region: static shapes (unless `dynamic` says otherwise), and inductor
    `options` (the only backend that takes options)."""
    backend = backend or COMPILE_BACKEND
    return {"backend": backend, "dynamic": dynamic,
            **({"options": options} if options and backend == "inductor" else {})}


def compile_varying(fn: Callable, varying: Callable[[tuple, dict], list], **kwargs) -> Callable:
    """`fn` compiled, with the dims `varying(args, kwargs)` names ([(tensor, dims)]) marked as varying before each
    call. The mark has to come from outside the compiled code, so the call is a small eager wrapper; dims the
    compiler finds it must fix stay fixed (maybe_mark_dynamic), costing a compilation per shape as without it."""
    compiled = torch.compile(fn, **kwargs)

    def call(*args, **kw):
        for x, dims in varying(args, kw):
            mark_varying(x, dims)
        return compiled(*args, **kw)

    return call


_compile_counts: tuple[int, dict] | None = None  # dynamo's graphs and graph breaks when the regions were made


def _dynamo_counts() -> tuple[int, dict]:
    from torch._dynamo.utils import counters

    return counters["stats"].get("unique_graphs", 0), dict(counters["graph_break"])


def warn_if_nothing_compiled(run=None) -> bool:
    """After the compiled regions have run (train.compile): where torch.compile captured no graph since
    compile_regions() made them, every region fell back to running uncompiled, which torch does without an
    error (dynamo gives up on a frame it cannot trace). Says so, with dynamo's reasons, and returns True.
    (dynamo's counters are per process: a process's earlier runs are left out by the count at the start.)"""
    if _compile_counts is None:
        return False
    graphs, breaks = _dynamo_counts()
    graphs0, breaks0 = _compile_counts
    if graphs > graphs0:
        return False
    reasons = sorted({k.strip().splitlines()[0] for k, n in breaks.items() if n > breaks0.get(k, 0)})
    why = "; ".join(reasons) if reasons else "dynamo recorded no reason"
    log.warning("train.compile: the compiler gave up on every compiled block (%s); they run uncompiled, at the "
                "uncompiled speed. Set train.compile='none' to silence this, and report it with your torch and "
                "transformers/diffusers versions", why)
    if run is not None:
        run.event("compile_failed", reasons=reasons)
    return True


def _compile_varying(module: torch.nn.Module, arg: str, position: int, dims: tuple[int, ...], **kwargs) -> None:
    """module.forward compiled with `dims` of its input `arg` (or positional argument `position`) varying."""
    def varying(args, kw):
        return [(kw.get(arg) if arg in kw else (args[position] if position < len(args) else None), dims)]

    module.forward = compile_varying(module.forward, varying, **kwargs)


def mark_varying(x, dims: tuple[int, ...]) -> None:
    """Mark `dims` of tensor `x` as varying for the compiled code it goes into next. Only from eager code: inside
    another compiled region the outer one's marks hold (and dynamo refuses the call)."""
    import torch._dynamo

    if isinstance(x, torch.Tensor) and not torch.compiler.is_dynamo_compiling():
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(x, d)


def _raise_recompile_limits() -> None:
    # One compiled function serves many blocks of several shapes (and with and without grad, for previews):
    # torch's default of 8 graphs per function would send the rest back to eager, silently.
    import torch._dynamo

    dyn = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dyn, name):
            setattr(dyn, name, max(getattr(dyn, name), 64))
    if hasattr(dyn, "accumulated_recompile_limit"):
        dyn.accumulated_recompile_limit = max(dyn.accumulated_recompile_limit, 1024)


def compile_regions(model: torch.nn.Module, *, classes: tuple[str, ...], backend: str | None = None,
                    activation_budget: float | None = None, options: dict | None = None,
                    varying: dict[str, tuple[str, int, tuple[int, ...]]] | None = None) -> int:
    """Compile every block of the named classes in place (a task says which of its blocks repeat: the
    UNet's transformer and ResNet blocks, an LM's decoder layers); returns how many. Blocks may come in
    several widths, so the recompile limit is raised to hold one graph per shape. activation_budget: the fraction of each
    compiled block's activations kept for backward (torch's partitioner chooses what to recompute by its
    cost; process-wide, read when the blocks compile at their first call); None: torch's default (1.0).
    options: inductor's (sdxl/speed.py's unet_inductor_options() for the UNet).
    varying: class name -> (argument name, its position, dims) of the input whose dims differ from call to
    call (the UNet's token and spatial dims across aspect buckets): those dims are compiled as symbols, so
    one compilation serves every shape instead of one compilation per shape."""
    import torch._functorch.config

    global _compile_counts

    torch._functorch.config.activation_memory_budget = 1.0 if activation_budget is None else activation_budget
    _raise_recompile_limits()
    _compile_counts = _dynamo_counts()
    n = 0
    for module in model.modules():
        name = type(module).__name__
        if name in classes:
            if varying and name in varying:
                _compile_varying(module, *varying[name], **compile_options(backend, options, dynamic=None))
            else:
                module.compile(**compile_options(backend, options))
            n += 1
    if n == 0:
        log.warning("train.compile: no repeated blocks (%s) found in %s; nothing compiled",
                    ", ".join(classes), type(model).__name__)
    return n


class GraphedCall:
    """`fn(*tensors)` replayed from CUDA graphs (forward and backward), one pair per set of input shapes.

    The first call with a new shape captures (after warm-up iterations on a side stream); later calls copy
    the inputs into the captured buffers and replay. `fn` must not synchronise with the host and must read
    its parameters, not rebind them. Autocast inside `fn` must run with cache_enabled=False.

    Every shape's graphs share one memory pool, so the captured shapes reuse each other's memory. That is
    safe because one pair replays at a time and its outputs are consumed (the loss, the gradients) before
    another pair replays; a caller must not keep a returned tensor across a call with another shape.

    `others(args)`, when given, returns inputs of every other shape the call will see (a task's buckets and
    batch sizes), made like `args`: the first call then warms every shape up before it captures any, and
    captures them one after another without further warm-up. Warm-up passes run in ordinary memory, which
    the pool's memory cannot serve; a shape warmed up after another was captured would need its activations
    twice (in the pool and beside it). A shape that `others` did not name is still captured when it comes,
    with its own warm-up."""

    def __init__(self, module: torch.nn.Module, fn: Callable[..., torch.Tensor], warmup: int = 3,
                 others: Callable[[tuple], list[tuple]] | None = None,
                 on_out_of_memory: Callable[[], bool | str] | None = None):
        self.module, self.fn, self.warmup, self.others = module, fn, warmup, others
        # Called when a capture runs out of memory: True once it made the step need less (the task
        # checkpoints more of the model), and the capture is tried again; "later" once the caller will pass
        # smaller inputs from the next call on (the task splits its batches): this call runs without graphs
        # and the next captures; False: train on without graphs.
        self.on_out_of_memory = on_out_of_memory
        self.graphs: dict[tuple, Callable] = {}
        self.pool = None  # the memory pool every capture shares, made at the first capture
        self.eager = False  # the captures ran out of memory: every call runs fn as it is
        self.too_large: set[tuple] = set()  # shapes whose capture ran out of memory ("later"): run as they are
        self.refused: str | None = None  # why CUDA refused a capture (not for memory): every call runs eager

    @staticmethod
    def _key(args) -> tuple:
        return tuple((tuple(a.shape), a.dtype) for a in args)

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        if self.eager:
            return self.fn(*args)
        key = self._key(args)
        if key in self.too_large:
            return self.fn(*args)
        graphed = self.graphs.get(key)
        while graphed is None and (graphed := self._try_capture(key, args)) is None:
            # A memory cap (train.vram_gb) or a full card: the graphs' pool cannot share blocks with ordinary
            # memory, so capturing can need more than an eager step. Out of the except block: its traceback
            # held the failed capture's frames and, through them, the pool's memory (the frames form cycles,
            # hence the collection).
            self.release()
            if self.refused:
                log.warning("CUDA graphs could not be captured (%s); training on without them", self.refused)
                self.eager = True
                return self.fn(*args)
            answer = self.on_out_of_memory() if self.on_out_of_memory is not None else False
            if answer == "later":
                self.too_large.add(key)
                return self.fn(*args)
            if not answer:
                # Train on without graphs (slower per step, the same results) rather than lose the run.
                log.warning("CUDA graphs did not fit in memory (%s); training on without them",
                            ", ".join(str(tuple(a.shape)) for a in args))
                self.eager = True
                return self.fn(*args)
        return graphed(*args)

    def release(self) -> None:
        """Drops every captured graph and their shared pool, and gives the pool's memory back to the device: after
        a capture ran out of memory, and for the work after the last training step (the final evaluation and
        previews), which the pool's memory cannot serve. A later call captures again."""
        self.graphs.clear()
        self.pool = None
        gc.collect()  # the graphed callables' autograd functions and their closures hold the graphs in cycles
        torch.cuda.empty_cache()

    def _try_capture(self, key: tuple, args: tuple) -> Callable | None:
        stream = torch.cuda.current_stream() if torch.cuda.is_available() else None
        ooms = _ooms()
        try:
            return self._capture(key, args)
        except torch.OutOfMemoryError:
            return None
        except torch.AcceleratorError as e:
            # A capture CUDA refused (an operation that cannot be captured, a stream the capture does not
            # own) ends that capture, not the device's state: the run trains on without graphs instead of
            # being lost. Any other device error is the run's to report, and so is one that a refused
            # capture left behind (the next eager operation raises it).
            if "captur" not in str(e).lower():
                raise
            if stream is not None and torch.cuda.current_stream() != stream:
                # torch.cuda.graph's exit leaves the capture's stream only after its capture_end returned:
                # still on it, the capture's end failed (CUDA had abandoned the capture).
                self._hand_back_abandoned_capture(stream)
            if any(isinstance(x, torch.OutOfMemoryError) for x in error_chain(e)) or _ooms() > ooms:
                # Memory ran out inside the capture and CUDA abandoned it ("a previous error during capture"),
                # whether the out-of-memory error reached here or a kernel's fallback caught it (cuDNN tries a
                # smaller workspace): the same as running out before it, so the caller's on_out_of_memory decides.
                return None
            self.refused = _first_lines(e)
            return None

    def _hand_back_abandoned_capture(self, stream) -> None:
        """What torch leaves behind when a capture's end fails (its CUDAGraph.capture_end raises before it marks
        the capture ended, and torch.cuda.graph's exit before it leaves the capture's stream): the capture's
        stream current, and the graphs' pool in use for good (only a graph whose capture ended gives its pool
        back), so that every shape captured into it keeps its memory for the rest of the run (an eager step
        beside it then runs out). Put back here with the allocator's own calls, the ones torch.cuda.use_mem_pool
        ends with: no public API ends a capture that CUDA abandoned."""
        torch.cuda.set_stream(stream)
        device = torch.cuda.current_device()
        try:
            torch._C._cuda_endAllocateToPool(device, self.pool)
        except RuntimeError as e:  # torch 2.10 on ends the allocator's recording before it checks the capture
            if "not currently recording" not in str(e):
                raise
        torch._C._cuda_releasePool(device, self.pool)

    def _capture(self, key: tuple, args: tuple) -> Callable:
        """The graphs for `key`, captured now, with every shape `others` names on the first capture."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # The blocks the allocator keeps cached for the default stream (the step-0 previews' and evaluation's
        # activations) can serve neither the warm-up, which runs on a stream of its own, nor the graphs' pool:
        # kept, they would stay reserved beside both.
        torch.cuda.empty_cache()
        todo = {key: args}
        if not self.graphs and self.others is not None:
            for other in self.others(args):
                todo.setdefault(self._key(other), other)
        warmed = len(todo) > 1
        if warmed:
            t0 = time.perf_counter()
            self._warm_up(list(todo.values()))
            log.info("CUDA graphs: %d input shape(s) warmed up in %.1f s (cuDNN's algorithm search included)",
                     len(todo), time.perf_counter() - t0)
        for k, sample in todo.items():
            log.info("capturing CUDA graphs for input shapes %s", [s[0] for s in k])
            self.graphs[k] = torch.cuda.make_graphed_callables(
                _Positional(self.module, self.fn), tuple(a.detach().clone() for a in sample),
                num_warmup_iters=0 if warmed else self.warmup, allow_unused_input=True, pool=self.pool)
            # Warm-up ran in the ordinary pool and the captured passes live in the graphs' own: give the
            # warm-up's (and any earlier eager pass's) cached blocks back to the device.
            torch.cuda.empty_cache()
        return self.graphs[key]

    def _warm_up(self, samples: list[tuple]) -> None:
        # What make_graphed_callables' own warm-up does (lazy initialisation, cuDNN's algorithm search and
        # compilation out of the capture), for every shape before the first capture; gradients through
        # autograd.grad, so the parameters' .grad stay untouched.
        params = tuple(p for p in self.module.parameters() if p.requires_grad)
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream()):
            for sample in samples:
                sample = tuple(a.detach().clone() for a in sample)
                for _ in range(self.warmup):
                    out = self.fn(*sample)
                    torch.autograd.grad(out, params, grad_outputs=torch.zeros_like(out), allow_unused=True)
                    del out
                torch.cuda.synchronize()
                torch.cuda.empty_cache()


def _ooms() -> int:
    """How many times torch's allocator has run out of memory in this process (0 without CUDA)."""
    return torch.cuda.memory_stats().get("num_ooms", 0) if torch.cuda.is_available() else 0


def _first_lines(error: BaseException) -> str:
    """The first line of `error`, and of the first error it was raised while handling (what CUDA said first)."""
    chain = error_chain(error)
    lines = [str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__]
    if len(chain) > 1 and str(inner := chain[-1]).strip():
        lines.append("inside it: " + str(inner).strip().splitlines()[0])
    return "; ".join(lines)


class _Positional(torch.nn.Module):
    # make_graphed_callables wants a module (so it finds the trainable parameters) called with tensors.
    def __init__(self, module: torch.nn.Module, fn: Callable[..., torch.Tensor]):
        super().__init__()
        self.inner = module
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)


# ---- selective activation checkpointing: which units, for a budget ----
#
# A task lists the units of its model that can be checkpointed one by one (sdxl/speed.py's
# checkpoint_units for the UNet); measure_units fills in what each saves for backward and what it costs
# to recompute, and choose_checkpointed picks the fewest FLOPs of recomputation that fit a budget.

@dataclass
class CheckpointUnit:
    name: str                 # "down_blocks.1.resnets", "mid_block.attentions.0"
    switch: torch.nn.Module   # the module whose gradient_checkpointing flag checkpoints the unit
    members: list[str]        # names (in the UNet) of the modules that run checkpointed
    saved: int = 0            # bytes the members save for backward, at the measured batch
    flops: int = 0            # forward FLOPs of the members, at the measured batch

    @property
    def bytes_per_flop(self) -> float:
        return self.saved / max(self.flops, 1)

def measure_units(unet: torch.nn.Module, units: list[CheckpointUnit], call: Callable[[], torch.Tensor]) -> None:
    """Fill each unit's `saved` (bytes its modules save for backward: saved-tensor hooks; the frozen weights,
    which are not copies, and tensors already counted are left out) and `flops` (torch's FlopCounterMode)
    from one forward of `call()`."""
    from torch.utils.flop_counter import FlopCounterMode

    modules = dict(unet.named_modules())
    current: list[CheckpointUnit] = []
    seen: set[int] = set()
    params = {p.data_ptr() for p in unet.parameters()}

    def pack(t: torch.Tensor):
        if current and t.data_ptr() not in params and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            current[-1].saved += t.numel() * t.element_size()
        # Detached: a pack hook that returns the tensor itself ties saved outputs to their own graph nodes,
        # and the whole measured graph (every activation, and the adapter's gradient accumulators) then
        # outlives the pass, even a gc.collect(). Nothing is unpacked here: there is no backward.
        return t.detach()

    def enter(unit):
        return lambda module, args: current.append(unit)

    def leave(module, args, output):
        current.pop()

    handles = []
    for unit in units:
        unit.saved = unit.flops = 0
        for member in unit.members:
            handles.append(modules[member].register_forward_pre_hook(enter(unit)))
            handles.append(modules[member].register_forward_hook(leave))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), FlopCounterMode(display=False) as fc:
            out = call()
        del out
    finally:
        for h in handles:
            h.remove()
    counts = fc.get_flop_counts()
    root = type(unet).__name__
    for unit in units:
        unit.flops = sum(sum(counts.get(f"{root}.{m}", {}).values()) for m in unit.members)


def checkpoint_order(units: list[CheckpointUnit]) -> list[CheckpointUnit]:
    """The order in which units are checkpointed: most bytes freed per FLOP recomputed first (ties by
    name); units that save nothing (no adapter in or before them) never."""
    return sorted((u for u in units if u.saved > 0), key=lambda u: (-u.bytes_per_flop, u.name))


def checkpoint_more(units: list[CheckpointUnit], chosen: list[str]) -> list[str]:
    """`chosen` plus half (at least one) of the units it leaves out, in checkpoint_order: the next try when a
    step with `chosen` checkpointed ran out of memory. Empty when nothing is left to checkpoint."""
    left = [u.name for u in checkpoint_order(units) if u.name not in chosen]
    return left[:max(1, len(left) // 2)] if left else []


def choose_checkpointed(units: list[CheckpointUnit], budget_bytes: int, other_bytes: int,
                        scale: float = 1.0) -> list[str]:
    """Units to checkpoint so that other_bytes + scale x the activations left fit the budget (each
    checkpointed unit keeps only its input, so the saving is nearly its whole activation), taken in
    checkpoint_order. Deterministic."""
    chosen: list[str] = []
    total = other_bytes + scale * sum(u.saved for u in units)
    for unit in checkpoint_order(units):
        if total <= budget_bytes:
            break
        chosen.append(unit.name)
        total -= scale * unit.saved
    return chosen

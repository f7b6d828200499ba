"""cuDNN's algorithm search and attention graphs for a run's first step, done ahead at launch for a run like one
before it.

With cuDNN's search on (torch.backends.cudnn.benchmark, which training sets), the first call of each convolution
shape times the candidate algorithms; cuDNN's attention builds a graph at the first call of each shape. For SDXL's
UNet that is every convolution and attention of every bucket in the first step: most of its warm-up. What they
choose depends only on the calls' shapes, strides and dtypes (and the memory free for a workspace), not on any
value, and torch keeps it per thread: the forward's in the thread that calls the model, the backward's in
autograd's one thread for the device. So the calls a run's first step made are recorded (`Recorder`), and the next
run with the same model, adapter, data and step shapes replays them at launch on zero-filled tensors, while the main
thread imports the libraries and reads the model: the forward's on a thread of their own (`Replay`), which later
captures the step's CUDA graphs (`on_search_thread`), the backward's as the backward of a node of its own, so on
autograd's thread. Its first step then finds them made. The replay holds back as much memory as the recorded step
had in use at each call, so it chooses among the algorithms whose workspace the step itself could have had.

The main thread calls `wait()` before its own GPU work (encoding for the caches, quantizing, the speed levers'
measurements, training): the replay's timings must not share the GPU, nor its memory another phase's peak.
A missing, unreadable or foreign record (another GPU, another cuDNN) is not used; a replay that fails is
reported and the first step searches as it would have.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger(__name__)

RECORD_VERSION = 2
# The ops whose first call in a thread is slow and whose outcome depends only on shapes, strides and dtypes:
# cuDNN's convolution search (forward, backward) and cuDNN's attention graphs (forward, backward).
RECORDED_OPS = ("convolution.default", "convolution_backward.default",
                "_scaled_dot_product_cudnn_attention.default", "_scaled_dot_product_cudnn_attention_backward.default")
# The replay's held-back memory follows the recorded step's within this much (a new hold per call would
# cost an allocation each).
_HOLD_STEP = 1 << 29
# The interpreter's switch interval while the replay runs beside the imports: a replayed call waits for the
# interpreter between its GPU calls, up to one interval (sys.getswitchinterval) each time.
_SWITCH_INTERVAL = 0.0005
# What a record's name depends on besides the model, adapter and data: the train.* fields that set the
# shapes, dtypes and layout of the step's convolutions and attention.
_SHAPE_FIELDS = ("batch_size", "mixed_precision", "channels_last", "speed", "compile", "cuda_graphs", "fuse_qkv",
                 "lora_matmul", "fused_geglu", "gradient_checkpointing", "sdpa_backend")

T = TypeVar("T")


def record_path(cfg) -> Path | None:
    """Where a run with `cfg` records its first step's calls and finds the last such run's record: beside the
    run's latent cache (data.cache_dir, or the runs folder's .cache), named by what the calls' shapes depend on.
    None where no record applies: off (train.reuse_conv_search), another task, or set-up measuring on the GPU
    (memory budgets), which the replay must not share it with."""
    tc = cfg.train
    if cfg.task != "sdxl" or not tc.reuse_conv_search or tc.vram_gb or tc.checkpoint_budget_gb \
            or cfg.adapter.rank_budget or cfg.adapter.rank_budget_mb:
        return None
    key = cfg.settings_key(_SHAPE_FIELDS, {"torch": torch.__version__})
    return cfg.cache_root() / "conv-search" / f"{key}.json"


def _describe(v):
    """A call's argument as JSON: a tensor by its shape, strides, dtype and device type; lists and numbers as
    they are."""
    if isinstance(v, torch.Tensor):
        return {"tensor": list(v.shape), "stride": list(v.stride()), "dtype": str(v.dtype).removeprefix("torch."),
                "device": v.device.type}
    if isinstance(v, dict):
        return {k: _describe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_describe(x) for x in v]
    if isinstance(v, torch.SymInt):
        return int(v)
    return v


def _make(v, device: torch.device):
    """The argument `_describe` wrote, with zero-filled tensors on `device` (or the host, where it was there)."""
    if isinstance(v, dict) and "tensor" in v:
        where = device if v["device"] != "cpu" else torch.device("cpu")
        return torch.empty_strided(v["tensor"], v["stride"], dtype=getattr(torch, v["dtype"]), device=where).zero_()
    if isinstance(v, dict):
        return {k: _make(x, device) for k, x in v.items()}
    if isinstance(v, list):
        return [_make(x, device) for x in v]
    return v


class Recorder(TorchDispatchMode):
    """Notes every distinct call of RECORDED_OPS run inside it, whether it ran in the thread that entered it (the
    forward) or another (autograd's: the backward), with the memory allocated on the device at its first call. A
    dispatch mode: autograd's threads carry it into the backward."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, dict] = {}
        self._owner: int | None = None

    def __enter__(self):
        self._owner = threading.get_ident()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func).removeprefix("aten.")
        if name in RECORDED_OPS:
            self._note({"op": name, "args": _describe(args), "kwargs": _describe(kwargs),
                        "backward": threading.get_ident() != self._owner}, _device(args))
        return func(*args, **kwargs)

    def _note(self, call: dict, device: torch.device) -> None:
        key = json.dumps(call, sort_keys=True)
        if key not in self.calls:
            self.calls[key] = {**call, "allocated": _allocated(device)}

    def save(self, path: Path, device: torch.device) -> None:
        """The record, written atomically; a record that cannot be written costs the next run its head start,
        not this run: a warning."""
        from .fsutil import atomic_write_text

        record = {"version": RECORD_VERSION, "gpu": _device_name(device), "cudnn": torch.backends.cudnn.version(),
                  "flops_per_image": _FLOPS, "calls": list(self.calls.values())}
        try:
            atomic_write_text(path, json.dumps(record))
        except OSError as e:
            log.warning("could not write the record of this run's first step to %s (%s): the next run like it "
                        "searches cuDNN's algorithms in its first step", path, e)
            return
        log.info("cuDNN: %d calls recorded in %s for the next run like this one", len(self.calls), path)


def _device(args) -> torch.device:
    return next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _reserved(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _op(name: str):
    packet, overload = name.rsplit(".", 1)
    return getattr(getattr(torch.ops.aten, packet), overload)


def replay_calls(calls: list[dict], device: torch.device):
    """Makes each recorded call, with cuDNN's search on, in this thread (yielding after each one). Before a
    call, holds back what the recorded step had allocated beyond what this process has allocated now."""
    from .speed import cudnn_search

    hold, held = None, 0
    try:
        with cudnn_search(True), torch.no_grad():
            for call in calls:
                want = max(0, call["allocated"] - (_reserved(device) - held))
                if abs(want - held) > _HOLD_STEP:
                    hold = None
                    if device.type == "cuda":  # the old hold's memory given back, not kept cached beside the new
                        torch.cuda.empty_cache()
                    hold = torch.empty(want, dtype=torch.uint8, device=device) if want else None
                    held = want
                _op(call["op"])(*_make(call["args"], device), **_make(call["kwargs"], device))
                yield call
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        del hold


class _AsBackward(torch.autograd.Function):
    """The replay's calls as the backward of a node: autograd runs it on its thread for the device."""

    @staticmethod
    def forward(ctx, anchor, work):
        ctx.work = work
        return anchor.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.work()
        return None, None


class Replay:
    """The replay's thread, which stays for the run to capture its CUDA graphs (`call`), and its outcome."""

    def __init__(self, path: Path, device: torch.device):
        self.path, self.device = path, device
        self.calls = 0
        self.seconds = 0.0
        self.skipped: str | None = None  # why the record was not replayed
        self.error: BaseException | None = None
        self.flops_per_image: float | None = None  # the recorded run's FLOP count
        self._reported = False  # wait() logged the outcome
        # One thread runs the replay, then every later call (`call`), whose choices they share. A daemon: a run
        # stopped as it launches (Ctrl-C in the imports) does not wait for the replay to end.
        self._done = threading.Event()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="cudnn-search", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self._run()
        except Exception as e:  # one _run does not expect: wait() reports it, and the thread still serves `call`
            self.error = e
        finally:
            self._done.set()
        while (job := self._jobs.get()) is not None:
            job()

    def _run(self) -> None:
        t0 = time.perf_counter()
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, _SWITCH_INTERVAL))
        try:
            record = json.loads(self.path.read_text())
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            if record.get("version") != RECORD_VERSION or record.get("gpu") != _device_name(self.device) \
                    or record.get("cudnn") != torch.backends.cudnn.version():
                self.skipped = "recorded on another GPU, cuDNN or record version"
                return
            calls = record["calls"]
            self.flops_per_image = record.get("flops_per_image")
            self._calls([c for c in calls if not c["backward"]])
            backward = [c for c in calls if c["backward"]]
            if backward:
                anchor = torch.zeros((), device=self.device, requires_grad=True)
                _AsBackward.apply(anchor, lambda: self._calls(backward)).backward()
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # an unreadable or damaged record
            self.skipped = f"unreadable record ({type(e).__name__}: {e})"
        except (RuntimeError, torch.OutOfMemoryError) as e:  # the device refused a call: the first step searches
            self.error = e
        finally:
            sys.setswitchinterval(interval)
            self.seconds = time.perf_counter() - t0

    def _calls(self, calls: list[dict]) -> None:
        for _ in replay_calls(calls, self.device):
            self.calls += 1

    def call(self, fn: Callable[[], T]) -> T:
        """fn() run in the replay's thread, where the choices are; its exception raised here."""
        future: Future = Future()

        def job(future: Future = future) -> None:
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the caller, which raises it
                future.set_exception(e)

        self._jobs.put(job)
        try:
            return future.result()
        finally:
            future = job = None  # not kept by this frame, which a raised exception's traceback holds

    def wait(self) -> None:
        """The replay finished, its outcome logged once, its memory given back to the device."""
        if self._reported:
            return
        t0 = time.perf_counter()
        self._done.wait()
        waited = time.perf_counter() - t0
        self._reported = True
        if self.skipped:
            log.info("cuDNN: the record %s was not used: %s", self.path, self.skipped)
            return
        if self.error is not None:
            first = (str(self.error).strip().splitlines() or [""])[0]
            log.warning("cuDNN: replaying the recorded calls stopped after %d of them (%s: %s); the first step "
                        "searches the rest", self.calls, type(self.error).__name__, first)
        else:
            log.info("cuDNN: algorithms and attention graphs for %d recorded calls chosen on a thread at launch in "
                     "%.1f s (the main thread waited %.1f s for it)", self.calls, self.seconds, waited)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the replay's tensors and held memory, back to the device

    def close(self) -> None:
        """The thread ended, after the replay and any call queued before."""
        self._jobs.put(None)
        self._thread.join()


# This process's run: where its record goes (None: no record applies), its replay, if one started, and its FLOP
# count (note_flops), which the record keeps.
_PATH: Path | None = None
_REPLAY: Replay | None = None
_FLOPS: float | None = None


def start(cfg) -> Replay | None:
    """At a run's launch: where a run like `cfg` keeps its record, and, where one is there and the run trains on
    a CUDA GPU, its replay started on a thread. None without a replay (the first step then records, `record_to`)."""
    global _PATH, _REPLAY
    reset()
    path = record_path(cfg)
    if path is None or cfg.train.device == "cpu" or not torch.cuda.is_available():
        return None
    _PATH = path
    if not path.is_file():
        return None
    _REPLAY = Replay(_PATH, torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
    return _REPLAY


def record_to() -> Path | None:
    """Where the first step's calls are to be recorded: this run's record path where no usable record was
    replayed; None where one was, or no record applies. After `wait()`."""
    if _REPLAY is not None and not _REPLAY.skipped:
        return None
    return _PATH


def recorded_flops() -> float | None:
    """The FLOPs per image the recorded run counted, where its record was replayed (the same model, adapter,
    data and step shapes): the count's own forward pass need not run again. None where the run counts them."""
    if _REPLAY is None:
        return None
    _REPLAY.wait()
    return None if _REPLAY.skipped else _REPLAY.flops_per_image


def note_flops(per_image: float) -> None:
    """The run's FLOPs per image (MFU's), kept in the record its first step writes."""
    global _FLOPS
    _FLOPS = per_image


def on_search_thread(fn: Callable[[], T]) -> T:
    """fn() in the thread the record was replayed in, where its choices are (the step's warm-up and CUDA-graph
    captures); in this thread where none was. After `wait()`."""
    if _REPLAY is None or _REPLAY.skipped:
        return fn()
    return _REPLAY.call(fn)


def wait() -> None:
    """Before the main thread's own GPU work: the replay (if any) finished and reported, its memory given back."""
    if _REPLAY is not None:
        _REPLAY.wait()


def reset() -> None:
    """No run's record or replay pending (a run ended, or a test)."""
    global _PATH, _REPLAY, _FLOPS
    if _REPLAY is not None:
        _REPLAY.close()
    _PATH, _REPLAY, _FLOPS = None, None, None

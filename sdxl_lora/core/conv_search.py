"""cuDNN's algorithm search for the backward convolutions, done ahead at launch for a run like one before it.

With cuDNN's search on (torch.backends.cudnn.benchmark, which training sets), the first call of each convolution
shape times the candidate algorithms. For SDXL's UNet that is every convolution of every bucket in the first
step, most of its warm-up, and most of that in the backward (the input's gradient, and the weight's where a LoRA
convolution trains). The search's choice depends only on the call's shapes, dtype and memory layout (and the
memory free for a workspace), not on any value. torch keeps it per thread, and every backward on a GPU runs on
autograd's one thread for that device. So the backward convolutions a run's first step ran are recorded
(`Recorder`), and the next run with the same model, adapter, data and step shapes replays them at launch, on
zero-filled tensors, as the backward of a node of its own, so on that same thread, while the main thread imports
the libraries and reads the model: its first step then finds those algorithms chosen. The replay holds back as
much memory as the recorded step had in use at each call, so it chooses among the algorithms whose workspace the
step itself could have had. The forward convolutions run on the main thread, which searches them as before.

The main thread calls `wait()` before its own GPU work (encoding for the caches, quantizing, the speed levers'
measurements, training): the replay's timings must not share the GPU, nor its memory another phase's peak.
A missing, unreadable or foreign record (another GPU, another cuDNN) is not used; a replay that fails is
reported and the first step searches as it would have.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger(__name__)

RECORD_VERSION = 1
# The replay's held-back memory follows the recorded step's within this much (a new hold per call would
# cost an allocation each).
_HOLD_STEP = 1 << 29
# What a record's name depends on besides the model, adapter and data: the train.* fields that set the
# shapes, dtypes and layout of the step's convolutions.
_SHAPE_FIELDS = ("batch_size", "mixed_precision", "channels_last", "speed", "compile", "cuda_graphs", "fuse_qkv",
                 "lora_matmul", "fused_geglu", "gradient_checkpointing")


def record_path(cfg) -> Path | None:
    """Where a run with `cfg` records its first step's convolutions and finds the last such run's record: beside
    the run's latent cache (data.cache_dir, or the runs folder's .cache), named by what the convolutions'
    shapes depend on. None where no record applies: off (train.reuse_conv_search), another task, or set-up
    measuring on the GPU (memory budgets), which the replay must not share it with."""
    tc = cfg.train
    if cfg.task != "sdxl" or not tc.reuse_conv_search or tc.vram_gb or tc.checkpoint_budget_gb \
            or cfg.adapter.rank_budget or cfg.adapter.rank_budget_mb:
        return None
    key = cfg.settings_key(_SHAPE_FIELDS, {"torch": torch.__version__})
    return cfg.cache_root() / "conv-search" / f"{key}.json"


def _layout(t: torch.Tensor) -> str:
    return "channels_last" if t.dim() == 4 and not t.is_contiguous() and \
        t.is_contiguous(memory_format=torch.channels_last) else "contiguous"


class Recorder(TorchDispatchMode):
    """Notes every distinct backward convolution (with the gradients it computes) run inside it, with the memory
    allocated on the device at its first call. A dispatch mode: autograd's threads carry it into the backward."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, dict] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.convolution_backward.default:
            dy, x, w, bias_sizes, *params, mask = args
            self._note({"dy": list(dy.shape), "x": list(x.shape), "w": list(w.shape),
                        "bias_sizes": _plain(bias_sizes), "dtype": str(x.dtype).removeprefix("torch."),
                        "dy_layout": _layout(dy), "x_layout": _layout(x), "w_layout": _layout(w),
                        "params": _plain(params), "mask": list(mask)}, x.device)
        return func(*args, **kwargs)

    def _note(self, call: dict, device: torch.device) -> None:
        key = json.dumps(call, sort_keys=True)
        if key not in self.calls:
            self.calls[key] = {**call, "allocated": _allocated(device)}

    def save(self, path: Path, device: torch.device) -> None:
        """The record, written atomically; a record that cannot be written costs the next run its head start,
        not this run: a warning."""
        from .fsutil import atomic_write_text

        record = {"version": RECORD_VERSION, "gpu": _device_name(device),
                  "cudnn": torch.backends.cudnn.version(), "calls": list(self.calls.values())}
        try:
            atomic_write_text(path, json.dumps(record))
        except OSError as e:
            log.warning("could not write the record of this run's convolutions to %s (%s): the next run like it "
                        "searches cuDNN's algorithms in its first step", path, e)
            return
        log.info("cuDNN: %d convolution calls recorded in %s for the next run like this one", len(self.calls), path)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _reserved(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _plain(v):
    return [_plain(x) for x in v] if isinstance(v, (list, tuple)) else (int(v) if isinstance(v, torch.SymInt) else v)


def _tensor(shape, dtype, layout, device) -> torch.Tensor:
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    return torch.zeros(shape, dtype=dtype, device=device).contiguous(memory_format=fmt)


def _replay_call(call: dict, device: torch.device) -> None:
    dtype = getattr(torch, call["dtype"])
    dy, x, w = (_tensor(call[k], dtype, call[f"{k}_layout"], device) for k in ("dy", "x", "w"))
    stride, padding, dilation, transposed, output_padding, groups = call["params"]
    torch.ops.aten.convolution_backward(dy, x, w, call["bias_sizes"], stride, padding, dilation, transposed,
                                        output_padding, groups, call["mask"])


def replay_calls(calls: list[dict], device: torch.device):
    """Makes each recorded call, with cuDNN's search on, in this thread (yielding after each one). Before a
    call, holds back what the recorded step had allocated beyond what this process has allocated now."""
    before = torch.backends.cudnn.benchmark
    hold, held = None, 0
    torch.backends.cudnn.benchmark = True
    try:
        with torch.no_grad():
            for call in calls:
                want = max(0, call["allocated"] - (_reserved(device) - held))
                if abs(want - held) > _HOLD_STEP:
                    hold = None
                    if device.type == "cuda":  # the old hold's memory given back, not kept cached beside the new
                        torch.cuda.empty_cache()
                    hold = torch.empty(want, dtype=torch.uint8, device=device) if want else None
                    held = want
                _replay_call(call, device)
                yield call
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        del hold
        torch.backends.cudnn.benchmark = before


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
    """The replay's thread and its outcome."""

    def __init__(self, path: Path, device: torch.device):
        self.path, self.device = path, device
        self.calls = 0
        self.seconds = 0.0
        self.skipped: str | None = None  # why the record was not replayed
        self.error: BaseException | None = None
        self._reported = False  # wait() logged the outcome
        self._thread = threading.Thread(target=self._run, name="conv-search", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            record = json.loads(self.path.read_text())
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            if record.get("version") != RECORD_VERSION or record.get("gpu") != _device_name(self.device) \
                    or record.get("cudnn") != torch.backends.cudnn.version():
                self.skipped = "recorded on another GPU, cuDNN or record version"
                return
            self._replay(record["calls"])
        except (OSError, ValueError, KeyError, TypeError) as e:  # an unreadable or damaged record
            self.skipped = f"unreadable record ({type(e).__name__}: {e})"
        except (RuntimeError, torch.OutOfMemoryError) as e:  # the device refused a call: the first step searches
            self.error = e
        finally:
            self.seconds = time.perf_counter() - t0

    def _replay(self, calls: list[dict]) -> None:
        anchor = torch.zeros((), device=self.device, requires_grad=True)
        _AsBackward.apply(anchor, lambda: self._calls(calls)).backward()

    def _calls(self, calls: list[dict]) -> None:
        for _ in replay_calls(calls, self.device):
            self.calls += 1

    def wait(self) -> None:
        """The thread joined, its outcome logged once, its memory given back to the device."""
        if self._reported:
            return
        t0 = time.perf_counter()
        self._thread.join()
        waited = time.perf_counter() - t0
        self._reported = True
        if self.skipped:
            log.info("cuDNN: the record %s was not used: %s", self.path, self.skipped)
            return
        if self.error is not None:
            first = (str(self.error).strip().splitlines() or [""])[0]
            log.warning("cuDNN: replaying the recorded convolutions stopped after %d of them (%s: %s); the first "
                        "step searches the rest", self.calls, type(self.error).__name__, first)
        else:
            log.info("cuDNN: algorithms for %d recorded convolutions chosen on a thread at launch in %.1f s (the "
                     "main thread waited %.1f s for it)", self.calls, self.seconds, waited)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the replay's tensors and held memory, back to the device


# This process's run: where its record goes (None: no record applies) and its replay, if one started.
_PATH: Path | None = None
_REPLAY: Replay | None = None


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
    """Where the first step's convolutions are to be recorded: this run's record path where no usable record was
    replayed; None where one was, or no record applies."""
    if _REPLAY is not None and not _REPLAY.skipped:
        return None
    return _PATH


def wait() -> None:
    """Before the main thread's own GPU work: the replay (if any) finished and reported, its memory given back."""
    if _REPLAY is not None:
        _REPLAY.wait()


def reset() -> None:
    """No run's record or replay pending (a run ended, or a test)."""
    global _PATH, _REPLAY
    if _REPLAY is not None:
        _REPLAY._thread.join()
    _PATH, _REPLAY = None, None

"""What a task (SDXL, LLM) gives the training loop: the model, its data, its loss and what a finished run
keeps. The loop (core/loop.py) calls these methods and nothing else of the task.

A task subclasses `Task` and implements the abstract methods; the optional hooks below them have
defaults that do nothing, so a task declares only what it uses.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from .config import Config
from .runs import Run


class Task(ABC):
    # Batch keys that stay on the CPU when the loop moves a batch to the device (a task that reads them
    # on the host, such as per-sample RNG keys, then waits for nothing).
    host_keys: tuple[str, ...] = ()
    # The progress bar's short label of each unit that `units` counts (others show as "<name>_s").
    unit_labels: dict[str, str] = {"images": "img_s"}
    # How many parts the loop splits each batch into, one forward and backward each (1: the batch at once).
    # A task raises it when its step does not fit otherwise (sdxl: CUDA graphs under a memory cap). With a
    # loss that is a mean over the batch's samples the parts' losses weighted by their share give the whole
    # batch's gradient. Never raised with DDP, whose backward all-reduces each part.
    micro_batches: int = 1

    @abstractmethod
    def setup(self, accelerator, run: Run) -> None:
        """Load the model, read the data, place the adapter: everything before the optimizer exists."""

    @abstractmethod
    def model(self) -> torch.nn.Module:
        """The module the loop trains, checkpoints and (with several processes) wraps in DDP."""

    @abstractmethod
    def param_groups(self) -> list[dict]:
        """The trainable parameters as optimizer groups (a group may set its own "lr")."""

    @abstractmethod
    def dataloader(self) -> torch.utils.data.DataLoader:
        """Batches for this process. When its batch_sampler has skip_next(n) and num_replicas (1 if
        absent) equal to the process count (sdxl.buckets.BucketBatchSampler), it shards itself: the loop
        iterates it as it is, positions count global batches, and the loop moves batches to the device
        (keys in host_keys stay on the CPU). Otherwise Accelerate prepares (shards) it, dealing whole
        batches to the processes in turn."""

    @abstractmethod
    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The training loss of one batch, a scalar the loop calls backward on."""

    @abstractmethod
    def evaluate(self, model: torch.nn.Module) -> float:
        """A fixed-draw loss on training data: the same number for the same weights (before/after)."""

    def evaluate_before(self, model: torch.nn.Module) -> float:
        """evaluate() at step 0, before training; a task may reuse an earlier run's figure for the same base."""
        return self.evaluate(model)

    @abstractmethod
    def validate(self, model: torch.nn.Module) -> float | None:
        """The loss on held-out data, or None when the task holds none out."""

    @abstractmethod
    def batch_size(self, batch: Any) -> int:
        """How many samples (images, rows) the batch holds."""

    @abstractmethod
    def save_adapter(self, model: torch.nn.Module, run: Run, step: int) -> dict[str, Path]:
        """Write the trained adapter; returns its files by format."""

    @abstractmethod
    def preview(self, model: torch.nn.Module, run: Run, step: int) -> list[Path]:
        """Samples of what the model does now (images, answers); returns their files."""

    # ---- optional hooks ----
    def configure(self, cfg: Config, device_type: str, processes: int) -> Config:
        """Before the Accelerator exists: the config this run trains with on this device ("cuda" or "cpu")
        and process count. A task resolves its automatic settings here (and keeps the result as its own
        config); the loop then uses what this returns."""
        return cfg

    def on_step(self, step: int, model: torch.nn.Module) -> bool:
        """After optimizer step `step`. True when the task replaced trainable parameters (the loop then
        builds a new optimizer over them)."""
        return False

    def split(self, batch: Any) -> list[tuple[Any, float]]:
        """The batch in `micro_batches` parts (as even as they go) with each part's share of its samples.
        Default: a dict's tensors and lists whose first dim is the batch are sliced, other values shared."""
        if self.micro_batches <= 1 or not isinstance(batch, dict):
            return [(batch, 1.0)]
        n = self.batch_size(batch)
        parts = min(self.micro_batches, n)

        def rows(v, lo: int, hi: int):
            if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n or isinstance(v, list) and len(v) == n:
                return v[lo:hi]
            return v

        out, lo = [], 0
        for size in micro_sizes(n, parts):
            out.append(({k: rows(v, lo, lo + size) for k, v in batch.items()}, size / n))
            lo += size
        return out

    def units(self, batch: Any) -> dict[str, int | torch.Tensor]:
        """What the batch trains on, counted in the task's units of throughput: each name becomes
        `<name>_per_s` in the step events and TensorBoard and a rate in the progress bar. A count may be a
        device tensor (the loop reads it at the next log point, not every step). Default: the batch's
        samples as images."""
        return {"images": self.batch_size(batch)}

    def identity(self) -> dict[str, Any]:
        """What makes this run this run (its base model, adapter plan, data), in plain values: saved with
        each training state, and a resume whose config gives another identity is refused, naming what
        differs. Empty: no check."""
        return {}

    def flops_per_sample(self, batch: Any) -> float | None:
        """FLOPs of one training step per sample of `batch`, for MFU, counted without the device (no memory, no
        kernels: a copy of the model on the meta device). None: the loop counts a forward on the device."""
        return None

    def end_training(self) -> None:
        """The last training step is done and the run finishes (the final evaluation, export and previews
        follow): free what only the training steps use (sdxl: the CUDA graphs and their memory pool)."""

    def compiled(self) -> None:
        """The compiled regions (train.compile) have run: what the task remembers of a compilation that
        worked (sdxl: that the compile cache is warm for runs like this one)."""

    def restore_step(self, step: int, model: torch.nn.Module) -> bool:
        """Before a resume at `step`, ahead of loading the saved weights: give the trainable parameters the
        shapes they had at that step. True when any was replaced."""
        return False


def micro_sizes(n: int, parts: int) -> list[int]:
    """A batch of n split into `parts` micro-batches, as even as they go, larger first (torch.tensor_split's
    sizes)."""
    parts = max(1, min(parts, n))
    return [n // parts + (i < n % parts) for i in range(parts)]

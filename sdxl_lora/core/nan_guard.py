"""The NaN/Inf guard of the training loop (train.nan_guard, train.max_nan_steps): which optimizer steps are
skipped, when the host reads that, and the message a run stops with after too many in a row."""
from __future__ import annotations

import logging

import torch

from .config import Config
from .runs import Run

log = logging.getLogger(__name__)


class PendingFlag:
    """A flag on the device, copied to the host without waiting; bad() waits for the copy only when read."""

    def __init__(self, flag: torch.Tensor, step: int):
        self.step = step
        self.host = flag.to("cpu", non_blocking=True)
        self.event = None
        if flag.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def bad(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
        return bool(self.host > 0)


def inner_optimizer(optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # Accelerate wraps it


class NanGuard:
    """The NaN/Inf guard (train.nan_guard): an optimizer step with a non-finite loss (in any micro-batch) or
    gradient norm, on any process, is skipped (weights unchanged), logged and counted; train.max_nan_steps
    in a row set `message`, the reason the run stops with.

    Deferred where the optimizer can skip a step on the device (torch's fused Adam/AdamW take a
    `found_inf` tensor, as from a grad scaler): the verdict is a flag the optimizer reads, copied to the host
    without waiting and read one step later, so the host queues step k+1 while the GPU still runs step k.
    Otherwise the host waits for each step's verdict and skips the optimizer step itself."""

    def __init__(self, cfg: Config, accelerator, run: Run, optimizer, ema: bool):
        self.cfg, self.acc, self.run = cfg, accelerator, run
        self.on = cfg.train.nan_guard
        self.deferred = self.on and self._can_defer(optimizer, ema)
        self.pending: PendingFlag | None = None  # the verdict of the last step, not read yet
        self._queued: PendingFlag | None = None  # the verdict of the step under way
        self.in_a_row = self.skipped = 0
        self.message: str | None = None

    def _can_defer(self, optimizer, ema: bool) -> bool:
        """Fused Adam/AdamW skip the update (weights, moments, step count) when found_inf == 1. Not with
        fp16's grad scaler (it sets found_inf itself) nor with train.ema (its update would still run)."""
        opt = inner_optimizer(optimizer)
        return (isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) and bool(opt.defaults.get("fused"))
                and self.acc.scaler is None and not ema)

    def after_backward(self, bad: torch.Tensor, grad_norm: torch.Tensor | None, step: int, optimizer) -> bool:
        """The verdict on optimizer step `step`, before it is taken. True when the host must skip it (the
        waiting mode); deferred, the optimizer is told and skips it itself."""
        if not self.on:
            return False
        flag = self._flag(bad, grad_norm)
        if self.deferred:
            inner_optimizer(optimizer).found_inf = flag
            self._queued = PendingFlag(flag, step)
            return False
        return flag.item() > 0  # the host waits for the step here

    def after_step(self, step: int, skipped: bool) -> None:
        """Once step `step` is queued: deferred, the previous step's verdict is read (this step's work is
        queued behind it by now); otherwise this step's (`skipped`) is recorded."""
        if self.deferred:
            if self.pending is not None:
                self._read(self.pending)
            self.pending, self._queued = self._queued, None
        elif self.on:
            self.message = self.verdict(step, skipped) or self.message

    def settle(self) -> None:
        """Read the pending verdict now: at points where the host waits for the device anyway."""
        if self.pending is not None:
            self._read(self.pending)
            self.pending = None

    def _read(self, pending: PendingFlag) -> None:
        self.message = self.verdict(pending.step, pending.bad()) or self.message

    def _flag(self, bad: torch.Tensor, grad_norm: torch.Tensor | None) -> torch.Tensor:
        """On the device, 1.0 if this optimizer step must be skipped (0.0 if not), agreed by all processes.
        Under fp16, gradient overflow is the grad scaler's to handle (it skips the step and lowers its
        scale), so only the loss counts there."""
        if self.acc.scaler is None and grad_norm is not None:  # DeepSpeed may not give the norm
            bad = bad | ~torch.isfinite(grad_norm)
        # Exactly 1.0, not the sum over processes: fused Adam skips only when found_inf == 1 (with a sum of 2 on
        # two processes it would step into NaN weights while the log said "skipped").
        return (self.acc.reduce(bad.float(), "sum") > 0).float()

    def verdict(self, step: int, bad: bool) -> str | None:
        """Record the verdict on `step`: a skipped step is logged and counted; max_nan_steps in a row give
        the message the run stops with."""
        if not bad:
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        self.skipped += 1
        n, acc, cfg = self.in_a_row, self.acc, self.cfg
        log.warning("step %d: non-finite loss or gradient; step skipped, weights unchanged (%d in a row, "
                    "%d in all)", step, n, self.skipped)
        if acc.is_main_process:
            self.run.event("nonfinite", step=step, in_a_row=n, skipped=self.skipped)
        if n < cfg.train.max_nan_steps:
            return None
        msg = (f"{n} steps in a row (up to step {step}) had a non-finite loss or gradient, "
               f"so the run stopped. Likely causes: fp16 overflow (mixed_precision="
               f"{acc.mixed_precision!r}; try train.mixed_precision='bf16', or 'no'), or a learning rate "
               f"too high (train.lr={cfg.train.lr:g}; try a smaller one, or more warmup_steps, or "
               f"max_grad_norm). The state is saved: fix the cause and resume.")
        log.error(msg)
        return msg


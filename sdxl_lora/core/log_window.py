"""What the training loop reports between two log points: loss, gradient norm, samples and the task's units
per second, eta; summed on the device so a step never waits for them."""
from __future__ import annotations

import time

import torch


def throughput_postfix(rates: dict[str, float], labels: dict[str, str]) -> dict[str, str]:
    """The progress bar's fields for the units per second of a log window, under the task's short labels
    (Task.unit_labels): {"img_s": "12.3"}."""
    return {labels.get(name, f"{name}_s"): f"{v:.1f}" for name, v in rates.items()}


class LogWindow:
    """The figures between two log points, kept on the device (finite losses and gradient norms summed,
    and their counts) so that a step never waits for it; read back, one host sync, at flush."""

    def __init__(self, accelerator, step: int, total: int):
        self.acc, self.step0, self.total = accelerator, step, total
        dev = accelerator.device
        self.losses, self.n_losses, self.norms, self.n_norms = (torch.zeros((), device=dev) for _ in range(4))
        self.samples = 0  # over all processes, for MFU (FLOPs are counted per sample)
        self.units: dict[str, int | torch.Tensor] = {}  # the task's throughput units (Task.units), ditto
        self.started = self.opened = time.perf_counter()
        # The latest step's loss for a watcher between log points, read one step late so that no step waits:
        # each step's loss is copied to the host asynchronously and read at the next step once its copy is done.
        cuda = dev.type == "cuda"
        self._step_loss = torch.zeros((), device=dev)
        self._host = torch.zeros((), pin_memory=cuda)
        self._copied = torch.cuda.Event() if cuda else None
        self._host_step = 0  # the step whose loss _host holds (or will, once _copied is done)

    def add_step_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss, kept as the step's latest for peek()."""
        self._step_loss.copy_(loss.detach().float())

    def peek(self, step: int) -> dict:
        """What a watcher sees between log points at `step`, read without waiting on the device: the loss of
        the latest step whose copy has arrived ({"loss": ..., "loss_step": N}; this process's own micro-batch)
        and each count unit per second so far in this window. Starts the copy of this step's loss."""
        out: dict = {}
        if self._copied is None:  # on the CPU the loss is at hand
            self._host.copy_(self._step_loss)
            self._host_step, ready = step, True
        else:
            ready = self._host_step > 0 and self._copied.query()
        if ready:
            value = float(self._host)
            if value == value:  # a non-finite step has no loss to show
                out.update(loss=value, loss_step=self._host_step)
        if self._copied is not None and (ready or not self._host_step):  # the next copy, read at a later step
            self._host.copy_(self._step_loss, non_blocking=True)
            self._copied.record()
            self._host_step = step
        seconds = max(time.perf_counter() - self.opened, 1e-9)
        out.update({f"{name}_per_s": round(n / seconds, 3) for name, n in self.units.items() if isinstance(n, int)})
        return out

    def add_norm(self, norm: torch.Tensor | None) -> None:
        """A step's gradient norm before clipping (None where the backend gives none)."""
        if norm is not None:
            self.norms += torch.where(torch.isfinite(norm), norm, 0.0)
            self.n_norms += torch.isfinite(norm)

    def add_loss(self, loss: torch.Tensor, finite: torch.Tensor, samples: int, units: dict) -> None:
        """A micro-batch's loss (counted when finite), and the samples and units (ints, or device tensors
        read at flush) all processes took with it."""
        self.losses += torch.where(finite, loss, 0.0)
        self.n_losses += finite
        self.samples += samples
        for name, n in units.items():
            self.units[name] = self.units.get(name, 0) + n

    def eta(self, step: int, now: float | None = None) -> float:
        """Seconds left at `step`, at this session's mean pace so far."""
        now = time.perf_counter() if now is None else now
        return (now - self.started) / max(step - self.step0, 1) * (self.total - step)

    def flush(self, step: int) -> tuple[float, float, dict[str, float], float | None, float]:
        """The window's mean loss over all processes, samples/s, each unit per second, mean gradient norm
        (None when none was finite) and the run's eta in seconds at `step`; then a new window opens."""
        acc = self.acc
        mean = (acc.reduce(self.losses, "sum") / acc.reduce(self.n_losses, "sum")).item()
        now = time.perf_counter()
        seconds = max(now - self.opened, 1e-9)
        rates = {name: float(n) / seconds for name, n in self.units.items()}
        eta = self.eta(step, now)
        grad_norm = (self.norms / self.n_norms).item() if self.n_norms.item() else None
        for t in (self.losses, self.n_losses, self.norms, self.n_norms):
            t.zero_()
        sps = self.samples / seconds
        self.samples, self.units, self.opened = 0, {}, now
        return mean, sps, rates, grad_norm, eta


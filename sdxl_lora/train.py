"""The training loop, generic over a task: batches in, loss out. It knows nothing of images or tokens.

What a user gets from `Trainer`:
  - Accelerate underneath: one code path for CPU, one GPU or many (`accelerate launch`), mixed
    precision no/fp16/bf16 ("auto": bf16 where the GPU has it), gradient accumulation;
  - the optimizer and lr schedule of the config (optim.py: AdamW, AdamW8bit, Adafactor, Lion, Prodigy;
    constant, linear, cosine, cosine with restarts, polynomial, each with warmup), gradient clipping;
  - a NaN/Inf guard: a step with a non-finite loss or gradient is skipped (weights unchanged), counted and
    logged; after train.max_nan_steps in a row the state is saved and the run stops, naming likely causes.
    It costs one host sync a step (train.nan_guard=false removes it);
  - a progress bar, and an events file (step, loss, lr, images/s, eta) that the UI reads;
  - training states every N steps / M minutes (atomic, checksummed, last K kept), resume to the same
    adapter bit for bit, Ctrl-C/SIGTERM finishing the step and saving before it stops;
  - the final adapter written (atomically) before anything that can still fail (final previews).
Set-up reads top to bottom in the order things depend on each other:
accelerator -> seed -> task (model, data, caches) -> optimizer -> schedule -> prepare.
"""
from __future__ import annotations

import logging
import math
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from . import checkpoint
from .config import Config
from .optim import build_optimizer, make_schedule
from .runs import Run

log = logging.getLogger(__name__)


class Task(Protocol):
    """What a task (SDXL, LLM) gives the loop."""

    def setup(self, accelerator, run: Run) -> None: ...
    def model(self) -> torch.nn.Module: ...
    def param_groups(self) -> list[dict]: ...
    def dataloader(self) -> torch.utils.data.DataLoader: ...
    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor: ...
    def evaluate(self, model: torch.nn.Module) -> float: ...
    def validate(self, model: torch.nn.Module) -> float | None: ...
    def batch_size(self, batch: Any) -> int: ...
    def save_adapter(self, model: torch.nn.Module, run: Run, step: int) -> dict[str, Path]: ...
    def preview(self, model: torch.nn.Module, run: Run, step: int) -> list[Path]: ...


@dataclass
class Result:
    run: Run
    steps: int
    adapter: dict[str, Path]
    samples: list[Path] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    eval_before: float = math.nan
    eval_after: float = math.nan
    interrupted: str | None = None   # the signal's name when stopped by Ctrl-C/SIGTERM, or "nan_guard"
    message: str | None = None       # why the run stopped, for the user, when not by a signal
    state: Path | None = None        # the last training state saved


def resolve_mixed_precision(cfg: Config, device_type: str) -> str:
    mp = cfg.train.mixed_precision
    if mp != "auto":
        return mp
    if device_type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def make_accelerator(cfg: Config):
    from accelerate import Accelerator

    dev = cfg.train.device
    if dev == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device='cuda' but no CUDA GPU is visible; use --device cpu")
    cpu = dev == "cpu" or (dev == "auto" and not torch.cuda.is_available())
    mp = resolve_mixed_precision(cfg, "cpu" if cpu else "cuda")
    return Accelerator(cpu=cpu, mixed_precision=mp, gradient_accumulation_steps=cfg.train.grad_accum)


class Trainer:
    def __init__(self, cfg: Config, task: Task, run: Run, resume: Path | None = None):
        self.cfg, self.task, self.run, self.resume = cfg, task, run, resume
        self.step = self.epoch = self.position = 0  # position: batches taken in the current epoch
        self._rng_to_restore: dict | None = None
        self._stop: str | None = None
        self.skipped = 0  # optimizer steps skipped by the NaN guard in this session

    def setup(self) -> None:
        from accelerate.utils import set_seed

        cfg = self.cfg
        self.accelerator = make_accelerator(cfg)
        set_seed(cfg.train.seed)
        self.task.setup(self.accelerator, self.run)
        self.optimizer = build_optimizer(cfg, self.task.param_groups())
        self.schedule = make_schedule(cfg, self.optimizer, self.accelerator.num_processes)
        loader = self.task.dataloader()
        self.sampler = loader.batch_sampler
        self.model, self.optimizer, self.loader, self.schedule = self.accelerator.prepare(
            self.task.model(), self.optimizer, loader, self.schedule)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.resume is not None:
            self._load(self.resume)

    # ---- training state ----
    def _trainable(self) -> dict[str, torch.nn.Parameter]:
        model = self.accelerator.unwrap_model(self.model)
        return {n: p for n, p in model.named_parameters() if p.requires_grad}

    def _save(self) -> Path:
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        trainer_state = {"step": self.step, "epoch": self.epoch, "position": self.position,
                         "schedule": self.schedule.state_dict(), "rng": rng}
        path = checkpoint.save_state(self.run.checkpoints_dir, self.step, self._trainable(),
                                     self.optimizer.state_dict(), trainer_state, self.cfg.train.keep_checkpoints)
        self.run.event("checkpoint", step=self.step, path=str(path))
        return path

    def _load(self, state: Path) -> None:
        adapter, opt_state, tr = checkpoint.load_state(state)
        params = self._trainable()
        if adapter.keys() != params.keys():
            raise checkpoint.CheckpointError(
                f"{state}: its adapter does not match this run's plan ({len(adapter)} tensors saved, "
                f"{len(params)} expected); resume with the run's own config")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(adapter[name])
        self.optimizer.load_state_dict(opt_state)
        self.schedule.load_state_dict(tr["schedule"])
        self.step, self.epoch, self.position = tr["step"], tr["epoch"], tr["position"]
        # Restored once the epoch's loader iterator exists (creating one draws from the RNG).
        self._rng_to_restore = tr["rng"]
        log.info("resumed from %s at step %d", state, self.step)
        self.run.event("resume", step=self.step, path=str(state))

    def _restore_rng(self) -> None:
        rng, self._rng_to_restore = self._rng_to_restore, None
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    def _batches(self):
        while True:
            # Accelerate's loader forwards the epoch to our bucket sampler and dataset: a new order
            # each epoch, decided by (seed, epoch) alone.
            self.loader.set_epoch(self.epoch)
            if self.position:
                self.sampler.skip_next(self.position)
            for batch in self.loader:
                # Starting an epoch's iterator draws from the RNG (the loader's base seed), and it only
                # starts at the first fetch: restore the saved RNG after that, as the saved run had it.
                if self._rng_to_restore is not None:
                    self._restore_rng()
                self.position += 1
                yield batch
            if self._rng_to_restore is not None:  # resumed exactly at an epoch's end
                self._restore_rng()
            self.epoch += 1
            self.position = 0

    def _skip_step(self, bad: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Whether this optimizer step must be skipped: a non-finite loss (in any micro-batch) or gradient
        norm, on any process. The one host sync of the step. Under fp16, gradient overflow is the grad
        scaler's to handle (it skips the step and lowers its scale), so only the loss counts there."""
        if self.accelerator.scaler is None:
            bad = bad | ~torch.isfinite(grad_norm)
        return bool(self.accelerator.reduce(bad.float(), "sum").item())

    def _check_in(self, model, step: int) -> list[Path]:
        """Previews and the validation loss at this step. The RNG is forked so the run goes on exactly
        as without them (resume stays bit-exact)."""
        paths: list[Path] = []
        with torch.random.fork_rng(devices=[self.accelerator.device] if self.accelerator.device.type == "cuda" else []):
            val = self.task.validate(model)
            if self.accelerator.is_main_process:
                if val is not None:
                    self.run.event("validation", step=step, loss=val)
                paths = self.task.preview(model, self.run, step)
                if paths:
                    self.run.event("samples", step=step, paths=[str(p) for p in paths])
        return paths

    def _on_signal(self, signum, frame) -> None:
        if self._stop is not None:
            raise KeyboardInterrupt  # second Ctrl-C: stop now; the last saved state is intact
        self._stop = signal.Signals(signum).name
        log.warning("%s received: finishing this step and saving the state (press Ctrl-C again to stop at once)",
                    self._stop)

    def fit(self) -> Result:
        cfg, acc, run = self.cfg, self.accelerator, self.run
        total = cfg.train.steps
        unwrapped = acc.unwrap_model(self.model)
        samples: list[Path] = []
        if cfg.preview.before and acc.is_main_process and self.step == 0:
            samples += self.task.preview(unwrapped, run, 0)
            run.event("samples", step=0, paths=[str(p) for p in samples])

        if self.step == 0:
            eval_before = self.task.evaluate(unwrapped)
            run.event("eval", step=0, loss=eval_before)
            if (val := self.task.validate(unwrapped)) is not None:
                run.event("validation", step=0, loss=val)
        else:  # resumed: the run's own starting figure
            eval_before = next((e["loss"] for e in run.events() if e["event"] == "eval"), math.nan)
        run.event("start", step=self.step, total_steps=total, state="training")
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._loop(samples, eval_before)
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)

    def _loop(self, samples: list[Path], eval_before: float) -> Result:
        """The training step, on one screen: batches -> loss -> backward -> clip -> step; log; save."""
        cfg, acc, run = self.cfg, self.accelerator, self.run
        total = cfg.train.steps
        unwrapped = acc.unwrap_model(self.model)
        bar = tqdm(total=total, initial=self.step, desc="training", unit="step", disable=not acc.is_main_process,
                   dynamic_ncols=True)
        losses: list[float] = []
        # Finite losses summed on the device, and their count; read back only at log time.
        window = torch.zeros((), device=acc.device)
        window_n = torch.zeros((), device=acc.device)
        window_images = 0
        t_start = t_window = t_saved = time.perf_counter()
        step0 = step = self.step
        state: Path | None = None
        guard, clip = cfg.train.nan_guard, cfg.train.max_grad_norm
        bad_in_a_row, nan_stop = 0, None
        batches = self._batches()
        self.model.train()
        while step < total:
            bad = torch.zeros((), dtype=torch.bool, device=acc.device)
            skip = False
            for _ in range(cfg.train.grad_accum):
                batch = next(batches)
                with acc.accumulate(self.model):
                    loss = self.task.loss(self.model, batch)
                    acc.backward(loss)
                    checkpoint.test_fault("step", step + 1)
                    finite = torch.isfinite(loss.detach())
                    bad = bad | ~finite
                    if acc.sync_gradients and (clip > 0 or guard):
                        # With clipping off the guard still needs the norm: clipping at infinity scales by 1.0.
                        norm = acc.clip_grad_norm_(self.params, clip if clip > 0 else math.inf)
                        if guard:
                            skip = self._skip_step(bad, norm)
                    if not skip:
                        self.optimizer.step()
                    self.schedule.step()
                    self.optimizer.zero_grad(set_to_none=True)
                window += torch.where(finite, loss.detach(), 0.0)
                window_n += finite
                window_images += self.task.batch_size(batch) * acc.num_processes
            step = self.step = step + 1
            bar.update(1)
            if skip:
                bad_in_a_row += 1
                self.skipped += 1
                log.warning("step %d: non-finite loss or gradient; step skipped, weights unchanged (%d in a row, "
                            "%d in all)", step, bad_in_a_row, self.skipped)
                if acc.is_main_process:
                    run.event("nonfinite", step=step, in_a_row=bad_in_a_row, skipped=self.skipped)
                if bad_in_a_row >= cfg.train.max_nan_steps:
                    nan_stop = (
                        f"{bad_in_a_row} steps in a row (up to step {step}) had a non-finite loss or gradient, "
                        f"so the run stopped. Likely causes: fp16 overflow (mixed_precision="
                        f"{acc.mixed_precision!r}; try train.mixed_precision='bf16', or 'no'), or a learning rate "
                        f"too high (train.lr={cfg.train.lr:g}; try a smaller one, or more warmup_steps, or "
                        f"max_grad_norm). The state is saved: fix the cause and resume.")
                    log.error(nan_stop)
            else:
                bad_in_a_row = 0
            if step % cfg.train.log_every == 0 or step == total:
                mean = (acc.reduce(window, "sum") / acc.reduce(window_n, "sum")).item()
                now = time.perf_counter()
                ips = window_images / max(now - t_window, 1e-9)
                elapsed = now - t_start
                eta = elapsed / (step - step0) * (total - step)
                lr = self.schedule.get_last_lr()[0]
                losses.append(mean)
                bar.set_postfix(loss=f"{mean:.4f}", lr=f"{lr:.2e}", img_s=f"{ips:.1f}")
                if acc.is_main_process:
                    run.event("step", step=step, total_steps=total, loss=mean, lr=lr,
                              images_per_s=round(ips, 3), eta_s=round(eta, 1), state="training")
                window.zero_()
                window_n.zero_()
                window_images, t_window = 0, now
            if cfg.preview.every and step % cfg.preview.every == 0 and step < total:
                samples += self._check_in(unwrapped, step)
            due = (cfg.train.save_every and step % cfg.train.save_every == 0) or (
                cfg.train.save_every_minutes and time.perf_counter() - t_saved >= 60 * cfg.train.save_every_minutes)
            stop = self._stop or ("nan_guard" if nan_stop else None)
            if stop or (due and step < total):
                if acc.is_main_process:
                    state = self._save()
                acc.wait_for_everyone()
                t_saved = time.perf_counter()
            if stop:
                bar.close()
                if acc.is_main_process:
                    run.event("interrupted", step=step, signal=stop, state="interrupted", path=str(state),
                              **({"message": nan_stop} if nan_stop else {}))
                return Result(run, step, {}, samples, losses, eval_before, interrupted=stop, state=state,
                              message=nan_stop)
        bar.close()

        acc.wait_for_everyone()
        eval_after = self.task.evaluate(unwrapped)
        val_after = self.task.validate(unwrapped)
        adapter: dict[str, Path] = {}
        if acc.is_main_process:
            # The adapter first: previews can still fail (out of memory, a bad prompt) and must not cost the result.
            adapter = self.task.save_adapter(unwrapped, run, step)
            run.event("adapter", step=step, paths={k: str(v) for k, v in adapter.items()})
            run.event("eval", step=step, loss=eval_after)
            if val_after is not None:
                run.event("validation", step=step, loss=val_after)
            if cfg.preview.after:
                after = self.task.preview(unwrapped, run, step)
                samples += after
                run.event("samples", step=step, paths=[str(p) for p in after])
            run.event("done", step=step, state="finished", final_loss=losses[-1] if losses else math.nan)
        return Result(run, step, adapter, samples, losses, eval_before, eval_after, state=state)

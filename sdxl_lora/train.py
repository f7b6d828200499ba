"""The training loop, generic over a task: batches in, loss out. It knows nothing of images or tokens.

What a user gets from `Trainer`:
  - Accelerate underneath: one code path for CPU, one GPU or many (`accelerate launch`), mixed
    precision no/fp16/bf16 ("auto": bf16 where the GPU has it), gradient accumulation;
  - AdamW with a warmup + constant/linear/cosine schedule (diffusers' schedule helpers), gradient clipping;
  - a progress bar, and an events file (step, loss, lr, images/s, eta) that the UI reads;
  - the final adapter written (atomically) before anything that can still fail (final previews).
Set-up reads top to bottom in the order things depend on each other:
accelerator -> seed -> task (model, data, caches) -> optimizer -> schedule -> prepare.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from .config import Config
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


def make_schedule(cfg: Config, optimizer, num_processes: int = 1):
    from diffusers.optimization import get_scheduler

    name = cfg.train.scheduler
    if name == "constant" and cfg.train.warmup_steps:
        name = "constant_with_warmup"
    # Accelerate's prepared scheduler advances num_processes times per optimizer step, so the
    # schedule is laid out in those units to keep warmup and decay in optimizer steps.
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.train.warmup_steps * num_processes,
                         num_training_steps=cfg.train.steps * num_processes)


class Trainer:
    def __init__(self, cfg: Config, task: Task, run: Run):
        self.cfg, self.task, self.run = cfg, task, run

    def setup(self) -> None:
        from accelerate.utils import set_seed

        cfg = self.cfg
        self.accelerator = make_accelerator(cfg)
        set_seed(cfg.train.seed)
        self.task.setup(self.accelerator, self.run)
        self.optimizer = torch.optim.AdamW(self.task.param_groups(), lr=cfg.train.lr,
                                           weight_decay=cfg.train.weight_decay)
        self.schedule = make_schedule(cfg, self.optimizer, self.accelerator.num_processes)
        self.model, self.optimizer, self.loader, self.schedule = self.accelerator.prepare(
            self.task.model(), self.optimizer, self.task.dataloader(), self.schedule)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]

    def _batches(self):
        epoch = 0
        while True:
            # Accelerate's loader forwards the epoch to our bucket sampler: a new order each epoch.
            self.loader.set_epoch(epoch)
            yield from self.loader
            epoch += 1

    def fit(self) -> Result:
        cfg, acc, run = self.cfg, self.accelerator, self.run
        total = cfg.train.steps
        unwrapped = acc.unwrap_model(self.model)
        samples: list[Path] = []
        if cfg.preview.before and acc.is_main_process:
            samples += self.task.preview(unwrapped, run, 0)
            run.event("samples", step=0, paths=[str(p) for p in samples])

        eval_before = self.task.evaluate(unwrapped)
        run.event("eval", step=0, loss=eval_before)
        run.event("start", total_steps=total, state="training")
        bar = tqdm(total=total, desc="training", unit="step", disable=not acc.is_main_process, dynamic_ncols=True)
        losses: list[float] = []
        window = torch.zeros((), device=acc.device)
        window_n, window_images, t_window = 0, 0, time.perf_counter()
        t_start = time.perf_counter()
        step = 0
        batches = self._batches()
        self.model.train()
        while step < total:
            for _ in range(cfg.train.grad_accum):
                batch = next(batches)
                with acc.accumulate(self.model):
                    loss = self.task.loss(self.model, batch)
                    acc.backward(loss)
                    if acc.sync_gradients and cfg.train.max_grad_norm > 0:
                        acc.clip_grad_norm_(self.params, cfg.train.max_grad_norm)
                    self.optimizer.step()
                    self.schedule.step()
                    self.optimizer.zero_grad(set_to_none=True)
                # Summed on the device; read back only at log time, so the step never waits on the host.
                window += loss.detach()
                window_n += 1
                window_images += self.task.batch_size(batch) * acc.num_processes
            step += 1
            bar.update(1)
            if step % cfg.train.log_every == 0 or step == total:
                mean = (acc.reduce(window, "mean") / window_n).item()
                now = time.perf_counter()
                ips = window_images / max(now - t_window, 1e-9)
                elapsed = now - t_start
                eta = elapsed / step * (total - step)
                lr = self.schedule.get_last_lr()[0]
                losses.append(mean)
                bar.set_postfix(loss=f"{mean:.4f}", lr=f"{lr:.2e}", img_s=f"{ips:.1f}")
                if acc.is_main_process:
                    run.event("step", step=step, total_steps=total, loss=mean, lr=lr,
                              images_per_s=round(ips, 3), eta_s=round(eta, 1), state="training")
                window.zero_()
                window_n, window_images, t_window = 0, 0, now
        bar.close()

        acc.wait_for_everyone()
        eval_after = self.task.evaluate(unwrapped)
        adapter: dict[str, Path] = {}
        if acc.is_main_process:
            # The adapter first: previews can still fail (out of memory, a bad prompt) and must not cost the result.
            adapter = self.task.save_adapter(unwrapped, run, step)
            run.event("adapter", step=step, paths={k: str(v) for k, v in adapter.items()})
            run.event("eval", step=step, loss=eval_after)
            if cfg.preview.after:
                after = self.task.preview(unwrapped, run, step)
                samples += after
                run.event("samples", step=step, paths=[str(p) for p in after])
            run.event("done", step=step, state="finished", final_loss=losses[-1] if losses else math.nan)
        return Result(run, step, adapter, samples, losses, eval_before, eval_after)

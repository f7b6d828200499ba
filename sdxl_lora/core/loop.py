"""The training loop, generic over a task (core/task.py): batches in, loss out. It knows nothing of
images or tokens.

What a user gets from `Trainer`:
  - Accelerate underneath: one code path for CPU, one GPU or many (`accelerate launch`), mixed
    precision no/fp16/bf16 ("auto": bf16 where the GPU has it), gradient accumulation;
  - the optimizer and lr schedule of the config (optim.py: AdamW, AdamW8bit, Adafactor, Lion, Prodigy, CAME,
    schedule-free AdamW; constant, linear, cosine, cosine with restarts, polynomial, each with warmup), gradient clipping;
  - a NaN/Inf guard: a step with a non-finite loss or gradient is skipped (weights unchanged), counted and
    logged; after train.max_nan_steps in a row the state is saved and the run stops, naming likely causes.
    With fused AdamW the optimizer skips the step on the device and the host reads the verdict a step
    later; with other optimizers it costs one host sync a step (train.nan_guard=false removes it);
  - a progress bar, and an events file (step, loss, lr, grad norm, throughput in the task's units
    (Task.units: images/s, tokens/s), MFU on a GPU, eta) that the UI reads; the same figures and the
    previews in TensorBoard and W&B with train.trackers. The figures are summed on the device and read back
    only at log points, so a step does not wait for the GPU;
  - an exponential moving average of the adapter (train.ema): exported, previewed and evaluated at the end;
  - training states every N steps / M minutes (atomic, checksummed, last K kept), resume to the same
    adapter bit for bit, Ctrl-C/SIGTERM finishing the step and saving before it stops;
  - the final adapter written (atomically) before anything that can still fail (final previews);
  - many processes (`accelerate launch`, docs/multigpu.md): only the adapter's gradients are averaged,
    by DDP or (train.gradient_sync, needed by CUDA graphs) by one flat all-reduce after the backward;
    the task's loader gives each process its share of every global batch (Accelerate does not re-shard
    it); the main process alone logs, previews, writes events and saves; stopping and saving are
    agreed by all processes at the same step; a state resumes on any number of processes.
Set-up reads top to bottom in the order things depend on each other:
accelerator -> seed -> task (model, data, caches) -> optimizer -> schedule -> prepare -> EMA -> resume.
The step (`Trainer._loop`) reads on one screen; its parts are the NaN guard (`NanGuard`,
core/nan_guard.py), the log window (`LogWindow`, core/log_window.py) and the small methods below it: the
optimizer step, saving and stopping, the finish.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import math
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from . import checkpoint, speed, tracking
from .config import Config
from .accel import device_type, gradient_sync, make_accelerator, world_size
from .allocator import allocator_setting
from .ema import EMA
from .log_window import LogWindow, throughput_postfix
from .nan_guard import NanGuard
from .optim import build_optimizer, evaluating, loraplus_groups, make_schedule, resumed
from .profile import StepProfiler
from .runs import Run
from .task import Task

log = logging.getLogger(__name__)

# Longer than this at a run's own pace, a run is more likely a typo (train.steps=1e9) than meant: said once,
# after the second step, while stopping costs nothing.
LONG_RUN_S = 7 * 24 * 3600


def identity_changes(saved: dict | None, now: dict) -> list[str]:
    """What differs between the identity a state was saved with and this run's (Task.identity), in words;
    nothing for a state saved before identities were kept."""
    if not saved:
        return []
    out = []
    for key in sorted(set(saved) | set(now)):
        was, is_ = saved.get(key), now.get(key)
        if was == is_:
            continue
        if isinstance(was, dict) and isinstance(is_, dict):
            changed = sorted(k for k in set(was) | set(is_) if was.get(k) != is_.get(k))
            shown = ", ".join(f"{k}: {was.get(k)} -> {is_.get(k)}" for k in changed[:3])
            out.append(f"{key}: {len(changed)} of {len(set(was) | set(is_))} entries differ ({shown}"
                       f"{', ...' if len(changed) > 3 else ''})")
        else:
            out.append(f"{key}: {was!r} -> {is_!r}")
    return out


def _eager():
    """Evaluation, validation and previews run the model's compiled regions as plain PyTorch: they see
    other shapes (and no gradients) than training, and compiling those would cost minutes for a few
    passes and leave the training regions' compiled graphs as they were."""
    return torch.compiler.set_stance("force_eager")


class _StopNow(BaseException):
    """Raised by the signal handler where the run stops at once instead of after the step: the final
    previews, where nothing is left to train. A BaseException, like KeyboardInterrupt: no task code's
    `except Exception` may swallow it."""


class _Replica(Run):
    """The run as a process other than the main one sees it: the main process writes the events."""

    def event(self, kind: str, **fields: Any) -> None:
        pass


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


# Result.interrupted of a run stopped by an out-of-memory error at a step (its state saved).
OUT_OF_MEMORY = "out of GPU memory"


class OutOfMemory(RuntimeError):
    """The GPU ran out of memory in a run of several processes; the message says what to do."""


class Trainer:
    """Trains `task` under the config `cfg` in the run folder `run` (from the training state `resume`):
    setup(), then fit()."""

    def __init__(self, cfg: Config, task: Task, run: Run, resume: Path | None = None):
        self.cfg, self.task, self.run, self.resume = cfg, task, run, resume
        self.step = self.epoch = self.position = 0  # position: batches taken in the current epoch
        self._rng_to_restore: dict | None = None
        self._stop: str | None = None
        self._stop_now = False  # a signal raises _StopNow (the final previews) instead of waiting for the step
        self._bar = None  # the training progress bar, while the loop runs

    def setup(self) -> None:
        from accelerate.utils import set_seed

        # The task settles what its config leaves to the device (train.speed="auto") before anything reads it.
        self.cfg = cfg = self.task.configure(self.cfg, device_type(self.cfg), world_size())
        self.accelerator = acc = make_accelerator(cfg)
        if not acc.is_main_process:
            # The main process speaks for the run (log, events, progress); the others keep their warnings.
            logging.getLogger().setLevel(logging.WARNING)
            self.run = _Replica(self.run.dir)
        set_seed(cfg.train.seed)
        if acc.device.type == "cuda":
            # Set at launch (allocator.prefer_expandable_segments) unless the user did: a run's memory depends on it.
            log.info("CUDA allocator: %s", allocator_setting() or "torch's defaults")
        self.task.setup(self.accelerator, self.run)
        self.optimizer = build_optimizer(cfg, self._param_groups())
        loader = self.task.dataloader()
        self.sampler = loader.batch_sampler
        self._own_shards = (hasattr(self.sampler, "skip_next")
                            and getattr(self.sampler, "num_replicas", 1) == acc.num_processes)
        self.cfg = cfg = self._in_epochs(cfg)
        # Not prepared: Accelerate's wrapper advances a schedule num_processes times a step, so its saved
        # state would mean something else on another process count. The loop steps it once per step.
        self.schedule = make_schedule(cfg, self.optimizer)
        self.flops_per_image, self.peak_tflops = self._flops_setup()
        self.flat_sync = self._flat_sync()
        # With train.gradient_sync="allreduce" the model is not prepared (no DDP wrapper, no autocast
        # patched into its forward): the loop runs its forward under acc.autocast() and averages the
        # gradients itself. Everything else is prepared as usual.
        self._autocast = acc.autocast if self.flat_sync else contextlib.nullcontext
        model = [] if self.flat_sync else [self.task.model()]
        if self._own_shards:
            if acc.state.deepspeed_plugin is not None:  # DeepSpeed reads the batch size from a prepared loader
                acc.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.train.batch_size
            *model, self.optimizer = self._prepare(*model, self.optimizer)
            self.loader = loader
        else:
            *model, self.optimizer, self.loader = self._prepare(*model, self.optimizer, loader)
        self.model = model[0] if model else self.task.model()
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        # DDP reduces the gradients of the module it wraps; a trainable weight outside it (a task's
        # extra module), or every weight with the flat sync, is averaged by the loop, or the processes'
        # copies would drift apart.
        wrapped = set() if self.flat_sync else {id(p) for p in self.model.parameters()}
        self._unsynced = [p for p in self.params if id(p) not in wrapped] if acc.num_processes > 1 else []
        if self.flat_sync:
            self._flat_collective(self.params, "broadcast")  # DDP does this at wrapping: one start for all
        # Built from the weights before any resume: _load then restores the saved averages.
        self.ema = EMA(self._trainable(), cfg.train.ema_decay) if cfg.train.ema else None
        self.trackers = (tracking.Trackers(cfg.train.trackers, self.run.dir, cfg.model_dump(mode="json"))
                         if cfg.train.trackers and self.accelerator.is_main_process else None)
        if self.resume is not None:
            self._load(self.resume)

    def _in_epochs(self, cfg: Config) -> Config:
        """train.epochs, save_every_epochs and preview.every_epochs in steps, counted as kohya does: the global
        batches of an epoch (its sampler counts them itself, or Accelerate deals whole batches to the
        processes in turn), grad_accum of them a step, a last partial step counted whole."""
        if not (cfg.train.epochs or cfg.train.save_every_epochs or cfg.preview.every_epochs):
            return cfg
        batches = len(self.sampler)
        if not self._own_shards:
            batches = math.ceil(batches / self.accelerator.num_processes)
        per_epoch = math.ceil(batches / cfg.train.grad_accum)
        out = cfg.in_epochs(per_epoch)
        log.info("%d steps an epoch (%d batches of %d, grad_accum %d): %d steps%s%s", per_epoch, batches,
                 self._global_batch(), cfg.train.grad_accum, out.train.steps,
                 f", a state saved every {out.train.save_every}" if cfg.train.save_every_epochs else "",
                 f", previews every {out.preview.every}" if cfg.preview.every_epochs else "")
        return out

    def _prepare(self, *objects) -> tuple:
        out = self.accelerator.prepare(*objects)
        return out if len(objects) > 1 else (out,)  # Accelerate returns one object bare

    def _flat_sync(self) -> bool:
        """Whether the loop averages the gradients itself (train.gradient_sync) instead of DDP."""
        from accelerate.utils import DistributedType

        acc = self.accelerator
        mode = gradient_sync(self.cfg, acc.num_processes, acc.device.type)
        if mode == "allreduce" and acc.distributed_type not in (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU):
            raise ValueError(f"train.gradient_sync='allreduce' works with plain multi-process launches (DDP "
                             f"configs), not {acc.distributed_type.value}; set train.gradient_sync='ddp' or "
                             f"use pipelines/accelerate/multi-gpu.yaml")
        return mode == "allreduce"

    def _flat_collective(self, tensors: list[torch.Tensor], op: str) -> None:
        """One collective over many tensors: packed into one flat buffer per dtype, reduced ("average") or
        sent from the main process ("broadcast"), unpacked. One NCCL call instead of one per tensor: a
        LoRA has many small tensors, and each call has a fixed host cost."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            if op == "average":
                torch.distributed.all_reduce(flat)
                flat /= self.accelerator.num_processes
            else:
                torch.distributed.broadcast(flat, src=0)
            with torch.no_grad():
                torch._foreach_copy_(group, [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in group]), group)])

    def _flops_setup(self) -> tuple[float | None, float | None]:
        """FLOPs per image of a training step and the GPU's peak TFLOP/s, for MFU; (None, None) off a GPU.

        The task counts them where it can without the device (Task.flops_per_sample: sdxl on the meta device);
        otherwise torch's FlopCounterMode counts one forward on one batch (no grad, RNG forked, before training).
        A step is counted as 2x that: the backward through a frozen base computes input gradients only
        (about one forward), not weight gradients; the adapter's own are negligible. Recomputation under
        gradient checkpointing is not counted (it is not model work), as MFU conventionally does."""
        acc = self.accelerator
        if acc.device.type != "cuda":
            return None, None
        name = torch.cuda.get_device_name(acc.device)
        peak = tracking.peak_tflops(name, self.cfg.train.peak_tflops)
        if peak is None:
            log.info("MFU not shown: %r is not in the peak table; set train.peak_tflops to its dense bf16 TFLOP/s",
                     name)
            return None, None
        from accelerate.utils import send_to_device

        with torch.random.fork_rng(devices=[acc.device]):  # a loader's iterator draws from the RNG as it starts
            batch = next(iter(self.task.dataloader()))
            per_image, how = self.task.flops_per_sample(batch), "counted on the meta device"
            if per_image is None:
                model = self.task.model()
                # Eager: compiled regions (train.compile) would otherwise compile under the counter, for nothing.
                with torch.no_grad(), _eager():
                    batch = send_to_device(batch, acc.device)

                    def forward():
                        with acc.autocast():
                            self.task.loss(model, batch)
                    per_image = 2 * tracking.count_flops(forward) / self.task.batch_size(batch)
                how = "2x a measured forward"
        log.info("MFU: %.3g GFLOP per image per step (%s), peak %g TFLOP/s (%s)", per_image / 1e9, how, peak, name)
        return per_image, peak

    def _param_groups(self) -> list[dict]:
        """The task's parameter groups, with train.loraplus_ratio's B tensors split off at their own lr."""
        tc = self.cfg.train
        return loraplus_groups(self.task.param_groups(), self.task.model(), tc.loraplus_ratio, tc.lr)

    # ---- training state ----
    def _trainable(self) -> dict[str, torch.nn.Parameter]:
        model = self.accelerator.unwrap_model(self.model)
        return {n: p for n, p in model.named_parameters() if p.requires_grad}

    def _save(self) -> Path:
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if self.accelerator.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.accelerator.device)
        # position counts global batches of global_batch images: a resume on another process count
        # converts it (_load).
        trainer_state = {"step": self.step, "epoch": self.epoch, "position": self.position,
                         "global_batch": self._global_batch(),
                         "schedule": self.schedule.state_dict(), "rng": rng}
        if self.ema is not None:
            trainer_state["ema"] = self.ema.state_dict()
        trainer_state["identity"] = self.task.identity()
        with evaluating(self.optimizer, self.cfg.train.optimizer):  # schedule-free: its average, exportable
            path = checkpoint.save_state(self.run.checkpoints_dir, self.step, self._trainable(),
                                         self.optimizer.state_dict(), trainer_state, self.cfg.train.keep_checkpoints)
        self.run.event("checkpoint", step=self.step, path=str(path))
        return path

    def _rebuild_optimizer(self) -> None:
        """After the task replaced trainable parameters (a rank schedule step): a new optimizer over them,
        the schedule continuing where it was. Moments of the replaced parameters restart from zero, and
        the EMA (train.ema) restarts from the new weights."""
        sched_state = self.schedule.state_dict()
        self.optimizer = self.accelerator.prepare_optimizer(build_optimizer(self.cfg, self._param_groups()))
        self.schedule = make_schedule(self.cfg, self.optimizer)
        self.schedule.load_state_dict(sched_state)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.ema is not None:
            self.ema = EMA(self._trainable(), self.cfg.train.ema_decay)

    def _load(self, state: Path) -> None:
        adapter, opt_state, tr = checkpoint.load_state(state)
        changes = identity_changes(tr.get("identity"), self.task.identity())
        if changes:
            raise checkpoint.CheckpointError(
                f"{state} was saved by a run of another model, adapter plan or dataset than this config gives:\n"
                + "".join(f"  - {c}\n" for c in changes)
                + f"Undo the change (the run's settings are in {self.run.dir / 'config.toml'}) to resume, or "
                "start a new run with the new settings (`sdxl-lora export` writes this state's adapter out). "
                "Steps, the learning rate and its schedule, batch size, logging, saving and previews may change "
                "on resume.")
        if self.task.restore_step(tr["step"], self.accelerator.unwrap_model(self.model)):
            self._rebuild_optimizer()
        params = self._trainable()
        shapes = [n for n in adapter.keys() & params.keys() if adapter[n].shape != params[n].shape]
        if adapter.keys() != params.keys() or shapes:
            raise checkpoint.CheckpointError(
                f"{state}: its adapter does not match this run's plan ({len(adapter)} tensors saved, "
                f"{len(params)} expected{f'; {len(shapes)} of another shape, e.g. {sorted(shapes)[0]}' if shapes else ''}); "
                "resume with the run's own config")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(adapter[name])
        self.optimizer.load_state_dict(opt_state)
        resumed(self.optimizer, self.cfg.train.optimizer)
        self.schedule.load_state_dict(tr["schedule"])
        if self.ema is not None:
            if "ema" not in tr:
                raise checkpoint.CheckpointError(f"{state} has no EMA weights (it was saved with train.ema off); "
                                                 "resume with train.ema=false, or start a new run")
            self.ema.load_state_dict(tr["ema"])
        self.step, self.epoch, self.position = tr["step"], tr["epoch"], tr["position"]
        saved, now = tr.get("global_batch", self.cfg.train.batch_size), self._global_batch()
        if saved != now and self.position:
            # Another global batch cuts the epoch into other batches: continue after about as many
            # images; the rest of this epoch may repeat or miss a few, and the next epoch is whole again.
            self.position = round(self.position * saved / now)
            log.warning("resuming with a global batch of %d images (the state was saved with %d): this epoch "
                        "continues after about %d images (batch %d of it); the global batch is train.batch_size "
                        "x processes, so the same global batch resumes exactly", now, saved,
                        self.position * now, self.position)
        # Restored once the epoch's loader iterator exists (creating one draws from the RNG).
        self._rng_to_restore = tr["rng"]
        log.info("resumed from %s at step %d", state, self.step)
        self.run.event("resume", step=self.step, path=str(state))

    def _restore_rng(self) -> None:
        rng, self._rng_to_restore = self._rng_to_restore, None
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        dev = self.accelerator.device
        if "cuda" in rng and dev.type == "cuda":
            cuda = rng["cuda"]
            if isinstance(cuda, list):  # saved by an older version: one state per visible GPU
                cuda = cuda[dev.index or 0] if (dev.index or 0) < len(cuda) else None
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, dev)

    def _global_batch(self) -> int:
        return self.cfg.train.batch_size * self.accelerator.num_processes

    def _set_epoch(self, epoch: int) -> None:
        """A new order each epoch, decided by (seed, epoch) alone: the sampler and dataset are told."""
        if not self._own_shards:
            self.loader.set_epoch(epoch)  # Accelerate's loader: its own count, and what it forwards
        # Told directly as well: a batch sampler that Accelerate wrapped for several processes is not reached.
        for part in (self.sampler, getattr(self.loader, "dataset", None)):
            if hasattr(part, "set_epoch"):
                part.set_epoch(epoch)

    def _batches(self):
        while True:
            from accelerate.utils import send_to_device

            self._set_epoch(self.epoch)
            loader = self.loader
            if self.position and self._own_shards:
                self.sampler.skip_next(self.position)
            elif self.position:
                loader = self.accelerator.skip_first_batches(self.loader, self.position)
            for batch in loader:
                if self._own_shards:
                    # A task's host_keys stay on the CPU (the SDXL task's per-sample RNG keys: reading them
                    # from the GPU would be a host sync every step).
                    batch = send_to_device(batch, self.accelerator.device, non_blocking=True,
                                           skip_keys=list(self.task.host_keys) or None)
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

    def _average_unsynced(self) -> None:
        for p in self._unsynced:
            if p.grad is None:  # unused in this process's batch: a zero contribution, so all sizes agree
                p.grad = torch.zeros_like(p)
        self._flat_collective([p.grad for p in self._unsynced], "average")

    def _agree(self, stop: str | None, due: bool) -> tuple[str | None, bool]:
        """Stop and save at the same step on every process: a signal can reach them a step apart, and a
        timed save is due by each one's clock. A collective saved by one process and not another would
        hang the run. One small all-reduce a step, with several processes only."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return stop, due
        flags = acc.reduce(torch.tensor([float(stop is not None), float(due)], device=acc.device), "sum")
        any_stop, any_due = (bool(v) for v in (flags > 0).tolist())
        return (stop or "SIGTERM") if any_stop else None, any_due

    def _check_in(self, model, step: int) -> list[Path]:
        """Previews and the validation loss at this step. The RNG is forked so the run goes on exactly
        as without them (resume stays bit-exact)."""
        paths: list[Path] = []
        with torch.random.fork_rng(devices=[self.accelerator.device] if self.accelerator.device.type == "cuda" else []), \
                self._averaged(), _eager():
            if self.accelerator.is_main_process:  # the others wait for it at the next step's collective
                val = self.task.validate(model)
                if val is not None:
                    self.run.event("validation", step=step, loss=val)
                paths = self.task.preview(model, self.run, step)
                if paths:
                    self.run.event("samples", step=step, paths=[str(p) for p in paths])
                self._track(step, validation=val, samples=paths)
        return paths

    def _asked(self, step: int, model, samples: list[Path]) -> bool:
        """What was asked of the run from outside since the last step (core/runs.py: REQUESTS, the UI's Sample now
        and Save now): previews at this step, added to `samples`; returns whether a save was asked (the processes
        agree on it with the due saves). The main process takes the requests."""
        if not self.accelerator.is_main_process or self.step >= self.cfg.train.steps:
            return False
        if self.run.take_request("sample"):
            self.run.event("asked", step=step, what="sample")
            samples += self._check_in(model, step)
        return self.run.take_request("save")

    def _averaged(self):
        """The weights to evaluate, preview and export in the model for the block: a schedule-free optimizer's
        average, and the EMA's with train.ema."""
        stack = contextlib.ExitStack()
        stack.enter_context(evaluating(self.optimizer, self.cfg.train.optimizer))
        if self.ema is not None:
            stack.enter_context(self.ema.applied())
        return stack

    def _track(self, step: int, *, samples: list[Path] = (), validation: float | None = None, **scalars) -> None:
        if self.trackers is None:
            return
        self.trackers.scalars(step, **scalars, **{"loss/validation": validation})
        if samples:
            self.trackers.images(step, list(samples))
        self.trackers.flush()

    def _on_signal(self, signum, frame) -> None:
        if self._stop is not None:
            raise KeyboardInterrupt  # second Ctrl-C: stop now; the last saved state is intact
        self._stop = signal.Signals(signum).name
        if self._stop_now:
            raise _StopNow(self._stop)
        log.warning("%s received: finishing this step and saving the state (press Ctrl-C again to stop at once)",
                    self._stop)

    def fit(self) -> Result:
        cfg, acc, run = self.cfg, self.accelerator, self.run
        total = cfg.train.steps
        unwrapped = acc.unwrap_model(self.model)
        samples: list[Path] = []
        if cfg.preview.before and acc.is_main_process and self.step == 0:
            checkpoint.test_fault("preview", 0)
            with _eager():
                samples += self.task.preview(unwrapped, run, 0)
            run.event("samples", step=0, paths=[str(p) for p in samples])
            self._track(0, samples=samples)

        if self.step == 0:
            # Measured by the main process alone, whose figures the run reports.
            if acc.is_main_process:
                run.phase("evaluating", 0)
            with _eager():
                eval_before = self.task.evaluate_before(unwrapped) if acc.is_main_process else math.nan
                val = self.task.validate(unwrapped) if acc.is_main_process else None
            run.event("eval", step=0, loss=eval_before)
            if val is not None:
                run.event("validation", step=0, loss=val)
            self._track(0, validation=val, **{"loss/eval": eval_before})
        else:  # resumed: the run's own starting figure
            eval_before = next((e["loss"] for e in run.events() if e["event"] == "eval"), math.nan)
        sync = gradient_sync(cfg, acc.num_processes, acc.device.type)
        run.event("start", step=self.step, total_steps=total, state="training", processes=acc.num_processes,
                  **({"gradient_sync": sync} if sync else {}))
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._loop(samples, eval_before)
        finally:
            if self._bar is not None:  # ended by an error (a full disk): its message starts a line of its own
                self._bar.close()
            for s, h in handlers.items():
                signal.signal(s, h)
            if self.trackers is not None:
                self.trackers.close()

    def _loop(self, samples: list[Path], eval_before: float) -> Result:
        """The training step: batches -> loss -> backward -> clip -> guard -> optimizer; log, check in, save."""
        cfg, acc, run = self.cfg, self.accelerator, self.run
        total = cfg.train.steps
        unwrapped = acc.unwrap_model(self.model)
        bar = self._bar = tqdm(total=total, initial=self.step, desc="training", unit="step",
                               disable=not acc.is_main_process, dynamic_ncols=True)
        losses: list[float] = []
        window = LogWindow(acc, self.step, total)
        guard = NanGuard(cfg, acc, run, self.optimizer, ema=self.ema is not None)
        batches = self._batches()
        profiler = self._profiler()
        if cfg.train.compile != "none":  # the first step waits for the compiler: the bar says so until it is done
            bar.set_description("compiling")
        self._t_saved, self._last_state = time.perf_counter(), None
        self.model.train()
        step, first = self.step, self.step + 1
        while step < total:
            try:
                skip = self._train_step(step, batches, window, guard, profiler)
            except torch.OutOfMemoryError as e:
                oom = str(e).splitlines()[0] if str(e) else "CUDA out of memory"
            else:
                oom = None
            if oom is not None:  # outside the handler: its traceback no longer holds the step's tensors
                bar.close()
                return self._out_of_memory(step, oom, samples, losses, eval_before)
            step = self.step = step + 1
            bar.update(1)
            self._check_pace(step, first)
            if self.task.on_step(step, unwrapped):
                self._rebuild_optimizer()
            if (trace := profiler.after_step(step, last=step == total)) is not None and acc.is_main_process:
                run.event("profile", step=step, path=str(trace), summary=profiler.summary)
            guard.after_step(step, skip)
            if step == first and cfg.train.compile != "none":
                bar.set_description("training")
                if not speed.warn_if_nothing_compiled(run if acc.is_main_process else None):
                    self.task.compiled()
            # The session's first step is logged too: it ends the set-up (compilation, graph capture), and
            # whoever watches the run sees it start.
            logged = step % cfg.train.log_every == 0 or step == total or step == first
            due = self._save_due(step)
            if logged:
                losses.append(self._log(step, window, bar))
            elif acc.is_main_process:  # the step, eta, a recent loss and the pace for a watcher; never waits
                run.progress(step, total, window.eta(step), **window.peek(step))
            if cfg.preview.every and step % cfg.preview.every == 0 and step < total:
                samples += self._check_in(unwrapped, step)
            due |= self._asked(step, unwrapped, samples)
            if stop := self._save_or_stop(step, due, guard, read_now=logged):
                bar.close()
                return self._stopped(step, stop, guard.message, samples, losses, eval_before)
        bar.close()
        return self._finish(step, samples, losses, eval_before)

    def _check_pace(self, step: int, first: int) -> None:
        """After this session's second step: where the steps left take longer than LONG_RUN_S at its pace (the
        first step's set-up, compilation and graph capture left out), a warning naming train.steps."""
        if step == first:
            self._first_done = time.perf_counter()
            return
        if step != first + 1 or not self.accelerator.is_main_process:
            return
        pace = time.perf_counter() - self._first_done
        left = pace * (self.cfg.train.steps - step)
        if left > LONG_RUN_S:
            days = left / 86400
            said = f"{days / 365.25:.1f} years" if days > 365.25 else f"{days:.0f} days"
            log.warning("train.steps=%d: at this run's pace (%.2f s a step) the %d steps left take about %s. If that "
                        "is not meant, stop it (Ctrl-C; the state is saved) and train with fewer steps (--steps N, "
                        "or train.steps in the config)", self.cfg.train.steps, pace, self.cfg.train.steps - step, said)

    # ---- the step's pieces, in the order the step runs them ----
    def _train_step(self, step: int, batches, window: LogWindow, guard: NanGuard, profiler: StepProfiler) -> bool:
        """Step `step` + 1: its micro-batches' forward and backward, the gradients clipped and guarded, the
        optimizer step. Returns whether the guard skipped the update."""
        cfg, acc = self.cfg, self.accelerator
        clip = cfg.train.max_grad_norm
        checkpoint.oom_fault(step + 1)
        bad = torch.zeros((), dtype=torch.bool, device=acc.device)  # a non-finite loss in a micro-batch
        skip = False
        profiler.before_step(step)
        for _ in range(cfg.train.grad_accum):
            with profiler.phase("data"):
                batch = next(batches)
            with acc.accumulate(self.model):
                loss = None
                for part, share in self.task.split(batch):  # one part unless the task's step needs more
                    with profiler.phase("forward"), self._autocast():
                        part_loss = checkpoint.nan_fault(self.task.loss(self.model, part), step + 1,
                                                         acc.process_index)
                        if share != 1.0:
                            part_loss = part_loss * share
                    with profiler.phase("backward"):
                        acc.backward(part_loss)
                    loss = part_loss.detach() if loss is None else loss + part_loss.detach()
                    # Nothing of this part's autograd graph may outlive its backward: a CUDA graph
                    # captured at the next forward (a micro-batch's size, captured after an eager step)
                    # fails while older graph nodes, made outside the capture, are still alive.
                    del part_loss
                if self._unsynced and acc.sync_gradients:
                    with profiler.phase("backward"):
                        self._average_unsynced()
                checkpoint.test_fault("step", step + 1)
                finite = torch.isfinite(loss)  # the parts' detached sum
                bad = bad | ~finite
                if acc.sync_gradients and (clip > 0 or guard.on):
                    norm = self._clip_gradients()
                    window.add_norm(norm)
                    skip = guard.after_backward(bad, norm, step + 1, self.optimizer)
                with profiler.phase("optimizer"):
                    self._optimizer_step(skip)
            window.add_step_loss(loss)
            window.add_loss(loss, finite, self.task.batch_size(batch) * acc.num_processes,
                            {k: n * acc.num_processes for k, n in self.task.units(batch).items()})
        return skip

    def _profiler(self) -> StepProfiler:
        """train.profile_steps: two warm-up steps first where the run is long enough (the first steps
        allocate and compile)."""
        cfg, acc = self.cfg, self.accelerator
        skip = self.step + min(2, max(0, cfg.train.steps - self.step - cfg.train.profile_steps))
        return StepProfiler(self.run.dir / "profile" if acc.is_main_process else None, cfg.train.profile_steps,
                            skip=skip, device=acc.device, allocations=cfg.train.compile == "none")

    def _clip_gradients(self) -> torch.Tensor | None:
        """The gradient norm before clipping, the gradients clipped to train.max_grad_norm. With clipping off
        the guard still needs the norm: clipping at infinity scales by 1.0. None where the backend gives none."""
        clip, acc = self.cfg.train.max_grad_norm, self.accelerator
        norm = acc.clip_grad_norm_(self.params, clip if clip > 0 else math.inf)
        return None if norm is None else torch.as_tensor(norm, device=acc.device).float()

    def _optimizer_step(self, skip: bool) -> None:
        """The optimizer step unless the guard skips it, the EMA after it, the schedule, gradients dropped.
        Within gradient accumulation, Accelerate's optimizer steps at the last micro-batch only."""
        acc = self.accelerator
        if not skip:
            self.optimizer.step()
            if self.ema is not None and acc.sync_gradients and not acc.optimizer_step_was_skipped:
                self.ema.update()
        if acc.sync_gradients and not acc.optimizer_step_was_skipped:
            self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _log(self, step: int, window: LogWindow, bar) -> float:
        """A log point: the window's figures in the progress bar, the events file and TensorBoard. Returns
        the mean loss."""
        acc = self.accelerator
        mean, sps, rates, grad_norm, eta = window.flush(step)
        lr = self.schedule.get_last_lr()[0]
        extra = {} if grad_norm is None else {"grad_norm": round(grad_norm, 6)}
        if self.flops_per_image:
            extra["mfu"] = round(tracking.mfu(self.flops_per_image, sps, self.peak_tflops, acc.num_processes), 4)
        if acc.device.type == "cuda":
            # What torch's allocator holds now and at most so far (its own counters: no device sync); the
            # CUDA context comes on top.
            extra["gpu_mem_gib"] = round(torch.cuda.memory_reserved(acc.device) / 2**30, 2)
            extra["gpu_peak_gib"] = round(torch.cuda.max_memory_reserved(acc.device) / 2**30, 2)
        bar.set_postfix(loss=f"{mean:.4f}", lr=f"{lr:.2e}", **throughput_postfix(rates, self.task.unit_labels),
                        **({"mfu": f"{100 * extra['mfu']:.1f}%"} if "mfu" in extra else {}))
        per_s = {f"{name}_per_s": v for name, v in rates.items()}
        if acc.is_main_process:
            self.run.event("step", step=step, total_steps=self.cfg.train.steps, loss=mean, lr=lr,
                           **{k: round(v, 3) for k, v in per_s.items()}, eta_s=round(eta, 1), state="training",
                           **extra)
            self._track(step, **{"loss/train": mean, "lr": lr, "grad_norm": grad_norm, **per_s,
                                 "mfu": extra.get("mfu")})
        return mean

    def _save_due(self, step: int) -> bool:
        """Whether a state is due at `step` by train.save_every (steps) or save_every_minutes (this process's
        clock: the processes agree on it in _save_or_stop)."""
        tc = self.cfg.train
        return bool((tc.save_every and step % tc.save_every == 0) or (
            tc.save_every_minutes and time.perf_counter() - self._t_saved >= 60 * tc.save_every_minutes))

    def _save_or_stop(self, step: int, due: bool, guard: NanGuard, read_now: bool) -> str | None:
        """Save the state when due or stopping, at the same step on every process. Returns why the run
        stops (a signal's name, or "nan_guard"), or None. read_now: the host reads the device at this step
        anyway (a log point), so it reads the guard's pending verdict too."""
        acc = self.accelerator
        stop, due = self._agree(self._stop, due)
        if read_now or due or stop or guard.message:
            # Decided from what every process agrees on, so all of them stop at the same step.
            guard.settle()
        stop = stop or ("nan_guard" if guard.message else None)
        if stop or (due and step < self.cfg.train.steps):
            if acc.is_main_process:
                self._last_state = self._save()
            acc.wait_for_everyone()
            self._t_saved = time.perf_counter()
        return stop

    def _stopped(self, step: int, stop: str, message: str | None, samples: list[Path], losses: list[float],
                 eval_before: float) -> Result:
        """The run stopped early (a signal, or the NaN guard), its state saved: no final previews, and no
        adapter unless the stop came after the export (the message says so)."""
        state = self._last_state
        if self.accelerator.is_main_process:
            self.run.event("interrupted", step=step, signal=stop, state="interrupted", path=str(state),
                           **({"message": message} if message else {}))
        return Result(self.run, step, {}, samples, losses, eval_before, interrupted=stop, state=state,
                      message=message)

    def _out_of_memory(self, step: int, error: str, samples: list[Path], losses: list[float],
                       eval_before: float) -> Result:
        """The GPU ran out of memory in step `step` + 1 (the plan's estimate was low, or another process took
        memory): the state of step `step` saved (the failed step changed no weight) and the run stopped with
        what to do, instead of a traceback. Several processes cannot agree on a save one of them cannot reach:
        there the error is raised with the same advice."""
        acc = self.accelerator
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if acc.device.type == "cuda":
            torch.cuda.empty_cache()
        held = ""
        if acc.device.type == "cuda":
            total = torch.cuda.get_device_properties(acc.device).total_memory
            held = (f"; torch held {torch.cuda.max_memory_reserved(acc.device) / 2**30:.1f} GiB at most, of the "
                    f"GPU's {total / 2**30:.1f}")
        advice = ("Resume with less memory a step: add --set train.gradient_checkpointing=true (or a smaller "
                  "--batch-size, or --vram with less than the card has) to the resume command; a run that shares "
                  "its GPU with another program needs that program's memory left free")
        message = f"the GPU ran out of memory in step {step + 1} ({error}{held}). {advice}"
        log.error("the GPU ran out of memory in step %d: %s", step + 1, error)
        if acc.num_processes > 1:
            raise OutOfMemory(message)
        self._last_state = self._save()
        return self._stopped(step, OUT_OF_MEMORY, message, samples, losses, eval_before)

    def _finish(self, step: int, samples: list[Path], losses: list[float], eval_before: float) -> Result:
        """The run's end: the final evaluation, the adapter written, then the final previews and the done event.
        A signal here stops the run with its state saved: at once during the previews, after the export (it
        is atomic and short) before them; the resume then only finishes (export, previews, done)."""
        cfg, acc, run = self.cfg, self.accelerator, self.run
        unwrapped = acc.unwrap_model(self.model)
        self.task.end_training()
        acc.wait_for_everyone()
        adapter: dict[str, Path] = {}
        try:
            with self._averaged(), _eager():  # with train.ema: the averaged weights are evaluated, saved, previewed
                if acc.is_main_process:
                    run.phase("evaluating", step)
                eval_after = self.task.evaluate(unwrapped) if acc.is_main_process else math.nan
                val_after = self.task.validate(unwrapped) if acc.is_main_process else None
                if acc.is_main_process:
                    # The adapter first: previews can still fail (out of memory, a bad prompt) and must not cost the result.
                    checkpoint.test_fault("export", step)
                    adapter = self.task.save_adapter(unwrapped, run, step)
                    run.event("adapter", step=step, paths={k: str(v) for k, v in adapter.items()},
                              **({"ema_decay": cfg.train.ema_decay} if self.ema is not None else {}))
                    run.event("eval", step=step, loss=eval_after)
                    if val_after is not None:
                        run.event("validation", step=step, loss=val_after)
                    self._stop_now = True
                    if self._stop is not None:  # signalled during the evaluation or the export
                        raise _StopNow(self._stop)
                    checkpoint.test_fault("preview", step)
                    after: list[Path] = []
                    if cfg.preview.after:
                        after = self.task.preview(unwrapped, run, step)
                        samples += after
                        run.event("samples", step=step, paths=[str(p) for p in after])
                    self._stop_now = False
                    self._track(step, validation=val_after, samples=after, **{"loss/eval": eval_after})
                    run.event("done", step=step, state="finished", final_loss=losses[-1] if losses else math.nan)
        except _StopNow as stop:
            self._stop_now = False
            # Saved outside the EMA swap: the state holds the trained weights (and the averages beside them).
            self._last_state = self._save()
            written = ", ".join(str(p) for p in adapter.values())
            return self._stopped(step, str(stop), f"the adapter is written ({written}); the final previews are not: "
                                 "resume to render them and finish the run", samples, losses, eval_before)
        return Result(run, step, adapter, samples, losses, eval_before, eval_after, state=self._last_state)

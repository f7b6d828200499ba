"""Optimizers and learning-rate schedules from the config: one builder each, a dispatch on the name.

  adamw       torch's AdamW: the safe default.
  adamw8bit   bitsandbytes' 8-bit AdamW: the same updates with a quarter of the optimizer memory.
  paged_adamw8bit, paged_adamw
              bitsandbytes' paged AdamW (8-bit / 32-bit state): the state lives in CUDA unified memory
              that is paged out to the host when the GPU runs short, instead of failing.
  adafactor   transformers' Adafactor at a fixed learning rate (no relative step): factored second
              moments, the least memory.
  lion        bitsandbytes' Lion: sign updates, one moment; wants a 3-10x smaller lr than AdamW.
  prodigy     prodigyopt's Prodigy: estimates the step size itself; set train.lr=1.0.
  adamw_schedulefree
              schedulefree's AdamWScheduleFree: no decaying schedule; it trains at one point and averages
              another, which is what evaluation, previews, exports and states hold (`evaluating`).
  came        pytorch-optimizer's CAME: Adafactor's factored second moments with a confidence-guided update,
              about half AdamW's optimizer memory.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging

import torch

from .config import Config, MissingPackage

log = logging.getLogger(__name__)


def _bitsandbytes(name: str):
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError(f"train.optimizer={name!r} needs bitsandbytes, which is not installed; "
                          "install the qlora extra (pip install 'sdxl_lora[qlora]') or choose optimizer='adamw'")
    import bitsandbytes

    return bitsandbytes.optim


# Optimizers whose parameters hold the training point (y) in train mode and the average (x) in eval mode.
SCHEDULE_FREE = ("adamw_schedulefree",)


def _package(name: str, module: str, extra: str):
    if importlib.util.find_spec(module) is None:
        raise MissingPackage(f"train.optimizer={name!r} needs the {module} package, which is not installed: "
                             f"pip install 'sdxl_lora[{extra}]', or choose optimizer='adamw'")
    return importlib.import_module(module)


@contextlib.contextmanager
def evaluating(optimizer, name: str):
    """Within the block a schedule-free optimizer's parameters hold its average (x), the weights to evaluate,
    preview, export and save; outside it, the point it trains at (y). A state is saved in eval mode and the
    resume calls train() (`resumed`) as the uninterrupted run does after the save, so both continue from the
    same bits. Other optimizers: nothing."""
    if name not in SCHEDULE_FREE:
        yield
        return
    optimizer.eval()
    try:
        yield
    finally:
        optimizer.train()


def resumed(optimizer, name: str) -> None:
    """After a saved optimizer state is loaded: a schedule-free one back in train mode (`evaluating`)."""
    if name in SCHEDULE_FREE:
        optimizer.train()


def loraplus_groups(param_groups: list[dict], model: torch.nn.Module, ratio: float | None, lr: float) -> list[dict]:
    """train.loraplus_ratio (LoRA+): each group split in two, its B tensors at `ratio` times the group's lr
    (`lr` where the group sets none). B is peft's rule (peft/optimizers/loraplus.py: lora_B and the 1-D
    tensors, LoRA-Bias's and DoRA's magnitudes), with a convolution's DoRA magnitude (4-D in peft) counted as
    the Linear's is. Without a ratio the groups are returned as they are."""
    if not ratio:
        return param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for g in param_groups:
        b = [p for p in g["params"] if p.ndim == 1 or any(k in names.get(id(p), "") for k in
                                                          ("lora_B", "lora_magnitude_vector"))]
        a = [p for p in g["params"] if not any(p is q for q in b)]
        name = g.get("name", "adapter")
        for params, mult, tag in ((a, 1.0, "A"), (b, ratio, "B")):
            if params:
                out.append({**g, "params": params, "name": f"{name} {tag}", "lr": g.get("lr", lr) * mult})
    log.info("train.loraplus_ratio=%g: %s", ratio, ", ".join(f"{g['name']} lr {g['lr']:.3g} ({len(g['params'])} "
                                                              "tensors)" for g in out))
    return out


def build_optimizer(cfg: Config, param_groups: list[dict]) -> torch.optim.Optimizer:
    tc = cfg.train
    name, lr, wd = tc.optimizer, tc.lr, tc.weight_decay
    if name == "adamw":
        # The fused kernel (CUDA and CPU): one launch for every parameter instead of several per tensor, and it
        # skips a step on the device when told to (found_inf), which the NaN guard uses to avoid a host sync.
        fused = all(p.device.type in ("cuda", "cpu") for g in param_groups for p in g["params"])
        return torch.optim.AdamW(param_groups, lr=lr, weight_decay=wd, fused=fused or None)
    if name == "adamw8bit":
        return _bitsandbytes(name).AdamW8bit(param_groups, lr=lr, weight_decay=wd)
    if name == "paged_adamw8bit":
        return _bitsandbytes(name).PagedAdamW8bit(param_groups, lr=lr, weight_decay=wd)
    if name == "paged_adamw":
        return _bitsandbytes(name).PagedAdamW(param_groups, lr=lr, weight_decay=wd)
    if name == "lion":
        return _bitsandbytes(name).Lion(param_groups, lr=lr, weight_decay=wd)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        # A fixed lr, so the schedule and warmup apply as with the other optimizers.
        return Adafactor(param_groups, lr=lr, weight_decay=wd, relative_step=False, scale_parameter=False,
                         warmup_init=False)
    if name == "prodigy":
        if importlib.util.find_spec("prodigyopt") is None:
            raise ImportError("train.optimizer='prodigy' needs the prodigyopt package, which is not installed; "
                              "pip install prodigyopt, or choose another optimizer")
        from prodigyopt import Prodigy

        return Prodigy(param_groups, lr=lr, weight_decay=wd)
    if name == "adamw_schedulefree":
        sf = _package(name, "schedulefree", "schedulefree")
        if tc.scheduler != "constant":
            log.warning("train.optimizer='adamw_schedulefree' needs no decaying schedule (it averages instead); "
                        "train.scheduler=%r still scales its lr", tc.scheduler)
        opt = sf.AdamWScheduleFree(param_groups, lr=lr, weight_decay=wd)
        opt.train()  # it refuses to step in eval mode, where it starts
        return opt
    if name == "came":
        # weight_decay as AdamW's: decoupled from the gradient.
        return _package(name, "pytorch_optimizer", "came").CAME(param_groups, lr=lr, weight_decay=wd,
                                                                  weight_decouple=True)
    raise ValueError(f"train.optimizer={name!r} is not one of adamw, adamw8bit, paged_adamw8bit, "
                     "paged_adamw, adafactor, lion, prodigy, adamw_schedulefree, came")


def make_schedule(cfg: Config, optimizer, num_processes: int = 1):
    """The lr schedule (transformers' helpers, which diffusers' copy), every kind with linear warmup over
    train.warmup_steps."""
    from transformers.optimization import get_scheduler

    tc = cfg.train
    name = tc.scheduler
    if name == "constant" and tc.warmup_steps:
        name = "constant_with_warmup"
    specific = {"cosine_with_restarts": {"num_cycles": tc.scheduler_cycles},
                "polynomial": {"power": tc.scheduler_power}}.get(name)
    # Accelerate's prepared scheduler advances num_processes times per optimizer step, so the
    # schedule is laid out in those units to keep warmup and decay in optimizer steps.
    return get_scheduler(name, optimizer, num_warmup_steps=tc.warmup_steps * num_processes,
                         num_training_steps=tc.steps * num_processes, scheduler_specific_kwargs=specific)

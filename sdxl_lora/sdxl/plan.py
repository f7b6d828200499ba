"""What a config will train on the SDXL UNet, before it trains: the adapter plan and the memory estimate.
The one path the CLI's `plan`, the UI's Train form and the training task all take, so they agree."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..core.config import Config
from ..core.inject import Plan
from .memory import MemoryEstimate, estimate_for_config
from .slots import make_plan


@dataclass
class UNetPlan:
    plan: Plan
    memory: MemoryEstimate
    resolution: int   # the side of the square the ranks were scaled to and the estimate is for
    native: int       # the model's own resolution


def plan_unet(cfg: Config, unet: nn.Module, native: int, resolution: int | None = None,
              mixed_precision: str | None = None) -> UNetPlan:
    """The plan and estimate for `unet` (any device, meta included) whose native resolution is `native`.
    `resolution`: the largest batch's side (a run: the square of its largest bucket's area); none means
    data.resolution, else the native one. `mixed_precision`: what the run resolved; none reads
    train.mixed_precision, taking "auto" as bf16 (a GPU run)."""
    resolution = resolution or cfg.data.resolution or native
    plan = make_plan(unet, cfg.adapter, resolution=resolution, native=native)
    latent_factor = native // int(unet.config.sample_size)
    memory = estimate_for_config(unet, cfg, plan.trainable_params, resolution, mixed_precision, latent_factor)
    return UNetPlan(plan, memory, resolution, native)


def plan_config(cfg: Config) -> UNetPlan:
    """The plan and estimate from the model's config alone: its UNet on the meta device, no weights read."""
    from .model import unet_skeleton

    unet, native = unet_skeleton(cfg.model)
    return plan_unet(cfg, unet, native)

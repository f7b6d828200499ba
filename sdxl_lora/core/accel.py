"""The Accelerator a run trains under, and how its processes average gradients: the parts of the loop's
set-up that a task may need to know (the SDXL task sets CUDA graphs up differently under the flat sync)."""
from __future__ import annotations

import os

import torch

from .config import Config


def indexed(device: torch.device | str) -> torch.device:
    """`device` with its index: torch.device("cuda") names the current CUDA device, and compares unequal to the
    "cuda:N" that tensors on it report."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_mixed_precision(cfg: Config, device_type: str) -> str:
    mp = cfg.train.mixed_precision
    if mp != "auto":
        return mp
    if device_type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def gradient_sync(cfg: Config, num_processes: int, device_type: str) -> str | None:
    """How several processes average gradients: "ddp" or "allreduce" (train.gradient_sync); None for one."""
    if num_processes == 1:
        return None
    mode = cfg.train.gradient_sync
    if mode == "auto":
        return "allreduce" if cfg.train.cuda_graphs and device_type == "cuda" else "ddp"
    return mode


def device_type(cfg: Config) -> str:
    """"cuda" or "cpu": what train.device means on this machine (the Accelerator's choice, known before it)."""
    dev = cfg.train.device
    if dev == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device='cuda' but no CUDA GPU is visible; use --device cpu")
    return "cpu" if dev == "cpu" or (dev == "auto" and not torch.cuda.is_available()) else "cuda"


def world_size() -> int:
    """The number of processes the launcher started (accelerate launch, torchrun), known before the Accelerator."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_device_index() -> int:
    """The GPU this process trains on, known before the Accelerator: its local rank under a launcher."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def make_accelerator(cfg: Config):
    from accelerate import Accelerator

    cpu = device_type(cfg) == "cpu"
    mp = resolve_mixed_precision(cfg, "cpu" if cpu else "cuda")
    handlers = []
    if cfg.train.cuda_graphs:
        from accelerate.utils import AutocastKwargs

        # A captured graph cannot use autocast's weight-cast cache; the frozen weights are already in the
        # compute dtype, so the cache saves nothing here anyway.
        handlers.append(AutocastKwargs(cache_enabled=False))
    return Accelerator(cpu=cpu, mixed_precision=mp, gradient_accumulation_steps=cfg.train.grad_accum,
                       kwargs_handlers=handlers)

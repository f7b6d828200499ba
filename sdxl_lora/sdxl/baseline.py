"""The step-0 baseline reused across runs: the previews and the eval loss of the model before training are the
base's own (every adapter kind starts as the identity), so a later run on the same base, with the same levers,
images and preview settings, reads them from the cache instead of rendering and measuring them again. This module
says what decides them (the cache keys) and reads or stores the eval loss; sdxl/preview.py does the previews."""
from __future__ import annotations

import dataclasses
import json
import logging
import math

import torch

from .cache import cache_key, component_identity

log = logging.getLogger(__name__)

# Bump when what the previews render changes, so earlier runs' step-0 previews are not reused.
PREVIEW_CACHE_VERSION = 4
# Bump when what evaluate() computes changes, so earlier runs' step-0 figures are not reused.
EVAL_CACHE_VERSION = 1
# The preview settings that change what a step-0 image looks like; the prompts' own text and options are in
# the key apart. When to preview (every, before, after) and the concept score do not change the images.
PREVIEW_RENDER_FIELDS = {"steps", "vae_tiling", "guidance", "guidance_rescale", "seed"}


def step0_identity(task) -> tuple:
    """What decides the step-0 model's outputs for an SDXL task (sdxl/task.py): the base's weights as the run
    holds them, the levers the UNet runs with, the software and device. The step-0 model is the base itself:
    LoRA's, LoHa's and LoKr's updates start at exactly zero; DoRA's rescaling is the identity only up to
    rounding, so it holds the plan too."""
    import diffusers

    from .. import __version__

    cfg, device = task.cfg, task.device
    card = device.type + (f":{torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")
    train = {k: getattr(cfg.train, k) for k in ("fuse_qkv", "fused_geglu", "lora_matmul", "channels_last",
                                                 "compile", "cuda_graphs", "sdpa_backend", "zero_terminal_snr")}
    return (__version__, torch.__version__, diffusers.__version__, card, task.accelerator.mixed_precision,
            [component_identity(task.model_path, c) for c in ("unet", "vae", "text_encoder", "text_encoder_2")],
            json.dumps(cfg.model.model_dump(mode="json", exclude={"cache_dir"}), sort_keys=True),
            task.resolution, json.dumps(train, sort_keys=True), cfg.adapter.kind, cfg.adapter.train_text_encoder,
            json.dumps(task.plan.groups(), sort_keys=True, default=str) if cfg.adapter.kind == "dora" else None)


def previews_key(task) -> str | None:
    """The step-0 previews' cache key: the step-0 model (step0_identity), the prompts and the settings they
    render with, so a later run on the same base with the same previews reuses them. None where previews
    render nothing."""
    if not task.preview_prompts:
        return None
    return cache_key("previews-step0", PREVIEW_CACHE_VERSION, *step0_identity(task),
                     json.dumps(task.cfg.preview.model_dump(mode="json", include=PREVIEW_RENDER_FIELDS),
                                sort_keys=True),
                     [json.dumps(dataclasses.asdict(e), sort_keys=True) for e in task.preview_prompts])


def eval_key(task) -> str | None:
    """The step-0 eval loss's cache key: the step-0 model (step0_identity), the images and captions it is measured
    on (their latent and text cache entries), the noise schedule, and how many images share a call. None with
    text-encoder LoRA (the captions are encoded by the encoders being trained)."""
    if task.cfg.adapter.train_text_encoder:
        return None
    indices = range(min(8, len(task.dataset.items)))
    return cache_key("eval-step0", EVAL_CACHE_VERSION, *step0_identity(task),
                     # Not diffusers' own "_..." entries: _use_default_values is a set's order, another each process.
                     json.dumps({k: v for k, v in task.noise_scheduler.config.items() if not k.startswith("_")},
                                sort_keys=True, default=str),
                     task._eval_per_call(), [task.latent_keys[i][False] for i in indices],
                     [task.text_keys[i] for i in indices])


def evaluate_before(task, model) -> float:
    """The step-0 eval loss, from the cache where an earlier run measured the same base on the same images;
    measured (task.evaluate) and stored otherwise."""
    key = eval_key(task)
    hit = task.cache.get(key) if key is not None else None
    if hit is not None and "loss" in hit:
        loss = float(hit["loss"].item())
        log.info("eval loss at step 0: %.4f from the cache (an earlier run measured the same base on the same "
                 "images)", loss)
        task._run.event("eval_reused", step=0, loss=loss)
        return loss
    loss = task.evaluate(model)
    if key is not None and math.isfinite(loss):
        task.cache.put(key, {"loss": torch.tensor([loss], dtype=torch.float64)})
    return loss

"""Regularization images made by the base model: a [[data.datasets]] table with class_prompt and class_images
(and no path) trains on images the base draws from the prompt when training starts, as the diffusers
DreamBooth example's prior preservation does, captioned with the prompt.

They are cached like latents: in a folder under the cache named by a hash of what they depend on (the base's
UNet, VAE and text encoders, the prompt, the count, the resolution, preview.steps and preview.guidance), one
PNG per seed (image i has seed i), each written atomically, so a second run reuses them and an interrupted one
makes only the rest.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..core.accel import indexed
from .config import DataConfig, DatasetConfig
from ..core.fsutil import atomic_save, atomic_write_text
from .cache import component_identity

log = logging.getLogger(__name__)


def class_folder(cache_root: Path, model_id: str, table: DatasetConfig, resolution: int, steps: int,
                 guidance: float) -> Path:
    key = hashlib.sha256(repr((model_id, table.class_prompt, table.class_images, resolution, steps, guidance))
                         .encode()).hexdigest()
    return cache_root / "class_images" / key[:20]


def generate(pipe, folder: Path, prompt: str, count: int, resolution: int, *, steps: int, guidance: float,
             device: torch.device, autocast_dtype: torch.dtype | None, show: bool = True) -> int:
    """Images 0..count-1 of `prompt` in `folder` that are not there yet (seed = their number), each with its
    caption file; returns how many were made."""
    from .preview import render

    folder.mkdir(parents=True, exist_ok=True)
    todo = [i for i in range(count)
            if not (folder / f"{i:05d}.png").is_file() or not (folder / f"{i:05d}.txt").is_file()]
    if not todo:
        return 0
    parts = dict.fromkeys((pipe.unet, pipe.vae, pipe.text_encoder, pipe.text_encoder_2))  # each once
    # Indexed: a UNet already on "cuda:0" is not on another device than "cuda", and must stay there after.
    moved = [m for m in parts if next(m.parameters()).device != indexed(device)]
    for m in moved:
        m.to(device)
    try:
        for i in tqdm(todo, desc="making class images", unit="img", disable=None if show else True):
            image = render(pipe, [prompt], seed=i, steps=steps, guidance=guidance, width=resolution, height=resolution,
                           autocast_dtype=autocast_dtype)[0]
            atomic_save(folder / f"{i:05d}.png", lambda tmp: image.save(tmp, format="PNG"))
            atomic_write_text(folder / f"{i:05d}.txt", prompt + "\n")
    finally:
        for m in moved:
            m.to("cpu")
    return len(todo)


def with_class_images(task, data: DataConfig, resolution: int) -> DataConfig:
    """data.* with every class_prompt table's path set to its folder of generated images, made where missing
    (by the first process of each machine; the others wait and read them)."""
    from diffusers import StableDiffusionXLPipeline

    from .preview import preview_scheduler

    tables = [i for i, d in enumerate(data.datasets) if d.path is None]
    if not tables:
        return data
    cfg, acc = task.cfg, task.accelerator
    cache_root = Path(data.cache_dir) if data.cache_dir else Path(cfg.output.runs_dir) / ".cache"
    p = task.pipe
    task.to_encode(p.text_encoder, p.text_encoder_2)  # in fp32, as the captions are encoded
    pipe = StableDiffusionXLPipeline(
        vae=p.vae, text_encoder=p.text_encoder, text_encoder_2=p.text_encoder_2, tokenizer=p.tokenizer,
        tokenizer_2=p.tokenizer_2, unet=p.unet,
        scheduler=preview_scheduler(p.scheduler.config, zero_terminal_snr=cfg.train.zero_terminal_snr,
                                    prediction_type=cfg.model.prediction_type))
    pipe.set_progress_bar_config(disable=True)
    model_id = "".join(component_identity(task.model_path, c)
                       for c in ("unet", "vae", "text_encoder", "text_encoder_2"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(acc.mixed_precision)
    tables_now = list(data.datasets)
    with acc.local_main_process_first():
        for i in tables:
            table = data.datasets[i]
            res = table.resolution or resolution
            folder = class_folder(cache_root, model_id, table, res, cfg.preview.steps, cfg.preview.guidance)
            made = 0
            if acc.is_local_main_process:
                made = generate(pipe, folder, table.class_prompt, table.class_images, res, steps=cfg.preview.steps,
                                guidance=cfg.preview.guidance, device=task.device, autocast_dtype=dtype)
            log.info("data.datasets[%d]: %d class image(s) of %r in %s (%d made now, the rest reused)", i,
                     table.class_images, table.class_prompt, folder, made)
            tables_now[i] = table.model_copy(update={"path": str(folder), "name": table.name or "class images"})
    return data.model_copy(update={"datasets": tables_now})

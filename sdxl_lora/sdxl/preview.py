"""Preview images: fixed-seed renders of the prompts file with diffusers' SDXL pipeline, with the step
in the file name and a grid of all prompts, so images at different steps compare like for like."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from PIL import Image

from ..fsutil import atomic_save


def read_prompts(path: str | Path | None) -> list[str]:
    if not path:
        return []
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"preview.prompts={str(p)!r} does not exist; give a text file with one prompt "
                                "per line, or preview.prompts='' for no previews")
    return [line.strip() for line in p.read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def grid(images: list[Image.Image], cols: int | None = None) -> Image.Image:
    cols = cols or len(images)
    rows = (len(images) + cols - 1) // cols
    w, h = images[0].size
    out = Image.new("RGB", (cols * w, rows * h), (0, 0, 0))
    for i, im in enumerate(images):
        out.paste(im, ((i % cols) * w, (i // cols) * h))
    return out


def save_png(img: Image.Image, path: Path) -> Path:
    return atomic_save(path, lambda tmp: img.save(tmp, format="PNG"))


def render(pipe, prompts: list[str], *, seed: int, steps: int, guidance: float, width: int, height: int,
           negative: str | None = None, autocast_dtype: torch.dtype | None = None) -> list[Image.Image]:
    """One image per prompt; prompt i uses seed + i on a CPU generator, so images do not depend on the device."""
    device = pipe.unet.device
    ctx = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
           else contextlib.nullcontext())
    images = []
    with torch.no_grad(), ctx:
        for i, prompt in enumerate(prompts):
            gen = torch.Generator("cpu").manual_seed(seed + i)
            out = pipe(prompt=prompt, negative_prompt=negative, num_inference_steps=steps, guidance_scale=guidance,
                       width=width, height=height, generator=gen, output_type="pil")
            images.append(out.images[0])
    return images


def render_previews(task, model, run, step: int) -> list[Path]:
    """Render the task's prompts with the model being trained; the VAE and text encoders visit the
    accelerator only for the duration."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    cfg = task.cfg
    prompts = read_prompts(cfg.preview.prompts)
    if not prompts:
        return []
    p = task.pipe
    device = task.device
    pipe = StableDiffusionXLPipeline(
        vae=p.vae, text_encoder=p.text_encoder, text_encoder_2=p.text_encoder_2, tokenizer=p.tokenizer,
        tokenizer_2=p.tokenizer_2, unet=model, scheduler=EulerDiscreteScheduler.from_config(p.scheduler.config))
    pipe.set_progress_bar_config(disable=True)
    aux = (p.vae, p.text_encoder, p.text_encoder_2)
    was_training = model.training
    model.eval()
    mp = task.accelerator.mixed_precision
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mp)
    try:
        for m in aux:
            m.to(device)
        images = render(pipe, prompts, seed=cfg.preview.seed, steps=cfg.preview.steps, guidance=cfg.preview.guidance,
                        width=task.resolution, height=task.resolution, autocast_dtype=dtype)
    finally:
        if device.type != "cpu":
            for m in aux:
                m.to("cpu")
        model.train(was_training)
    paths = [save_png(im, run.samples_dir / f"step-{step:06d}-{i:02d}.png") for i, im in enumerate(images)]
    paths.append(save_png(grid(images), run.samples_dir / f"step-{step:06d}-grid.png"))
    return paths

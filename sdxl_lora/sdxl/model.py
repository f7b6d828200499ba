"""Load an SDXL pipeline from what the user named: the shipped demo base ("tiny-sdxl-demo"), the embedded
tiny model with random weights ("tiny-sdxl"), a diffusers folder, or a single-file .safetensors
checkpoint. Always offline; errors say which file is missing."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ..core.config import DEMO_DIR, DEMO_NAME, ModelConfig
from .tiny import TINY_NAME, materialize_tiny

# diffusers folder layout of an SDXL pipeline: what must be there for from_pretrained to work.
REQUIRED = ("model_index.json", "unet/config.json", "vae/config.json", "text_encoder/config.json",
            "text_encoder_2/config.json", "scheduler/scheduler_config.json", "tokenizer", "tokenizer_2")


class ModelError(ValueError):
    pass


def resolve_model_path(cfg: ModelConfig) -> Path:
    """The diffusers folder or file the config names (materialising the tiny model if asked). The demo
    base is read where the package keeps it: nothing ever writes there."""
    if cfg.path == TINY_NAME:
        return materialize_tiny(cfg.cache_dir)
    if cfg.path == DEMO_NAME:
        if not (DEMO_DIR / "model_index.json").is_file():
            raise ModelError(f"model.path='{DEMO_NAME}': the demo base's weights are missing from {DEMO_DIR} "
                             "(they ship with the package: reinstall it, or make them with "
                             f"scripts/pretrain_demo.py, docs/demo_base.md); or use '{TINY_NAME}' (random weights)")
        return DEMO_DIR
    return Path(cfg.path).expanduser()


def load_pipeline(cfg: ModelConfig, torch_dtype: torch.dtype = torch.float32):
    from diffusers import StableDiffusionXLPipeline

    # Belt and braces: nothing in this process may reach a hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = resolve_model_path(cfg)
    if not path.exists():
        raise ModelError(f"model.path={str(path)!r} does not exist; give a diffusers SDXL folder, "
                         f"a single-file .safetensors checkpoint, '{DEMO_NAME}' or '{TINY_NAME}'")
    if path.is_file():
        if path.suffix.lower() in (".ckpt", ".pt", ".pth", ".bin"):
            raise ModelError(f"{path}: pickle checkpoints can run code when loaded and are refused; "
                             "convert it to .safetensors first")
        from .single_file import load_single_file
        tok = Path(cfg.tokenizer) if cfg.tokenizer else None
        return load_single_file(path, tokenizer_dir=tok, torch_dtype=torch_dtype)
    missing = [r for r in REQUIRED if not (path / r).exists()]
    if missing:
        raise ModelError(f"{path} is not a diffusers SDXL folder: missing {', '.join(missing)}")
    return StableDiffusionXLPipeline.from_pretrained(str(path), torch_dtype=torch_dtype,
                                                     local_files_only=True, use_safetensors=True)


def native_resolution(pipe) -> int:
    return int(pipe.unet.config.sample_size) * int(pipe.vae_scale_factor)


ARCH_SDXL = "arch:sdxl"


def unet_skeleton(cfg: ModelConfig):
    """The model's UNet on the meta device (structure only: no memory, no weights read), and its
    native resolution. `arch:sdxl` is SDXL base's own config, bundled with the package."""
    import json

    from diffusers import UNet2DConditionModel

    from .single_file import SDXL_BASE_CONFIG_DIR

    if cfg.path == ARCH_SDXL:
        folder = SDXL_BASE_CONFIG_DIR
    else:
        path = resolve_model_path(cfg)
        # A single-file checkpoint is read as SDXL base (the configs its loading uses too).
        folder = SDXL_BASE_CONFIG_DIR if path.is_file() else path
    unet_cfg = folder / "unet" / "config.json"
    if not unet_cfg.is_file():
        raise ModelError(f"{folder} has no unet/config.json; give a diffusers SDXL folder, "
                         f"a single-file checkpoint, '{DEMO_NAME}', '{TINY_NAME}' or '{ARCH_SDXL}'")
    vae_cfg = json.loads((folder / "vae" / "config.json").read_text(encoding="utf-8"))
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(json.loads(unet_cfg.read_text(encoding="utf-8")))
    vae_factor = 2 ** (len(vae_cfg["block_out_channels"]) - 1)
    return unet, int(unet.config.sample_size) * vae_factor

"""Adapter files: write them (atomically, never over an existing file unless asked) and read them back."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .fsutil import atomic_save

# diffusers reads the LoRA config (ranks, alphas, targets) from this metadata key when it loads a file,
# so mixed ranks and alpha != rank survive the trip.
DIFFUSERS_METADATA_KEY = "lora_adapter_metadata"


class ExportExistsError(FileExistsError):
    pass


def _check_dest(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise ExportExistsError(f"{path} already exists; choose another path or pass overwrite=True (--overwrite)")


def unet_lora_state_dict(unet: torch.nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The UNet's LoRA weights in diffusers/PEFT naming (`<module>.lora_A.weight`), fp32, on CPU."""
    from peft.utils import get_peft_model_state_dict

    sd = get_peft_model_state_dict(unet, adapter_name=adapter_name)
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in sd.items()}


def lora_config_dict(model: torch.nn.Module, adapter_name: str = "default") -> dict:
    cfg = model.peft_config[adapter_name].to_dict()
    for k, v in list(cfg.items()):
        if isinstance(v, set):
            cfg[k] = sorted(v)
    return cfg


def save_diffusers_lora(unet: torch.nn.Module, path: str | Path, overwrite: bool = False,
                        extra_metadata: dict[str, str] | None = None) -> Path:
    """Write the UNet adapter as a diffusers LoRA file (`unet.`-prefixed PEFT keys) that
    `StableDiffusionXLPipeline.load_lora_weights` loads.

    Written here rather than with `save_lora_weights` because that writes in place (a crash mid-write
    leaves a torn file) and only into a folder; the layout and metadata key are the same.
    """
    path = Path(path)
    _check_dest(path, overwrite)
    sd = {f"unet.{k}": v for k, v in unet_lora_state_dict(unet).items()}
    cfg = lora_config_dict(unet)
    metadata = {"format": "pt",
                DIFFUSERS_METADATA_KEY: json.dumps({f"unet.{k}": v for k, v in cfg.items()}, sort_keys=True, default=str)}
    metadata.update(extra_metadata or {})
    return atomic_save(path, lambda tmp: save_file(sd, str(tmp), metadata=metadata))

"""Kohya LoRA key names: SDXL module paths <-> `lora_unet_...` / `lora_te1_...` / `lora_te2_...` names.

AUTOMATIC1111/Forge, ComfyUI and kohya's sd-scripts name an SDXL LoRA layer after the module of
SDXL's original (sgm) code, dots turned into underscores, e.g.
`lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q` for diffusers'
`down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`. The sgm path comes from
`single_file.unet_diffusers_to_sgm`, derived from the UNet's config, so the same code names the
embedded tiny SDXL and the real one. Text encoder layers keep transformers' names under
`lora_te1_` (CLIP ViT-L) and `lora_te2_` (OpenCLIP bigG as CLIPTextModelWithProjection).

Underscores make the names ambiguous (`to_out_0`, `transformer_blocks`), so reading goes through a
table: every Linear/Conv2d layer of the model (built from its configs on the meta device, no
weights), with the name it gets in both styles. A name missing from the table is unknown, never guessed.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .single_file import SDXL_BASE_CONFIG_DIR, map_module_path, unet_diffusers_to_sgm

COMPONENTS = ("unet", "text_encoder", "text_encoder_2")
PREFIX = {"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}
# Read as well: SD 1.x-style files name their only text encoder `lora_te_`.
READ_PREFIXES = (("lora_unet_", "unet"), ("lora_te1_", "text_encoder"), ("lora_te2_", "text_encoder_2"),
                 ("lora_te_", "text_encoder"))
NAME_STYLES = ("sgm", "diffusers")


def kohya_name(component: str, module: str, unet_map: dict[str, str] | None, style: str = "sgm") -> str:
    """The kohya layer name (no suffix) of `module` of `component` ("unet", "text_encoder", "text_encoder_2").

    style="sgm" (what A1111/Forge/ComfyUI expect) maps UNet paths with `unet_map`
    (`unet_diffusers_to_sgm(config)`); style="diffusers" keeps diffusers' block names.
    """
    if style not in NAME_STYLES:
        raise ValueError(f"names={style!r}: must be one of {', '.join(NAME_STYLES)}")
    if component == "unet":
        path = map_module_path(module, unet_map) if style == "sgm" else module
    elif component in ("text_encoder", "text_encoder_2"):
        # transformers >= 5.6 flattened CLIPTextModel (no `text_model.`); kohya names keep it.
        path = module if module.startswith(("text_model.", "text_projection")) else f"text_model.{module}"
    else:
        raise ValueError(f"component {component!r}: must be one of {', '.join(COMPONENTS)}")
    return PREFIX[component] + path.replace(".", "_")


def _layers_of(model: nn.Module | None) -> dict[str, tuple[int, ...]]:
    if model is None:
        return {}
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)) and "lora_" not in name:
            # peft wraps an adapted layer: its own path is the wrapper's, the Linear inside is `base_layer`.
            out[name.removesuffix(".base_layer")] = tuple(m.weight.shape)
    return out


@dataclass
class LayerTable:
    """Every Linear/Conv2d layer of an SDXL model (UNet and both text encoders) with its weight shape,
    and the kohya name of each in both styles."""
    unet_config: dict
    layers: dict[str, dict[str, tuple[int, ...]]]  # component -> module path -> weight shape
    _by_kohya: dict[str, tuple[str, str]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        unet_map = unet_diffusers_to_sgm(self.unet_config)
        for comp, mods in self.layers.items():
            for module in mods:
                for style in NAME_STYLES:
                    try:
                        self._by_kohya[kohya_name(comp, module, unet_map, style)] = (comp, module)
                    except KeyError:  # a UNet layer with no sgm name: only its diffusers-style name exists
                        continue
        # `lora_te_` (SD 1.x) is the first text encoder.
        for name, (comp, module) in list(self._by_kohya.items()):
            if comp == "text_encoder":
                self._by_kohya.setdefault("lora_te_" + name.removeprefix(PREFIX[comp]), (comp, module))

    def lookup(self, lora_name: str) -> tuple[str, str] | None:
        """(component, module path) of a kohya layer name, or None when the model has no such layer."""
        return self._by_kohya.get(lora_name)

    def shape(self, component: str, module: str) -> tuple[int, ...] | None:
        return self.layers.get(component, {}).get(module)

    @classmethod
    def from_models(cls, unet: nn.Module, text_encoder: nn.Module | None = None,
                    text_encoder_2: nn.Module | None = None) -> LayerTable:
        return cls(dict(unet.config), {"unet": _layers_of(unet), "text_encoder": _layers_of(text_encoder),
                                       "text_encoder_2": _layers_of(text_encoder_2)})

    @classmethod
    def from_pipeline(cls, pipe) -> LayerTable:
        return cls.from_models(pipe.unet, getattr(pipe, "text_encoder", None), getattr(pipe, "text_encoder_2", None))

    @classmethod
    def from_config_dir(cls, config_dir: str | Path | None = None) -> LayerTable:
        """From a diffusers SDXL folder's configs (weights are not read); default: SDXL base's, bundled."""
        return _table_from_configs(str(Path(config_dir) if config_dir is not None else SDXL_BASE_CONFIG_DIR))


@functools.lru_cache(maxsize=4)
def _table_from_configs(config_dir: str) -> LayerTable:
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    d = Path(config_dir)
    cfg_path = d / "unet" / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{d} has no unet/config.json: give a diffusers SDXL folder")
    unet_cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(unet_cfg)
        tes = []
        for sub, klass in (("text_encoder", CLIPTextModel), ("text_encoder_2", CLIPTextModelWithProjection)):
            tes.append(klass(CLIPTextConfig.from_pretrained(str(d / sub), local_files_only=True))
                       if (d / sub / "config.json").is_file() else None)
    return LayerTable.from_models(unet, *tes)

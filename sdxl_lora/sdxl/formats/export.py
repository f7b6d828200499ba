"""Adapter files: write them in the kohya format (AUTOMATIC1111/Forge, ComfyUI, kohya), diffusers' or
PEFT's, atomically and never over an existing file unless asked (this module); read any of them back
(read.py) and describe them (describe.py).

In memory an adapter is an `Adapter`: its layers by diffusers module path with the component in
front (`unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`), each with its down and
up weights and its true alpha (the layer adds alpha / rank * up @ down), whatever file it came
from (adapter.py). Every conversion is read -> Adapter -> write, so a new format is one reader and one writer.

  kohya      `lora_unet_<sgm module>.lora_down.weight` / `.lora_up.weight` / `.alpha` (+ `.dora_scale`),
             `ss_*` and `modelspec.*` metadata; or diffusers block names with names="diffusers"; LoHa and
             LoKr layers with LyCORIS' `.hada_*` / `.lokr_*` tensors under the same names (sdxl/formats/lycoris.py)
  diffusers  `unet.<module>.lora_A.weight` / `.lora_B.weight`, the LoRA config (ranks, alphas) in the
             `lora_adapter_metadata` entry; `load_lora_weights` reads it
  peft       a folder: adapter_config.json + adapter_model.safetensors (`base_model.model.<module>...`)
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import kohya
from ...core.fsutil import atomic_folder, atomic_save, atomic_write_text
# The in-memory adapter, the readers and the description, importable from here as before the split (callers
# and docs use `formats.export` for the whole read/write API).
from .adapter import (DIFFUSERS_METADATA_KEY, DIFFUSERS_WEIGHTS_NAME, FORMATS, PEFT_CONFIG_NAME,  # noqa: F401
                      PEFT_PREFIX, PEFT_WEIGHTS_NAME, PICKLE_SUFFIXES, Adapter, AdapterError, AnyLayer,
                      ExportExistsError, LoraLayer, _as_adapter, _config_dict, _lora_only, _mixed_attention_alphas,
                      _num, adapter_from_model, apply_adapter, check_dest, lora_config_for, weight_with)
from .describe import KIND_NAMES, OTHER_FORMAT_TOOLS, describe_adapter, inspect_adapter  # noqa: F401
from .read import layer_table, load_adapter, peft_key_groups  # noqa: F401

log = logging.getLogger(__name__)

# What AUTOMATIC1111/Forge read to decide an adapter is for SDXL (it hides LoRAs that do not say so).
SS_BASE_MODEL_VERSION = "sdxl_base_v1-0"
SS_NETWORK_MODULE = "networks.lora"
MODELSPEC_LORA_ARCHITECTURE = "stable-diffusion-xl-v1-base/lora"
MODELSPEC_IMPLEMENTATION = "https://github.com/Stability-AI/generative-models"
# Metadata computed from the weights at write time: a carried-over value would be stale.
_DERIVED = {"ss_network_dim", "ss_network_alpha", "sshs_model_hash", "sshs_legacy_hash", "format",
            DIFFUSERS_METADATA_KEY}


# --------------------------------------------------------------------------------------------
# Metadata


def training_metadata(*, title: str, steps: int | None = None, resolution: int | None = None,
                      trigger_phrase: str = "", base_model: str | None = None,
                      datasets: Mapping[str, Sequence[tuple[str, int]]] | None = None,
                      regularization: Collection[str] = (),
                      extra: Mapping[str, object] | None = None) -> dict[str, str]:
    """The descriptive `ss_*` / `modelspec.*` metadata of a trained adapter (the writer adds the keys
    computed from the weights). `datasets` maps a dataset folder's name (not its path) to
    (caption, repeats) per image; `regularization` names those of them that are regularization datasets,
    counted apart as kohya counts them (`ss_num_reg_images`, images x repeats); `base_model` is reduced to
    its file or folder name."""
    meta: dict[str, str] = {"ss_output_name": title, "modelspec.title": title}
    if steps is not None:
        meta["ss_steps"] = meta["ss_max_train_steps"] = str(int(steps))
    if resolution:
        meta["ss_resolution"] = f"({resolution}, {resolution})"
        meta["modelspec.resolution"] = f"{resolution}x{resolution}"
    if trigger_phrase.strip():
        meta["modelspec.trigger_phrase"] = trigger_phrase.strip()
    if base_model:
        meta["ss_sd_model_name"] = Path(str(base_model)).name
    if datasets is not None:
        dirs, tags, total, reg = {}, {}, 0, 0
        for name, images in datasets.items():
            repeats = Counter(r for _, r in images)
            dirs[name] = {"n_repeats": repeats.most_common(1)[0][0] if repeats else 1, "img_count": len(images)}
            if name in regularization:
                reg += sum(r for _, r in images)
            else:
                total += sum(r for _, r in images)
            freq: Counter = Counter()
            for caption, _ in images:
                freq.update(t.strip() for t in caption.split(",") if t.strip())
            tags[name] = dict(freq.most_common())
        meta["ss_num_train_images"] = str(total)
        meta["ss_num_reg_images"] = str(reg)
        meta["ss_dataset_dirs"] = json.dumps(dirs, ensure_ascii=False)
        meta["ss_tag_frequency"] = json.dumps(tags, ensure_ascii=False)
    for k, v in (extra or {}).items():
        meta[str(k)] = v if isinstance(v, str) else json.dumps(v)
    return meta


def _scrub_paths(meta: dict[str, str]) -> dict[str, str]:
    """No absolute paths leave the machine in a shared file: a value that is one keeps its last part."""
    out = {}
    for k, v in meta.items():
        s = v.strip()
        if len(s) > 1 and (os.path.isabs(s) or re.match(r"^[A-Za-z]:[\\/]", s)) and "\n" not in s:
            log.info("metadata %s held an absolute path; only its last part %r is written", k, Path(s).name)
            v = Path(s.replace("\\", "/")).name
        out[k] = v
    return out


def _carried(meta: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in meta.items() if k not in _DERIVED}


def kohya_metadata(adapter: Adapter, extra: Mapping[str, str] | None = None,
                   uniform_alpha: bool = False) -> dict[str, str]:
    """`ss_*` and `modelspec.*` metadata for a kohya file: what A1111/Forge need to list it as an SDXL
    LoRA, the adapter's carried-over description, then `extra` (which wins)."""
    kinds = adapter.kinds()
    lyco = [k for k in kinds if k in ("loha", "lokr")]
    written = kohya_layers(adapter, uniform_alpha)
    ranks = Counter(lay.rank for lay in adapter.layers.values() if lay.rank is not None) or Counter({1: 1})
    alphas = Counter(lay.alpha for lay in written.values())
    # The training alphas, where the file's differ from them (the difference is in the weights).
    folded = sorted({lay.alpha for lay in adapter.layers.values()}) if any(
        written[k].alpha != lay.alpha for k, lay in adapter.layers.items()) else []
    meta = {
        "ss_base_model_version": SS_BASE_MODEL_VERSION,
        # LoHa/LoKr files are LyCORIS' (kohya's sd-scripts trains them through that network module).
        "ss_network_module": "lycoris.kohya" if lyco else SS_NETWORK_MODULE,
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": MODELSPEC_LORA_ARCHITECTURE,
        "modelspec.implementation": MODELSPEC_IMPLEMENTATION,
    }
    meta.update(_carried(adapter.metadata))
    meta.update({str(k): str(v) for k, v in (extra or {}).items()})
    meta["ss_network_dim"] = str(ranks.most_common(1)[0][0])
    meta["ss_network_alpha"] = _num(alphas.most_common(1)[0][0])
    # kohya's key for the network's settings: note mixed ranks/alphas (each layer's own are in its tensors).
    try:
        args = json.loads(meta.get("ss_network_args", "{}"))
    except json.JSONDecodeError:
        args = None
    if isinstance(args, dict):
        for k in ("mixed_ranks", "mixed_alphas", "training_alphas_folded", "algo", "dora_wd"):
            args.pop(k, None)
        if lyco:
            args["algo"] = lyco[0]  # LyCORIS' name for the kind
        if "dora" in kinds:
            args["dora_wd"] = "True"
        if len(ranks) > 1:
            args["mixed_ranks"] = sorted(ranks)
        if len(alphas) > 1:
            args["mixed_alphas"] = sorted(alphas)
        if folded:  # the layers' training alphas, now folded into their up weights (LoHa/LoKr: their factors)
            args["training_alphas_folded"] = folded
        if args:
            meta["ss_network_args"] = json.dumps(args)
        else:
            meta.pop("ss_network_args", None)
    return _scrub_paths(meta)


def _addnet_hashes(tensors: dict[str, torch.Tensor], meta: Mapping[str, str]) -> tuple[str, str]:
    """kohya's `sshs_model_hash` / `sshs_legacy_hash` (what A1111 shows and matches on): sha256 of the
    tensor bytes of the file as written with only its `ss_*` metadata, and the old 8-digit hash."""
    from safetensors.torch import save

    data = save(tensors, metadata={k: v for k, v in meta.items() if k.startswith("ss_")})
    n = int.from_bytes(data[:8], "little")
    legacy = hashlib.sha256(data[0x100000:0x110000]).hexdigest()[:8]
    return hashlib.sha256(data[8 + n:]).hexdigest(), legacy


# --------------------------------------------------------------------------------------------
# Writers


def _saveable(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    t = t.detach()
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.contiguous()


def kohya_layers(adapter: Adapter, uniform_alpha: bool = True) -> dict[str, AnyLayer]:
    """The adapter's layers as a kohya file holds them: each applies the same update, with the alpha that makes
    every tool apply it (sdxl/formats/loaders.py says which tool reads what).

    LoRA and DoRA: uniform_alpha=True gives every layer the most common alpha and folds the difference into its
    up weights, since diffusers' kohya loader applies a single alpha to all attention layers (a file with mixed
    alphas loads at the wrong strength there); uniform_alpha=False keeps each layer's training alpha (right in
    A1111/Forge, ComfyUI, kohya). LoHa and LoKr: alpha = rank, alpha / rank folded into the factors, either way:
    LyCORIS' merge applies alpha / rank twice to them, and every other loader applies the same update.
    """
    alphas = Counter(lay.alpha for lay in adapter.layers.values() if isinstance(lay, LoraLayer))
    common = alphas.most_common(1)[0][0] if alphas else 1.0
    out: dict[str, AnyLayer] = {}
    for key, layer in adapter.layers.items():
        if not isinstance(layer, LoraLayer):
            layer = layer.at_unit_scale()
        elif uniform_alpha and layer.alpha != common:
            layer = LoraLayer(layer.down, layer.up.float() * (layer.alpha / common), common, layer.magnitude)
        out[key] = layer
    return out


def kohya_state_dict(adapter: Adapter, unet_config: Mapping | None = None, names: str = "sgm",
                     dtype: torch.dtype | None = torch.float32, uniform_alpha: bool = True) -> dict[str, torch.Tensor]:
    """The adapter's tensors under kohya names (tensors stay on their device; alphas are fp32 scalars), its
    layers as `kohya_layers` gives them (uniform_alpha: one alpha for every LoRA layer)."""
    biased = [k for k, lay in adapter.layers.items() if lay.bias is not None]
    if biased:
        raise AdapterError(f"{len(biased)} layers have a LoRA bias (adapter.lora_bias), which the kohya format "
                           f"cannot hold, e.g. {biased[0]}: export --format diffusers or peft")
    from .single_file import unet_config as sdxl_unet_config
    from .single_file import unet_diffusers_to_sgm

    unet_map = unet_diffusers_to_sgm(dict(unet_config) if unet_config is not None else sdxl_unet_config())
    out: dict[str, torch.Tensor] = {}
    owner: dict[str, str] = {}
    for key, layer in sorted(kohya_layers(adapter, uniform_alpha).items()):
        comp, module = key.split(".", 1)
        try:
            name = kohya.kohya_name(comp, module, unet_map, names)
        except KeyError:
            raise AdapterError(f"{key}: the UNet config gives this layer no sgm name; export with "
                               "names='diffusers' (--names diffusers)") from None
        if name in owner:
            raise AdapterError(f"{key} and {owner[name]} both get the kohya name {name}")
        owner[name] = key
        if not isinstance(layer, LoraLayer):  # LoHa / LoKr: LyCORIS' tensors, each layer with its own alpha = rank
            out.update({f"{name}.{k}": _saveable(t, dtype) for k, t in layer.tensors().items()})
            out[f"{name}.alpha"] = torch.tensor(float(layer.alpha), dtype=torch.float32)
            continue
        out[f"{name}.lora_down.weight"] = _saveable(layer.down, dtype)
        out[f"{name}.lora_up.weight"] = _saveable(layer.up, dtype)
        out[f"{name}.alpha"] = torch.tensor(float(layer.alpha), dtype=torch.float32)
        if layer.magnitude is not None:
            # kohya/LyCORIS DoRA: magnitude along the output axis, shaped (out, 1[, 1, 1]).
            shape = (layer.up.shape[0],) + (1,) * (layer.up.dim() - 1)
            out[f"{name}.dora_scale"] = _saveable(layer.magnitude.reshape(shape), dtype)
    return out


def save_kohya_lora(source, path: str | Path, *, metadata: bool | Mapping[str, str] = True, names: str = "sgm",
                    unet_config: Mapping | None = None, dtype: torch.dtype | None = torch.float32,
                    uniform_alpha: bool = True, overwrite: bool = False, reads: Iterable[str | Path] = ()) -> Path:
    """Write an adapter (an `Adapter`, or a UNet with a peft adapter) as a kohya `.safetensors` file.

    Names are SDXL's sgm module names (names="diffusers": diffusers block names), each layer with its
    own `.alpha`. metadata=True writes the `ss_*` / `modelspec.*` keys A1111/Forge use (with the
    adapter's own description), a mapping adds to or overrides them, False writes none.
    `unet_config` (default: the model's, or SDXL base's) fixes the sgm block numbers. Mixed alphas are
    unified unless uniform_alpha=False, so diffusers loads the file at the right strength too; LoHa/LoKr layers
    are written with alpha = rank (see `kohya_layers`).
    """
    path = Path(path)
    check_dest(path, overwrite, reads)
    if unet_config is None and not isinstance(source, Adapter):
        unet_config = dict(source.config)
    adapter = _as_adapter(source)
    if not uniform_alpha and _mixed_attention_alphas(adapter):
        log.warning("%s: the attention layers have different alphas; AUTOMATIC1111/Forge, ComfyUI and kohya "
                    "read them right, diffusers' kohya loader applies one alpha to all of them (leave "
                    "uniform_alpha on / drop --true-alpha for diffusers, or use the diffusers file)", path.name)
    tensors = {k: v.cpu() for k, v in kohya_state_dict(adapter, unet_config, names, dtype, uniform_alpha).items()}
    meta = None
    if metadata is not False:
        meta = kohya_metadata(adapter, metadata if isinstance(metadata, Mapping) else None, uniform_alpha)
        meta.setdefault("modelspec.title", path.stem)
        meta["sshs_model_hash"], meta["sshs_legacy_hash"] = _addnet_hashes(tensors, meta)
    return atomic_save(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def unet_lora_state_dict(unet: torch.nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The UNet's LoRA weights in diffusers/PEFT naming (`<module>.lora_A.weight`), fp32, on CPU."""
    from peft.utils import get_peft_model_state_dict

    sd = get_peft_model_state_dict(unet, adapter_name=adapter_name)
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in sd.items()}


def lora_config_dict(model: torch.nn.Module, adapter_name: str = "default") -> dict:
    return _config_dict(model.peft_config[adapter_name])


def _peft_tensors(layers: Mapping[str, LoraLayer], prefix: str, bake: bool,
                  dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    out = {}
    for m, layer in sorted(layers.items()):
        up = layer.up.float() * layer.scale if bake else layer.up
        out[f"{prefix}{m}.lora_A.weight"] = _saveable(layer.down, dtype).cpu()
        out[f"{prefix}{m}.lora_B.weight"] = _saveable(up, dtype).cpu()
        if layer.magnitude is not None:
            shape = (1, -1, 1, 1) if layer.down.dim() == 4 else (-1,)  # peft's own shapes
            out[f"{prefix}{m}.lora_magnitude_vector"] = _saveable(layer.magnitude.reshape(shape), dtype).cpu()
        if layer.bias is not None:
            bias = layer.bias.float() * layer.scale if bake else layer.bias
            out[f"{prefix}{m}.lora_B.bias"] = _saveable(bias, dtype).cpu()
    return out


def _loadable_config(layers: Mapping[str, LoraLayer]) -> dict:
    # The LoraConfig fields a loader needs, nothing that ties the file to this peft version.
    cfg = _config_dict(lora_config_for(layers))
    keep = ("r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern", "use_dora", "use_rslora",
            "lora_bias", "fan_in_fan_out", "bias", "peft_type", "init_lora_weights", "lora_dropout")
    return {k: cfg[k] for k in keep if k in cfg}


def save_diffusers_lora(unet, path: str | Path, overwrite: bool = False,
                        extra_metadata: dict[str, str] | None = None, *, metadata: bool = True,
                        dtype: torch.dtype | None = torch.float32, reads: Iterable[str | Path] = ()) -> Path:
    """Write an adapter (a UNet with a peft adapter, or an `Adapter`) as a diffusers LoRA file
    (`unet.`-prefixed PEFT keys) that `StableDiffusionXLPipeline.load_lora_weights` loads.

    Written here rather than with `save_lora_weights` because that writes in place (a crash mid-write
    leaves a torn file) and only into a folder; the layout and metadata key are the same. With
    metadata=False the file has no metadata at all: each layer's alpha / rank is folded into its up
    weights, which is what diffusers assumes (alpha = rank) for a file without its config.
    """
    path = Path(path)
    check_dest(path, overwrite, reads)
    adapter = _as_adapter(unet)
    _lora_only(adapter, "diffusers")
    sd: dict[str, torch.Tensor] = {}
    packed: dict[str, object] = {}
    for comp in adapter.components():
        layers = adapter.component(comp)
        sd.update(_peft_tensors(layers, f"{comp}.", bake=not metadata, dtype=dtype))
        packed.update({f"{comp}.{k}": v for k, v in _loadable_config(layers).items()})
    meta = None
    if metadata:
        extra = {str(k): str(v) for k, v in (extra_metadata or {}).items()}
        meta = _scrub_paths({**_carried(adapter.metadata), **extra})
        meta.update({"format": "pt", DIFFUSERS_METADATA_KEY: json.dumps(packed, sort_keys=True, default=str)})
    return atomic_save(path, lambda tmp: save_file(sd, str(tmp), metadata=meta))


def save_peft_adapter(source, folder: str | Path, *, component: str = "unet", metadata: bool = True,
                      dtype: torch.dtype | None = torch.float32, overwrite: bool = False,
                      reads: Iterable[str | Path] = ()) -> Path:
    """Write one model's adapter as a PEFT folder (adapter_config.json + adapter_model.safetensors),
    loadable with `peft.PeftModel.from_pretrained(model, folder)`."""
    folder = Path(folder)
    check_dest(folder, overwrite, reads)
    adapter = _as_adapter(source)
    _lora_only(adapter, "peft")
    others = [c for c in adapter.components() if c != component]
    if others:
        raise AdapterError(f"a PEFT folder holds one model's adapter; this one also has {', '.join(others)} "
                           "layers: export those with --format kohya or diffusers")
    layers = adapter.component(component)
    if not layers:
        raise AdapterError(f"the adapter has no {component} layers")
    cfg = _config_dict(lora_config_for(layers))
    cfg["base_model_name_or_path"] = None
    meta = None
    if metadata:
        meta = {**_scrub_paths(_carried(adapter.metadata)), "format": "pt"}
    sd = _peft_tensors(layers, PEFT_PREFIX, bake=False, dtype=dtype)
    with atomic_folder(folder, overwrite, ExportExistsError) as tmp:
        atomic_write_text(tmp / PEFT_CONFIG_NAME, json.dumps(cfg, indent=2, sort_keys=True, default=str))
        atomic_save(tmp / PEFT_WEIGHTS_NAME, lambda t: save_file(sd, str(t), metadata=meta))
    return folder


def export_adapter(source, path: str | Path, format: str = "kohya", *, metadata: bool | Mapping[str, str] = True,
                   names: str = "sgm", unet_config: Mapping | None = None, uniform_alpha: bool = True,
                   overwrite: bool = False, reads: Iterable[str | Path | None] = ()) -> Path:
    """Write `source` (an `Adapter` or a model with a peft adapter) in `format`: kohya, diffusers or peft; never
    at, over or inside what it was read from (`reads`: the adapter's file or folder, its model; check_dest)."""
    if format == "kohya":
        return save_kohya_lora(source, path, metadata=metadata, names=names, unet_config=unet_config,
                               uniform_alpha=uniform_alpha, overwrite=overwrite, reads=reads)
    if format == "diffusers":
        extra = dict(metadata) if isinstance(metadata, Mapping) else None
        return save_diffusers_lora(source, path, overwrite, extra, metadata=metadata is not False, reads=reads)
    if format == "peft":
        return save_peft_adapter(source, path, metadata=metadata is not False, overwrite=overwrite, reads=reads)
    raise AdapterError(f"format={format!r}: must be one of {', '.join(FORMATS)}")

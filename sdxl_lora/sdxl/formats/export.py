"""Adapter files: write them in the kohya format (AUTOMATIC1111/Forge, ComfyUI, kohya), diffusers' or
PEFT's, atomically and never over an existing file unless asked; read any of them back (import).

In memory an adapter is an `Adapter`: its layers by diffusers module path with the component in
front (`unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`), each with its down and
up weights and its true alpha (the layer adds alpha / rank * up @ down), whatever file it came
from. Every conversion is read -> Adapter -> write, so a new format is one reader and one writer.

  kohya      `lora_unet_<sgm module>.lora_down.weight` / `.lora_up.weight` / `.alpha` (+ `.dora_scale`),
             `ss_*` and `modelspec.*` metadata; or diffusers block names with names="diffusers"; LoHa and
             LoKr layers with LyCORIS' `.hada_*` / `.lokr_*` tensors under the same names (sdxl/formats/lycoris.py)
  diffusers  `unet.<module>.lora_A.weight` / `.lora_B.weight`, the LoRA config (ranks, alphas) in the
             `lora_adapter_metadata` entry; `load_lora_weights` reads it
  peft       a folder: adapter_config.json + adapter_model.safetensors (`base_model.model.<module>...`)
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import kohya, lycoris
from .lycoris import LohaLayer, LokrLayer
from ...core.fsutil import atomic_folder, atomic_save, atomic_write_text, check_destination
from ...core.inject import exact_patterns

log = logging.getLogger(__name__)

# diffusers reads the LoRA config (ranks, alphas, targets) from this metadata key when it loads a file,
# so mixed ranks and alpha != rank survive the trip.
DIFFUSERS_METADATA_KEY = "lora_adapter_metadata"
FORMATS = ("kohya", "diffusers", "peft")
PEFT_CONFIG_NAME = "adapter_config.json"
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"
DIFFUSERS_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
PEFT_PREFIX = "base_model.model."

# What AUTOMATIC1111/Forge read to decide an adapter is for SDXL (it hides LoRAs that do not say so).
SS_BASE_MODEL_VERSION = "sdxl_base_v1-0"
SS_NETWORK_MODULE = "networks.lora"
MODELSPEC_LORA_ARCHITECTURE = "stable-diffusion-xl-v1-base/lora"
MODELSPEC_IMPLEMENTATION = "https://github.com/Stability-AI/generative-models"
# Metadata computed from the weights at write time: a carried-over value would be stale.
_DERIVED = {"ss_network_dim", "ss_network_alpha", "sshs_model_hash", "sshs_legacy_hash", "format",
            DIFFUSERS_METADATA_KEY}
PICKLE_SUFFIXES = {".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle"}


class AdapterError(ValueError):
    """An adapter file or folder cannot be read or written as asked; the message says why and what to do."""


class ExportExistsError(FileExistsError):
    pass


def check_dest(path: str | Path, overwrite: bool, reads: Iterable[str | Path | None] = (), reader: str = "the export",
               error: type[Exception] = AdapterError) -> None:
    """core.fsutil.check_destination with this module's errors: every writer here passes it, and callers that
    want the refusal before long work (extract, merge, resize) call it first. Never over what the result is
    made from (`reads`: adapters, base models) or a run's records, asked or not; never over an existing file or
    folder unless asked. `error` is the caller's own error class."""
    check_destination(path, overwrite, reads, reader, error=error, exists_error=ExportExistsError)


# --------------------------------------------------------------------------------------------
# The adapter in memory


@dataclass
class LoraLayer:
    """One adapted layer: the update is alpha / rank * up @ down (for convolutions, up is 1x1)."""
    down: torch.Tensor               # (rank, in) or (rank, in, kh, kw)
    up: torch.Tensor                 # (out, rank) or (out, rank, 1, 1)
    alpha: float
    magnitude: torch.Tensor | None = None  # DoRA: the per-output-channel magnitude, shape (out,)
    bias: torch.Tensor | None = None       # LoRA-Bias: up's bias, shape (out,); adds alpha / rank * bias

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def kind(self) -> str:
        return "dora" if self.magnitude is not None else "lora"

    @property
    def update_shape(self) -> tuple[int, ...]:
        return (self.up.shape[0], *self.down.shape[1:])

    def delta(self) -> torch.Tensor:
        """The change B A * scale to the base weight (fp32), shaped like it (for DoRA: before the magnitude,
        see `weight_with`)."""
        down, up = self.down.float(), self.up.float()
        d = up.flatten(1) @ down.flatten(1)
        return (d.reshape(up.shape[0], *down.shape[1:]) if down.dim() == 4 else d) * self.scale

    def finite(self) -> bool:
        return bool(torch.isfinite(self.down).all() and torch.isfinite(self.up).all())

    def scaled(self, factor: float) -> "LoraLayer":
        """The layer whose update (bias included) is `factor` times this one's: its alpha scaled. For DoRA that
        scales the update inside the norm, as peft's scale does, not a loader's strength (see `weight_with`)."""
        return dataclasses.replace(self, alpha=self.alpha * factor)


AnyLayer = LoraLayer | LohaLayer | LokrLayer


def weight_with(weight: torch.Tensor, layer: AnyLayer, strength: float = 1.0) -> torch.Tensor:
    """The base weight with the layer applied at `strength` (fp32). LoRA, LoHa, LoKr: W + strength * delta.
    DoRA: W' = m * (W + delta) / ||W + delta||, each output channel's row normalised (peft's and LyCORIS'
    rule), and strength blends linearly, W + strength * (W' - W), as ComfyUI and Forge apply it: 0 is the
    base, 1 what was trained."""
    w = weight.float()
    delta = layer.delta().to(w.device).reshape(w.shape)
    if layer.magnitude is None:
        return w + strength * delta
    v = w + delta
    norm = v.reshape(v.shape[0], -1).norm(dim=1).reshape(-1, *[1] * (v.dim() - 1))
    dora = v * (layer.magnitude.float().to(w.device).reshape(norm.shape) / norm)
    return w + strength * (dora - w)


@dataclass
class Adapter:
    layers: dict[str, AnyLayer]                  # "unet.<module path>" / "text_encoder.<...>" -> layer
    metadata: dict[str, str] = field(default_factory=dict)
    format: str = "memory"                       # what it was read from
    unknown: list[str] = field(default_factory=list)   # keys of the file that name no layer of the model
    problems: list[str] = field(default_factory=list)

    def component(self, name: str) -> dict[str, AnyLayer]:
        return {k.split(".", 1)[1]: v for k, v in self.layers.items() if k.split(".", 1)[0] == name}

    def components(self) -> list[str]:
        return sorted({k.split(".", 1)[0] for k in self.layers})

    def kinds(self) -> list[str]:
        """The adapter kinds of its layers (lora, dora, loha, lokr)."""
        return sorted({lay.kind for lay in self.layers.values()})


def _rank_alpha(cfg: Mapping, module: str) -> tuple[int | None, float | None]:
    """A module's rank and alpha (scale = alpha / rank) under a peft LoRA config (as a dict), resolved
    with peft's own pattern rule, so rank_pattern/alpha_pattern mean what they meant when training."""
    from peft.utils.other import get_pattern_key

    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), module), cfg.get("r"))
    alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), module), cfg.get("lora_alpha"))
    if alpha is not None and r is not None and cfg.get("use_rslora"):
        alpha = alpha * math.sqrt(r)  # rsLoRA scales by alpha / sqrt(r): the same update as alpha * sqrt(r) / r
    return r, (float(alpha) if alpha is not None else None)


def _config_dict(config) -> dict:
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    for k, v in list(cfg.items()):
        if isinstance(v, set):
            cfg[k] = sorted(v)
    return cfg


def adapter_from_model(model: torch.nn.Module, component: str = "unet", adapter_name: str = "default") -> Adapter:
    """The LoRA layers peft put in `model` (e.g. the UNet being trained), with each layer's rank and
    alpha from the adapter's config (rank_pattern and alpha_pattern included)."""
    from peft.tuners.lora import LoraLayer as PeftLoraLayer

    configs = getattr(model, "peft_config", None) or {}
    # Injected without a config on the model (peft.inject_adapter_in_model): each layer's own r and alpha.
    cfg = _config_dict(configs[adapter_name]) if adapter_name in configs else None
    layers = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, PeftLoraLayer) or adapter_name not in mod.lora_A:
            lyco = lycoris.from_peft(mod, adapter_name)
            if lyco is not None:
                layers[f"{component}.{name.removeprefix(PEFT_PREFIX)}"] = lyco
            continue
        name = name.removeprefix(PEFT_PREFIX)
        if cfg is not None:
            r, alpha = _rank_alpha(cfg, name)
        else:
            r, alpha = mod.r[adapter_name], float(mod.lora_alpha[adapter_name])
            alpha = alpha * math.sqrt(r) if mod.use_rslora.get(adapter_name) else alpha
        down = mod.lora_A[adapter_name].weight.detach()
        up = mod.lora_B[adapter_name].weight.detach()
        if down.shape[0] != r:
            raise AdapterError(f"{name}: lora_A has rank {down.shape[0]} but the adapter config says r={r}")
        bias = getattr(mod.lora_B[adapter_name], "bias", None)
        mag = None
        if mod.use_dora.get(adapter_name):
            mag = mod.lora_magnitude_vector[adapter_name].weight.detach().reshape(-1)
        layers[f"{component}.{name}"] = LoraLayer(down, up, alpha, mag, None if bias is None else bias.detach())
    if not layers:
        raise AdapterError(f"the {component} has no LoRA layers of an adapter named {adapter_name!r}"
                           + (f" (its adapters: {', '.join(configs)})" if configs else ""))
    return Adapter(layers)


def _as_adapter(source) -> Adapter:
    return source if isinstance(source, Adapter) else adapter_from_model(source)


def _one_kind(layers: Mapping[str, AnyLayer], what: str) -> str:
    """The one peft config kind ("lora" for lora and dora, "loha", "lokr") of `layers`; several refused."""
    kinds = {"lora" if lay.kind == "dora" else lay.kind for lay in layers.values()}
    if len(kinds) > 1:
        raise AdapterError(f"{what}: the layers mix adapter kinds ({', '.join(sorted(kinds))}), which one peft "
                           "adapter cannot hold")
    return kinds.pop()


def _lora_only(adapter: Adapter, fmt: str) -> None:
    other = sorted(set(adapter.kinds()) - {"lora", "dora"})
    if other:
        raise AdapterError(f"the {fmt} format is written for LoRA and DoRA layers (diffusers loads no others); "
                           f"this adapter has {', '.join(other)} layers: export --format kohya (LyCORIS keys, "
                           "what ComfyUI, AUTOMATIC1111/Forge and kohya load)")


def lora_config_for(layers: Mapping[str, LoraLayer]):
    """A peft LoraConfig that recreates these layers (module paths without the component): the most
    common rank and alpha as r / lora_alpha, the others as exact (anchored) patterns."""
    from peft import LoraConfig

    ranks = Counter(layer.rank for layer in layers.values())
    alphas = Counter(layer.alpha for layer in layers.values())
    r = ranks.most_common(1)[0][0]
    alpha = alphas.most_common(1)[0][0]
    return LoraConfig(
        r=r, lora_alpha=alpha, target_modules=sorted(layers),
        rank_pattern=exact_patterns({m: lay.rank for m, lay in layers.items()}, r),
        alpha_pattern=exact_patterns({m: lay.alpha for m, lay in layers.items()}, alpha),
        use_dora=any(lay.magnitude is not None for lay in layers.values()),
        lora_bias=any(lay.bias is not None for lay in layers.values()),
    )


def apply_adapter(model: torch.nn.Module, adapter: Adapter, component: str = "unet",
                  adapter_name: str = "default") -> int:
    """Add the adapter's `component` layers to `model` with peft (as training does) and load their
    weights: for previews, comparisons and as the start of further training. Returns the layer count."""
    layers = adapter.component(component)
    if not layers:
        have = ", ".join(adapter.components()) or "none"
        raise AdapterError(f"the adapter has no {component} layers (it has: {have})")
    named = dict(model.named_modules())
    missing = [m for m in layers if m not in named]
    if missing:
        raise AdapterError(f"the {component} has no module {missing[0]!r} ({len(missing)} of {len(layers)} adapter "
                           "layers do not fit this model: was the adapter trained for another model?)")
    kind = _one_kind(layers, component)
    try:
        cfg = lora_config_for(layers) if kind == "lora" else lycoris.peft_config(kind, layers)
    except ValueError as e:
        raise AdapterError(f"the {component}'s {kind} layers cannot be rebuilt with peft: {e}; merge the adapter "
                           "into a checkpoint instead (sdxl-lora merge)") from None
    from diffusers.loaders.peft import PeftAdapterMixin

    if isinstance(model, PeftAdapterMixin):  # diffusers' integration: its own save/load helpers then work
        model.add_adapter(cfg, adapter_name=adapter_name)
    else:
        from peft import inject_adapter_in_model
        inject_adapter_in_model(cfg, model, adapter_name=adapter_name)
    named = dict(model.named_modules())
    with torch.no_grad():
        for m, layer in layers.items():
            mod = named[m]
            if kind != "lora":
                try:
                    lycoris.load_into(mod, layer, adapter_name)
                except ValueError as e:
                    raise AdapterError(f"{component}.{m}: {e}: the adapter was trained for another model") from None
                continue
            pairs = ((mod.lora_A[adapter_name].weight, layer.down), (mod.lora_B[adapter_name].weight, layer.up))
            for target, value in pairs:
                if target.shape != value.shape:
                    raise AdapterError(f"{component}.{m}: adapter weight has shape {list(value.shape)}, the model's "
                                       f"layer expects {list(target.shape)}: the adapter was trained for another model")
                target.copy_(value)
            if layer.magnitude is not None:
                w = mod.lora_magnitude_vector[adapter_name].weight
                w.copy_(layer.magnitude.reshape(w.shape))
            if layer.bias is not None:
                mod.lora_B[adapter_name].bias.copy_(layer.bias)
    return len(layers)


# --------------------------------------------------------------------------------------------
# Metadata


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


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


def _mixed_attention_alphas(adapter: Adapter) -> bool:
    # What diffusers' kohya loader gets wrong; it loads no LoHa/LoKr layer at all.
    return len({lay.alpha for k, lay in adapter.layers.items() if isinstance(lay, LoraLayer)
                and k.startswith("unet.") and re.search(r"\.attn\d\.", k)}) > 1


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


# --------------------------------------------------------------------------------------------
# Import


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise AdapterError(f"{path} is a pickle ({path.suffix}); pickles run code when loaded, so they are "
                           "refused: convert it to .safetensors with a tool you trust")
    if not path.exists():
        raise FileNotFoundError(f"adapter {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except Exception as e:  # safetensors raises its own error types
        raise AdapterError(f"{path} is not a valid safetensors file: {e}") from None


_KOHYA_SUFFIXES = ("lora_down.weight", "lora_up.weight", "alpha", "dora_scale")
_LYCORIS_HINTS = ("hada_", "lokr_", "oft_", "lora_mid", ".diff", ".w_norm", ".b_norm")


def _read_kohya(sd: dict[str, torch.Tensor], table: kohya.LayerTable, adapter: Adapter) -> set[str]:
    groups: dict[str, dict[str, str]] = {}
    for k in sd:
        if not k.startswith(tuple(p for p, _ in kohya.READ_PREFIXES)):
            continue
        name, _, suffix = k.partition(".")
        groups.setdefault(name, {})[suffix] = k
    used: set[str] = set()
    styles, no_alpha = set(), 0
    for name, parts in groups.items():
        where = table.lookup(name)
        lora = {"lora_down.weight", "lora_up.weight"} <= parts.keys()
        if where is not None and not lora and parts.keys() & set(lycoris.LOHA_KEYS + lycoris.LOKR_KEYS):
            comp, module = where
            alpha = float(sd[parts["alpha"]].float().item()) if "alpha" in parts else None
            if "dora_scale" in parts:
                continue  # DoRA over LoHa/LoKr: left unread, so it is reported as unknown
            try:
                layer = lycoris.from_keys({k: sd[v] for k, v in parts.items()}, alpha, table.shape(comp, module))
            except ValueError:
                continue  # a Tucker core or a half layer: its keys stay unknown, with the LyCORIS hint
            no_alpha += alpha is None
            adapter.layers[f"{comp}.{module}"] = layer
            used.update(parts[s] for s in ("alpha",) + lycoris.LOHA_KEYS + lycoris.LOKR_KEYS if s in parts)
        elif where is not None and lora:
            comp, module = where
            down, up = sd[parts["lora_down.weight"]], sd[parts["lora_up.weight"]]
            if "alpha" in parts:
                alpha = float(sd[parts["alpha"]].float().item())
            else:
                alpha, no_alpha = float(down.shape[0]), no_alpha + 1
            mag = sd[parts["dora_scale"]].reshape(-1) if "dora_scale" in parts else None
            adapter.layers[f"{comp}.{module}"] = LoraLayer(down, up, alpha, mag)
            used.update(parts[s] for s in _KOHYA_SUFFIXES if s in parts)
        else:
            continue
        if comp == "unet":
            sgm = re.match(r"lora_unet_(input_blocks|middle_block|output_blocks|out_|time_embed|label_emb)", name)
            styles.add("sgm" if sgm else "diffusers")
    if no_alpha:
        adapter.problems.append(f"{no_alpha} layers have no .alpha; taken as alpha = rank (scale 1), as kohya does")
    adapter.format = "kohya" + (" (diffusers block names)" if styles == {"diffusers"} else
                                " (mixed sgm and diffusers block names)" if len(styles) > 1 else "")
    return used


# A layer's parts under peft's names: LoRA's (as its files hold them) and LyCORIS' factors.
_PEFT_PARTS = ("lora_A.weight", "lora_B.weight", "lora_B.bias", "lora_magnitude_vector", "alpha",
               *lycoris.LOHA_KEYS, *lycoris.LOKR_KEYS)
_PEFT_KEY = re.compile(rf"^(.*)\.({'|'.join(re.escape(p) for p in _PEFT_PARTS)})$")


def peft_key_groups(keys, prefixes: Mapping[str, str], adapter_name: str | None = None) -> dict[tuple[str, str], dict[str, str]]:
    """Keys `<prefix><module>.<part>` (peft's part names, e.g. lora_A.weight, hada_w1_a) by (component, module):
    part -> key. `prefixes` maps a key prefix to its component, the longest first ("" takes the rest). With
    `adapter_name`, the keys are a peft model's parameter names, which hold it (`lora_A.default.weight`,
    `hada_w1_a.default`), read as its files name them."""
    order = sorted(prefixes, key=len, reverse=True)
    groups: dict[tuple[str, str], dict[str, str]] = {}
    for k in keys:
        prefix = next((p for p in order if k.startswith(p)), None)
        if prefix is None:
            continue
        name = k[len(prefix):]
        if adapter_name is not None:
            name = re.sub(rf"\.{re.escape(adapter_name)}(?=\.weight$|\.bias$|$)", "", name, count=1)
            name = name.removesuffix(".weight") if name.endswith(".lora_magnitude_vector.weight") else name
        m = _PEFT_KEY.match(name)
        if m:
            groups.setdefault((prefixes[prefix], m.group(1)), {})[m.group(2)] = k
    return groups


def _read_peft_keys(sd: dict[str, torch.Tensor], table: kohya.LayerTable, adapter: Adapter,
                    prefixes: Mapping[str, str], configs: Mapping[str, Mapping]) -> set[str]:
    """Keys `<prefix><module>.lora_A.weight` etc.; `prefixes` maps a key prefix to its component."""
    used: set[str] = set()
    groups = peft_key_groups(sd, prefixes)
    no_config = set()
    for (comp, module), parts in groups.items():
        if not {"lora_A.weight", "lora_B.weight"} <= parts.keys():
            continue
        if table.layers.get(comp) and module not in table.layers[comp]:
            continue
        down, up = sd[parts["lora_A.weight"]], sd[parts["lora_B.weight"]]
        cfg = configs.get(comp)
        if "alpha" in parts:
            alpha = float(sd[parts["alpha"]].float().item())
        elif cfg:
            r, alpha = _rank_alpha(cfg, module)
            if r is not None and r != down.shape[0]:
                adapter.problems.append(f"{comp}.{module}: lora_A has rank {down.shape[0]}, its config says {r}")
            alpha = alpha if alpha is not None else float(down.shape[0])
        else:
            alpha = float(down.shape[0])  # no config: diffusers and peft then use alpha = rank
            no_config.add(comp)
        mag = sd[parts["lora_magnitude_vector"]].reshape(-1) if "lora_magnitude_vector" in parts else None
        bias = sd[parts["lora_B.bias"]] if "lora_B.bias" in parts else None
        adapter.layers[f"{comp}.{module}"] = LoraLayer(down, up, alpha, mag, bias)
        used.update(parts.values())
    for comp in sorted(no_config):
        adapter.problems.append(f"no LoRA config for the {comp} in the file: alpha taken as rank (scale 1), "
                                "as diffusers does")
    return used


def _unpack_diffusers_config(meta: Mapping[str, str]) -> dict[str, dict]:
    raw = meta.get(DIFFUSERS_METADATA_KEY)
    if not raw:
        return {}
    try:
        packed = json.loads(raw)
    except json.JSONDecodeError:
        return {}
    out: dict[str, dict] = {}
    for k, v in packed.items():
        comp, _, field_ = k.partition(".")
        out.setdefault(comp, {})[field_] = v
    return out


def load_adapter(path: str | Path, model=None) -> Adapter:
    """Read a LoRA adapter file or folder in any supported format into an `Adapter`.

    Formats: kohya (sgm or diffusers block names; `lora_unet_`/`lora_te1_`/`lora_te2_`/`lora_te_`),
    diffusers (`unet.`/`text_encoder.`/`text_encoder_2.` + lora_A/lora_B, with or without its
    config), a PEFT folder or its adapter_model.safetensors. `model` says which model's layers the
    names refer to: a `kohya.LayerTable`, a pipeline, a diffusers SDXL folder (configs only), or None
    for SDXL base. Keys that name no layer of that model are listed in `unknown`, with a line in
    `problems`, and logged: nothing is dropped silently. Weights stay as stored (dtype, CPU).
    """
    path = Path(path)
    table = layer_table(model)
    peft_cfg = None
    if path.is_dir():
        if (path / PEFT_CONFIG_NAME).is_file():
            peft_cfg = json.loads((path / PEFT_CONFIG_NAME).read_text(encoding="utf-8"))
            path = path / PEFT_WEIGHTS_NAME
        elif (path / DIFFUSERS_WEIGHTS_NAME).is_file():
            path = path / DIFFUSERS_WEIGHTS_NAME
        else:
            raise AdapterError(f"{path} is a folder without {PEFT_CONFIG_NAME} (PEFT) or {DIFFUSERS_WEIGHTS_NAME} "
                               "(diffusers): give the adapter file")
    elif path.name == PEFT_WEIGHTS_NAME and (path.parent / PEFT_CONFIG_NAME).is_file():
        peft_cfg = json.loads((path.parent / PEFT_CONFIG_NAME).read_text(encoding="utf-8"))
    sd, meta = _read_safetensors(path)
    if not sd:
        raise AdapterError(f"{path} holds no tensors")
    if any(k.startswith(("model.diffusion_model.", "conditioner.embedders.")) for k in sd):
        raise AdapterError(f"{path} is a full SDXL checkpoint, not a LoRA adapter")
    adapter = Adapter({}, metadata=meta)
    used: set[str] = set()
    kinds = []
    if any(k.startswith(tuple(p for p, _ in kohya.READ_PREFIXES)) for k in sd):
        used |= _read_kohya(sd, table, adapter)
        kinds.append(adapter.format)
    if any(k.startswith(PEFT_PREFIX) for k in sd):
        comp = "unet"
        n = len(adapter.layers)
        used |= _read_peft_keys(sd, table, adapter, {PEFT_PREFIX: comp}, {comp: peft_cfg} if peft_cfg else {})
        if len(adapter.layers) > n:
            kinds.append("peft")
    diffusers_prefixes = {f"{c}.": c for c in kohya.COMPONENTS}
    if any(k.startswith(tuple(diffusers_prefixes)) for k in sd):
        n = len(adapter.layers)
        used |= _read_peft_keys(sd, table, adapter, diffusers_prefixes, _unpack_diffusers_config(meta))
        if len(adapter.layers) > n:
            kinds.append("diffusers")
    adapter.format = " + ".join(kinds) if kinds else "unknown"
    adapter.unknown = sorted(set(sd) - used)
    if adapter.unknown:
        lyco = [k for k in adapter.unknown if any(h in k for h in _LYCORIS_HINTS)]
        hint = (" (LyCORIS layers this tool does not read: OFT, Tucker cores, incomplete LoHa/LoKr layers or DoRA "
                "over them)" if lyco else
                " (layers of another model, or a format this tool does not read)")
        adapter.problems.insert(0, f"{len(adapter.unknown)} of {len(sd)} keys name no layer of the model{hint}, "
                                   f"e.g. {', '.join(adapter.unknown[:3])}")
        log.warning("%s: %s", path.name, adapter.problems[0])
    if not adapter.layers:
        raise AdapterError(f"{path}: no LoRA layer found for this model ({len(sd)} keys, e.g. {next(iter(sd))}); "
                           "is it a LoRA adapter for SDXL?")
    _check_shapes(adapter, table)
    return adapter


def layer_table(model=None) -> kohya.LayerTable:
    """The layers adapter names refer to, from a `kohya.LayerTable`, a pipeline, a UNet, a diffusers SDXL
    folder or "tiny-sdxl" (configs only, no weights read), or None / a single file (SDXL base's configs)."""
    if isinstance(model, kohya.LayerTable):
        return model
    if model is None or str(model) == "arch:sdxl":  # SDXL base's configs (model.ARCH_SDXL)
        return kohya.LayerTable.from_config_dir(None)
    if isinstance(model, (str, Path)):
        from ...core.config import ModelConfig
        from ..model import resolve_model_path

        p = resolve_model_path(ModelConfig(path=str(model)))
        if not p.exists():
            raise FileNotFoundError(f"model {p} does not exist; give a diffusers SDXL folder, a single-file "
                                    "checkpoint or 'tiny-sdxl'")
        # A single file carries no configs; it loads with SDXL base's, so its layers are those.
        return kohya.LayerTable.from_config_dir(p if p.is_dir() else None)
    if hasattr(model, "unet"):
        return kohya.LayerTable.from_pipeline(model)
    return kohya.LayerTable.from_models(model)


def _check_shapes(adapter: Adapter, table: kohya.LayerTable) -> None:
    bad, nonfinite = [], []
    for key, layer in adapter.layers.items():
        comp, module = key.split(".", 1)
        shape = table.shape(comp, module)
        if not isinstance(layer, LoraLayer):
            if shape is not None and layer.update_numel() != math.prod(shape):
                bad.append(f"{key}: the {layer.kind} update has {layer.update_numel()} entries, the layer "
                           f"{list(shape)}")
            if not layer.finite():
                nonfinite.append(key)
            continue
        if layer.up.shape[1] != layer.down.shape[0]:
            bad.append(f"{key}: up has rank {layer.up.shape[1]}, down {layer.down.shape[0]}")
        elif layer.magnitude is not None and layer.magnitude.numel() != layer.up.shape[0]:
            bad.append(f"{key}: its DoRA scale has {layer.magnitude.numel()} entries, not one per output "
                       f"({layer.up.shape[0]}): input-axis DoRA is not supported")
        elif shape is not None and (layer.up.shape[0] != shape[0] or tuple(layer.down.shape[1:]) != tuple(shape[1:])):
            bad.append(f"{key}: the update is {layer.up.shape[0]}x{list(layer.down.shape[1:])}, the layer "
                       f"{shape[0]}x{list(shape[1:])}")
        if not (torch.isfinite(layer.down).all() and torch.isfinite(layer.up).all()):
            nonfinite.append(key)
    if bad:
        adapter.problems.append(f"{len(bad)} layers do not fit the model's shapes (another base model?), e.g. {bad[0]}")
    if nonfinite:
        adapter.problems.append(f"{len(nonfinite)} layers hold NaN or infinite weights, e.g. {nonfinite[0]}")


# --------------------------------------------------------------------------------------------
# Inspect

_BLOCK = re.compile(r"^((?:down_blocks|up_blocks)\.\d+\.[a-z_]+\.\d+|mid_block\.[a-z_]+\.\d+|[^.]+)")
_CROSS_WIDTHS = {2048: "SDXL", 768: "SD 1.x", 1024: "SD 2.x"}


def _base_model(adapter: Adapter, table: kohya.LayerTable | None = None) -> tuple[str, list[str]]:
    """What the adapter says and shows it was trained on, and its problems for the model of `table` (SDXL
    base when none): cross-attention layers of another width will not load onto that model."""
    meta, problems = adapter.metadata, []
    want = int((table.unet_config if table is not None else {}).get("cross_attention_dim") or 2048)
    said = [f"{k}={meta[k]}" for k in ("ss_base_model_version", "modelspec.architecture") if meta.get(k)]
    widths = sorted({int(lay.update_shape[1]) for k, lay in adapter.layers.items()
                     if k.startswith("unet.") and k.endswith(".attn2.to_k")})
    from_shapes = ", ".join(f"{_CROSS_WIDTHS.get(w, 'unknown')} (cross-attention width {w})" for w in widths)
    if not said and adapter.format.startswith("kohya"):
        problems.append("no ss_base_model_version or modelspec.architecture: AUTOMATIC1111/Forge cannot tell it "
                        "is an SDXL LoRA and may hide it")
    elif said and not any("sdxl" in s or "stable-diffusion-xl" in s for s in said):
        problems.append(f"its metadata says {', '.join(said)}, not SDXL")
    if widths and widths != [want]:
        model, onto = ("SDXL", "SDXL base") if want == 2048 else ("the model it is checked against", "that model")
        problems.append(f"its cross-attention layers take {'/'.join(map(str, widths))}-wide text embeddings; "
                        f"{model}'s take {want}: it will not load onto {onto}")
    text = "; ".join(x for x in (", ".join(said), f"from the layer shapes: {from_shapes}" if from_shapes else "") if x)
    return text or "unknown", problems


def _span(values) -> str:
    # LoKr layers with no factored part have no rank: "full"
    vals = sorted({"full" if v is None else v for v in values}, key=lambda v: (isinstance(v, str), v))
    return ", ".join(v if isinstance(v, str) else _num(v) for v in vals)


# What each kind is called where users meet it; which tools read a file of it right is sdxl/formats/loaders.py's table.
KIND_NAMES = {"lora": "LoRA", "dora": "DoRA (LoRA + magnitude)", "loha": "LoHa (LyCORIS)", "lokr": "LoKr (LyCORIS)"}
# For a file in diffusers' or PEFT's format, which the tools' table (about kohya files) does not cover.
OTHER_FORMAT_TOOLS = ("diffusers' load_lora_weights and peft read this format; for ComfyUI, AUTOMATIC1111/Forge, "
                      "kohya, LyCORIS and InvokeAI export it with --format kohya (LoRA and DoRA only)")


def describe_adapter(adapter: Adapter, table: kohya.LayerTable | None = None, title: str = "",
                     tools: Sequence[str] = ()) -> str:
    """A plain-text report: format, kind, the tools that load it (`tools`: sdxl/formats/loaders.py's line per kind),
    base model, per-block rank and alpha, metadata, problems."""
    from .single_file import unet_diffusers_to_sgm

    table = table or kohya.LayerTable.from_config_dir(None)
    unet_map = unet_diffusers_to_sgm(table.unet_config)
    base, problems = _base_model(adapter, table)
    problems = list(adapter.problems) + problems
    if adapter.format.startswith("kohya") and _mixed_attention_alphas(adapter):
        problems.append("its attention layers have different alphas: right in AUTOMATIC1111/Forge, ComfyUI and "
                        "kohya, but diffusers' kohya loader applies one alpha to all of them (re-export it with "
                        "`sdxl-lora export --format kohya` for diffusers)")
    counts = Counter(k.split(".", 1)[0] for k in adapter.layers)
    lines = [f"adapter    : {title}" if title else None,
             f"format     : {adapter.format}",
             f"kind       : {', '.join(KIND_NAMES[k] for k in adapter.kinds())}",
             *(f"tools      : {line}" for line in tools),
             f"base model : {base}",
             f"layers     : {len(adapter.layers)} ({', '.join(f'{c} {n}' for c, n in sorted(counts.items()))})",
             f"rank       : {_span(lay.rank for lay in adapter.layers.values())}",
             f"alpha      : {_span(lay.alpha for lay in adapter.layers.values())}"]
    if any(lay.magnitude is not None for lay in adapter.layers.values()):
        lines.append("dora       : yes (magnitude vectors present)")
    if any(lay.bias is not None for lay in adapter.layers.values()):
        lines.append("lora bias  : yes (up projections have a bias)")
    blocks: dict[tuple[str, str], list[LoraLayer]] = {}
    order: dict[tuple[str, str], int] = {}
    for key, layer in adapter.layers.items():
        comp, module = key.split(".", 1)
        if comp == "unet":
            block = _BLOCK.match(module).group(1)
            sgm = unet_map.get(block, "?")
        else:
            block, sgm = comp, kohya.PREFIX[comp].strip("_")
        blocks.setdefault((sgm, block), []).append(layer)
    sgm_order = ["time_embed", "label_emb", "input_blocks", "middle_block", "output_blocks", "out", "lora_te"]
    for i, name in enumerate(sgm_order):
        for b in blocks:
            if b[0].startswith(name) and b not in order:
                order[b] = i

    def sort_key(b):
        return (order.get(b, 99), [int(p) if p.isdigit() else 0 for p in b[0].split(".")], b)
    lines.append("blocks (sgm name / diffusers name: layers, rank, alpha):")
    w = max((len(s) for s, _ in blocks), default=0)
    w2 = max((len(d) for _, d in blocks), default=0)
    for b in sorted(blocks, key=sort_key):
        ls = blocks[b]
        lines.append(f"  {b[0]:<{w}}  {b[1]:<{w2}}  {len(ls):>4} layers  rank {_span(x.rank for x in ls)}  "
                     f"alpha {_span(x.alpha for x in ls)}")
    lines.append("metadata:" if adapter.metadata else "metadata   : none")
    for k in sorted(adapter.metadata):
        v = adapter.metadata[k].replace("\n", " ")
        lines.append(f"  {k} = {v if len(v) <= 160 else v[:157] + '...'}")
    lines.append("problems   : none" if not problems else "problems:")
    lines.extend(f"  - {p}" for p in problems)
    return "\n".join(x for x in lines if x is not None)


def inspect_adapter(path: str | Path, model=None) -> tuple[Adapter, str]:
    """Read an adapter (see `load_adapter`) and describe it."""
    from .loaders import file_notes

    table = layer_table(model)
    adapter = load_adapter(path, table)
    path = Path(path)
    tools = file_notes(path) if path.is_file() and adapter.format.startswith("kohya") else [OTHER_FORMAT_TOOLS]
    return adapter, describe_adapter(adapter, table, title=path.name, tools=tools)

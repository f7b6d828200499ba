"""Adapters in memory: an `Adapter` holds its layers by diffusers module path with the component in front
(`unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`), each with its down and up weights and its
true alpha (the layer adds alpha / rank * up @ down), whatever file it came from. Taken from a model with peft's
layers (`adapter_from_model`) or put into one (`apply_adapter`); export.py writes it, read.py reads it back.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import lycoris
from .lycoris import LohaLayer, LokrLayer
from ...core.fsutil import check_destination
from ...core.inject import exact_patterns

# diffusers reads the LoRA config (ranks, alphas, targets) from this metadata key when it loads a file,
# so mixed ranks and alpha != rank survive the trip.
DIFFUSERS_METADATA_KEY = "lora_adapter_metadata"
FORMATS = ("kohya", "diffusers", "peft")
PEFT_CONFIG_NAME = "adapter_config.json"
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"
DIFFUSERS_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
PEFT_PREFIX = "base_model.model."
PICKLE_SUFFIXES = {".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle"}


class AdapterError(ValueError):
    """An adapter file or folder cannot be read or written as asked; the message says why and what to do."""


class ExportExistsError(FileExistsError):
    pass


def check_dest(path: str | Path, overwrite: bool, reads: Iterable[str | Path | None] = (), reader: str = "the export",
               error: type[Exception] = AdapterError) -> None:
    """core.fsutil.check_destination with this package's errors: every writer in export.py passes it, and
    callers that want the refusal before long work (extract, merge, resize) call it first. Never over what the result is
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


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _mixed_attention_alphas(adapter: Adapter) -> bool:
    # What diffusers' kohya loader gets wrong; it loads no LoHa/LoKr layer at all.
    return len({lay.alpha for k, lay in adapter.layers.items() if isinstance(lay, LoraLayer)
                and k.startswith("unet.") and re.search(r"\.attn\d\.", k)}) > 1

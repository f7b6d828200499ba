"""Adapter files read back (import): a kohya/LyCORIS file, a diffusers file or a PEFT folder into an `Adapter`,
its layer names matched against the model's (`layer_table`), with what does not fit reported as problems."""
from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from . import kohya, lycoris
from .adapter import (DIFFUSERS_METADATA_KEY, DIFFUSERS_WEIGHTS_NAME, PEFT_CONFIG_NAME, PEFT_PREFIX,
                      PEFT_WEIGHTS_NAME, PICKLE_SUFFIXES, Adapter, AdapterError, LoraLayer, _rank_alpha)

log = logging.getLogger(__name__)


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
        from ..config import ModelConfig
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

"""Where each layer of the SDXL UNet sits, for the injector (core/inject.py): down/mid/up level, kohya's
block id, self or cross attention, feed-forward, ResNet convolution, which projection; and what each preset
weights (docs/injector.md says why). `make_plan` is the one way the CLI, the UI and the task plan a UNet."""
from __future__ import annotations

import re

from torch import nn

from ..core import inject
from .config import AdapterConfig
from ..core.inject import Plan, Slot, layer_slot, unknown_preset

# Projections of an attention block, in the names diffusers uses.
ATTN_PROJ = ("to_q", "to_k", "to_v", "to_out.0")

# The `topology` preset: rank multipliers by (attention kind, projection). Reasons in docs/injector.md.
TOPOLOGY_PROJ = {
    ("attn2", "to_q"): 1.0, ("attn2", "to_k"): 0.5, ("attn2", "to_v"): 1.0, ("attn2", "to_out.0"): 0.5,
    ("attn1", "to_q"): 0.5, ("attn1", "to_k"): 0.5, ("attn1", "to_v"): 0.75, ("attn1", "to_out.0"): 0.5,
}
# ... and by level: the deepest level and the mid block (lowest resolution, most semantic) get the
# full rank; higher-resolution levels, which mostly carry texture and detail, three quarters.
TOPOLOGY_DEEP, TOPOLOGY_SHALLOW = 1.0, 0.75

_PART = re.compile(r"^(down_blocks|mid_block|up_blocks)(?:\.(\d+))?")


def _kohya_blocks(model: nn.Module) -> dict[str, str]:
    """diffusers UNet module prefix -> kohya block id (IN04, MID, OUT03...), from the sgm layout."""
    config = getattr(model, "config", None)
    if config is None or "down_block_types" not in config:
        return {}
    from .formats.single_file import SingleFileError, unet_diffusers_to_sgm

    try:
        mapping = unet_diffusers_to_sgm(dict(config))
    except SingleFileError:
        return {}
    out = {}
    for diff, sgm in mapping.items():
        m = re.match(r"^(input_blocks|middle_block|output_blocks)\.?(\d+)?", sgm)
        if not m:
            continue
        kind, idx = m.group(1), m.group(2)
        out[diff] = "MID" if kind == "middle_block" else f"{'IN' if kind == 'input_blocks' else 'OUT'}{int(idx):02d}"
    return out


def _lookup_block(name: str, blocks: dict[str, str]) -> str:
    # Longest mapped prefix of the module path.
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        b = blocks.get(".".join(parts[:i]))
        if b:
            return b
    return ""


def _classify(name: str, module: nn.Module, n_levels: int, blocks: dict[str, str]) -> Slot | None:
    leaf = name.rsplit(".", 1)[-1]
    m = _PART.match(name)
    if m:
        part = {"down_blocks": "down", "mid_block": "mid", "up_blocks": "up"}[m.group(1)]
        index = int(m.group(2)) if m.group(2) is not None else None
        level = {"down": index, "up": None if index is None else n_levels - 1 - index, "mid": n_levels - 1}[part]
    else:
        part, index, level = "other", None, None
    if ".attn1." in name or ".attn2." in name:
        kind = "attn1" if ".attn1." in name else "attn2"
        proj = name.split(f".{kind}.", 1)[1]
    elif ".ff." in name:
        kind, proj = "ff", name.split(".ff.", 1)[1]
    elif leaf in ("proj_in", "proj_out"):
        kind, proj = "proj", leaf
    elif ".resnets." in name:
        kind, proj = "resnet", leaf
    elif name.startswith(("time_embedding", "add_embedding")):
        kind, proj = "embed", leaf
    else:
        kind, proj = "other", leaf
    return layer_slot(name, module, part=part, index=index, level=level, block=_lookup_block(name, blocks),
                      kind=kind, proj=proj)


class UNetTopology:
    """The injector's topology of a diffusers UNet2DConditionModel (SDXL's and the tiny one's)."""

    def slots(self, model: nn.Module) -> list[Slot]:
        """Every Linear/Conv2d of the UNet, classified. Works on the meta device (no weights needed)."""
        config = getattr(model, "config", None)
        n_levels = len(config["down_block_types"]) if config is not None and "down_block_types" in config else 0
        blocks = _kohya_blocks(model)
        return [s for name, module in model.named_modules()
                if (s := _classify(name, module, n_levels, blocks)) is not None]

    def weight(self, s: Slot, preset: str, deepest: int | None) -> float:
        """The preset's rank multiplier for a slot; 0 leaves it out."""
        attn = s.kind in ("attn1", "attn2") and s.proj in ATTN_PROJ
        if preset == "attn":
            return 1.0 if attn else 0.0
        if preset == "cross-attn":
            return 1.0 if attn and s.kind == "attn2" else 0.0
        if preset == "topology":
            if not attn:
                return 0.0
            level = TOPOLOGY_DEEP if s.level is None or s.level == deepest else TOPOLOGY_SHALLOW
            return TOPOLOGY_PROJ[(s.kind, s.proj)] * level
        if preset == "full":
            return 1.0 if s.kind in ("attn1", "attn2", "ff", "proj") and not s.conv else 0.0
        if preset == "locon":  # full, and the ResNets' convolutions (at adapter.conv_rank: inject.make_plan)
            return 1.0 if (s.kind in ("attn1", "attn2", "ff", "proj") and not s.conv) or (
                s.kind == "resnet" and s.conv) else 0.0
        raise unknown_preset(preset)


UNET = UNetTopology()


def slots(unet: nn.Module) -> list[Slot]:
    return UNET.slots(unet)


def make_plan(unet: nn.Module, cfg: AdapterConfig, resolution: int | None = None, native: int | None = None) -> Plan:
    """The UNet's adapter plan: ranks scaled from the model's `native` resolution to `resolution`."""
    return inject.make_plan(unet, cfg, UNET, resolution=resolution, native=native,
                            scale_with_resolution=cfg.scale_rank_with_resolution, conv_rank=cfg.conv_rank,
                            conv_alpha=cfg.conv_alpha)

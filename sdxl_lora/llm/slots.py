"""Where each layer of a transformers causal LM sits, for the injector (core/inject.py): the decoder layer's
index and its projection (q/k/v/o of the attention, gate/up/down of the MLP); and what each preset weights.
`make_plan` is the one way the CLI and the task plan a causal LM."""
from __future__ import annotations

import re

from torch import nn

from ..core import inject
from .config import AdapterConfig
from ..core.inject import Plan, Slot, layer_slot, unknown_preset

# The projections of a decoder layer, in transformers' names, and the slot's short name. Phi-3 fuses q/k/v
# into one qkv_proj and gate/up into one gate_up_proj: each is a slot of its own.
LLM_PROJ = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "qkv_proj": "qkv",
            "gate_proj": "gate", "up_proj": "up", "down_proj": "down", "gate_up_proj": "gate_up"}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
# The `topology` preset: attention and MLP alike; v and o a little higher than q and k. A fused projection
# gets the weight of its parts' middle (qkv: q's 0.75 between k's 0.5 and v's 1).
TOPOLOGY_LLM = {"q": 0.75, "k": 0.5, "v": 1.0, "o": 1.0, "qkv": 0.75,
                "gate": 0.75, "up": 0.75, "down": 1.0, "gate_up": 0.75}

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class DecoderTopology:
    """The injector's topology of a decoder-only LM: its layers' projections as slots of part "layer";
    every other Linear (the head, say) is a slot of part "other" that only an override selects."""

    def slots(self, model: nn.Module) -> list[Slot]:
        out = []
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            layer = _LAYER.search(name)
            if layer and leaf in LLM_PROJ:
                s = layer_slot(name, module, part="layer", index=int(layer.group(1)),
                               kind="attn" if leaf in ATTENTION else "mlp", proj=LLM_PROJ[leaf])
            else:
                s = layer_slot(name, module)
            if s is not None:
                out.append(s)
        return out

    def weight(self, s: Slot, preset: str, deepest: int | None) -> float:
        if preset not in inject.PRESETS:
            raise unknown_preset(preset)
        if preset == "locon":
            raise ValueError("adapter.preset='locon' adds the UNet's convolutions; a causal LM has none: use "
                             "'full' (every projection) for the LLM task")
        if s.part != "layer":
            return 0.0
        if preset in ("attn", "cross-attn"):
            return 1.0 if s.kind == "attn" else 0.0
        if preset == "topology":
            return TOPOLOGY_LLM.get(s.proj, 0.0)
        return 1.0  # full


DECODER = DecoderTopology()


def slots(model: nn.Module) -> list[Slot]:
    return DECODER.slots(model)


def make_plan(model: nn.Module, cfg: AdapterConfig) -> Plan:
    """The LM's adapter plan (LMs have no training resolution: the base rank is used as it is)."""
    return inject.make_plan(model, cfg, DECODER, init=cfg.init)

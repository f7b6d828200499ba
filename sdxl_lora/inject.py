"""The injector: classify every candidate layer of a model into a slot, turn a policy into a plan, apply it with peft.

A slot says where a layer sits in the model's topology (for the SDXL UNet: down/mid/up level,
self or cross attention, which projection), so a policy can say "cross-attention q and v" instead
of listing module names. The injector walks the model; no module list is typed by hand.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from .config import AdapterConfig

# Projections of an attention block, in the names diffusers and transformers use.
ATTN_PROJ = ("to_q", "to_k", "to_v", "to_out.0")


@dataclass(frozen=True)
class Slot:
    name: str            # full module path, e.g. "down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_q"
    part: str            # "down" | "mid" | "up" | "other"
    block: int | None    # block index within its part (level for down/up)
    kind: str            # "attn1" (self) | "attn2" (cross) | "ff" | "proj" | "resnet" | "embed" | "other"
    proj: str            # "to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "proj_in", "conv1", ...
    in_features: int
    out_features: int
    conv: bool = False

    def params_at_rank(self, rank: int) -> int:
        if self.conv:
            return rank * (self.in_features + self.out_features)  # 1x1 LoRA on convs' flattened kernels
        return rank * (self.in_features + self.out_features)


_PART = re.compile(r"^(down_blocks|mid_block|up_blocks)(?:\.(\d+))?")


def _classify(name: str, module: nn.Module) -> Slot | None:
    if isinstance(module, nn.Linear):
        fin, fout, conv = module.in_features, module.out_features, False
    elif isinstance(module, nn.Conv2d):
        fin, fout, conv = module.in_channels * module.kernel_size[0] * module.kernel_size[1], module.out_channels, True
    else:
        return None
    m = _PART.match(name)
    if m:
        part = {"down_blocks": "down", "mid_block": "mid", "up_blocks": "up"}[m.group(1)]
        block = int(m.group(2)) if m.group(2) is not None else 0
    else:
        part, block = "other", None
    leaf = name.rsplit(".", 1)[-1]
    if ".attn1." in name or ".attn2." in name:
        kind = "attn1" if ".attn1." in name else "attn2"
        proj = name.split(f".{kind}.", 1)[1]
    elif ".ff." in name:
        kind, proj = "ff", name.split(".ff.", 1)[1]
    elif leaf in ("proj_in", "proj_out"):
        kind, proj = "proj", leaf
    elif ".resnets." in name:
        kind, proj = "resnet", leaf
    elif "embedding" in name or name.startswith(("time_embedding", "add_embedding")):
        kind, proj = "embed", leaf
    else:
        kind, proj = "other", leaf
    return Slot(name, part, block, kind, proj, fin, fout, conv)


def slots(model: nn.Module) -> list[Slot]:
    """Every Linear/Conv2d of the model, classified."""
    out = []
    for name, module in model.named_modules():
        s = _classify(name, module)
        if s is not None:
            out.append(s)
    return out


def select(all_slots: list[Slot], preset: str) -> list[Slot]:
    if preset == "attn":
        return [s for s in all_slots if s.kind in ("attn1", "attn2") and s.proj in ATTN_PROJ]
    if preset == "cross-attn":
        return [s for s in all_slots if s.kind == "attn2" and s.proj in ATTN_PROJ]
    if preset == "full":
        return [s for s in all_slots if s.kind in ("attn1", "attn2", "ff", "proj") and not s.conv]
    raise ValueError(f"adapter.preset={preset!r}: must be one of 'attn', 'cross-attn', 'full'")


@dataclass
class Plan:
    targets: list[Slot]
    rank: dict[str, int] = field(default_factory=dict)
    alpha: dict[str, float] = field(default_factory=dict)

    @property
    def trainable_params(self) -> int:
        return sum(s.params_at_rank(self.rank[s.name]) for s in self.targets)

    def lora_config(self, dropout: float = 0.0):
        from peft import LoraConfig

        ranks = sorted(set(self.rank.values()))
        base_r = ranks[0] if ranks else 1
        base_alpha = next((self.alpha[s.name] for s in self.targets if self.rank[s.name] == base_r), base_r)
        # Anchored full-path regexes: peft matches a list entry by suffix, which could catch a deeper
        # module of the same tail; an exact pattern per module cannot.
        return LoraConfig(
            r=base_r, lora_alpha=base_alpha, lora_dropout=dropout, init_lora_weights="gaussian",
            target_modules=[s.name for s in self.targets],
            rank_pattern={f"^{re.escape(s.name)}$": r for s in self.targets if (r := self.rank[s.name]) != base_r},
            alpha_pattern={f"^{re.escape(s.name)}$": a for s in self.targets
                           if (a := self.alpha[s.name]) != base_alpha},
        )


def make_plan(model: nn.Module, cfg: AdapterConfig) -> Plan:
    targets = select(slots(model), cfg.preset)
    if not targets:
        raise ValueError(f"adapter.preset={cfg.preset!r} matched no layer of {type(model).__name__}")
    alpha = cfg.alpha if cfg.alpha is not None else float(cfg.rank)
    return Plan(targets, {s.name: cfg.rank for s in targets}, {s.name: alpha for s in targets})


def apply_plan(model: nn.Module, plan: Plan, dropout: float = 0.0, adapter_name: str = "default") -> None:
    """Freeze the model and add the planned LoRA layers (through diffusers' peft integration when the
    model has it, so diffusers' own save/load helpers understand the result)."""
    model.requires_grad_(False)
    lcfg = plan.lora_config(dropout)
    if hasattr(model, "add_adapter"):
        model.add_adapter(lcfg, adapter_name=adapter_name)
    else:
        from peft import inject_adapter_in_model
        inject_adapter_in_model(lcfg, model, adapter_name=adapter_name)
    # Adapters train in fp32 whatever the base's dtype: bf16 LoRA weights lose small updates.
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()
            p.requires_grad_(True)


def trainable_parameters(model: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]

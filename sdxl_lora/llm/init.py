"""Adapter initialisations other than peft's default (adapter.init) for the LLM task: LoftQ's A and B set
after injection on a 4-bit base, and PiSSA/OLoRA adapters written as a plain LoRA of the original base.

PiSSA and OLoRA move part of each weight into A and B at injection (peft changes the base weight to the
residual W - s B0 A0), so the trained A, B only fit that residual. The export appends the initial factors
with B negated (peft's own conversion, `path_initial_model_for_weight_conversion`): at twice the rank,
W + s (B A - B0 A0) = W_res + s B A, which loads on the original base. LoftQ leaves the base as loaded
(quantized) and exports as any LoRA."""
from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from ..core.inject import Plan


@torch.no_grad()
def loftq(model: nn.Module, plan: Plan, model_path: Path, adapter_name: str = "default") -> None:
    """LoftQ with one iteration: each adapted 4-bit layer's B A (times its scale) becomes the best rank-r
    approximation of the error its quantization made (original weight from the safetensors minus the
    dequantized one), so the model starts closer to the full-precision base."""
    from safetensors import safe_open

    from ..core.quantize import dequantize_weight
    from ..core.weights import weight_files

    where = {}
    for f in weight_files(Path(model_path), "model"):
        with safe_open(str(f), "pt") as fh:
            where.update(dict.fromkeys(fh.keys(), f))
    for s in plan.targets:
        layer = model.get_submodule(s.name)
        key = f"{s.name}.weight"
        with safe_open(str(where[key]), "pt") as fh:
            original = fh.get_tensor(key).float()
        base = layer.base_layer
        error = original.to(base.weight.device) - dequantize_weight(base)
        u, sv, vh = torch.linalg.svd(error, full_matrices=False)
        r, scale = layer.r[adapter_name], layer.scaling[adapter_name]
        root = (sv[:r] / scale).sqrt()
        layer.lora_B[adapter_name].weight.copy_(u[:, :r] * root)
        layer.lora_A[adapter_name].weight.copy_(root[:, None] * vh[:r])


def initial_factors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy (fp32, CPU) of the adapter's factors as injected: what a PiSSA/OLoRA export subtracts."""
    return {k: v.detach().to("cpu", torch.float32).clone() for k, v in state.items()
            if ".lora_A." in k or ".lora_B." in k}


def as_plain_lora(state: dict[str, torch.Tensor], initial: dict[str, torch.Tensor],
                  config: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """The trained PiSSA/OLoRA state and peft config as a LoRA of the original base (twice the rank)."""
    out = dict(state)
    for k, v in state.items():
        if ".lora_A." in k:
            out[k] = torch.cat([v, initial[k].to(v)], dim=0)
        elif ".lora_B." in k:
            out[k] = torch.cat([v, -initial[k].to(v)], dim=1)
    # s = alpha / r (or alpha / sqrt(r) with rsLoRA) stays the same at rank 2r.
    grow = math.sqrt(2) if config.get("use_rslora") else 2.0
    config = {**config, "r": 2 * config["r"], "lora_alpha": grow * config["lora_alpha"], "init_lora_weights": True,
              "rank_pattern": {k: 2 * v for k, v in (config.get("rank_pattern") or {}).items()},
              "alpha_pattern": {k: grow * v for k, v in (config.get("alpha_pattern") or {}).items()}}
    return out, config

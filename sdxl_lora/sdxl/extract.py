"""Extract a LoRA from a fine-tuned SDXL: each layer's difference from its base, factored by SVD and cut to a rank.

What a user of a full fine-tune (or of a checkpoint someone merged) does to get a small file that moves the
base the same way, as kohya's extraction script does. The layers are those a trained adapter of the chosen
preset would hold (`locon`: attention, feed-forward, proj_in/out and the ResNet convolutions), and the text
encoders' attention and MLP linears; layers where the two models are equal are left out. The update each
layer gets is the closest one of its rank to the difference (Eckart-Young), and the summary says how much of
each difference that rank kept."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from .export import Adapter, AdapterError
from .resize import LayerResize, Resized, check_method, truncated

log = logging.getLogger(__name__)

# The text encoders' layers a LoRA for them holds (kohya targets CLIP's attention and MLP).
TE_LAYERS = (".self_attn.q_proj", ".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.out_proj", ".mlp.fc1",
             ".mlp.fc2")


def _pipeline(model: str | Path, tokenizer: str | Path | None):
    """The model as a pipeline in the dtype it is stored in (two SDXL models in fp32 would take 20 GB)."""
    from ..core.config import ModelConfig
    from .merge import source_dtype
    from .model import load_pipeline, resolve_model_path

    mcfg = ModelConfig(path=str(model), tokenizer=str(tokenizer) if tokenizer else None)
    return load_pipeline(mcfg, torch_dtype=source_dtype(resolve_model_path(mcfg)))


def _targets(pipe, preset: str, text_encoders: bool) -> dict[str, torch.nn.Module]:
    """"unet.<path>" / "text_encoder.<path>" -> the base's module, for every layer the extraction considers."""
    from ..core.config import AdapterConfig
    from . import slots as unet_slots

    named = dict(pipe.unet.named_modules())
    plan = unet_slots.make_plan(pipe.unet, AdapterConfig(preset=preset))
    out = {f"unet.{s.name}": named[s.name] for s in plan.targets}
    if text_encoders:
        for comp in ("text_encoder", "text_encoder_2"):
            te = getattr(pipe, comp, None)
            if te is None:
                continue
            for name, mod in te.named_modules():
                if isinstance(mod, torch.nn.Linear) and name.endswith(TE_LAYERS):
                    out[f"{comp}.{name}"] = mod
    return out


def _modules(pipe) -> dict[str, torch.nn.Module]:
    """"unet.<path>" / "text_encoder.<path>" / "text_encoder_2.<path>" -> every module of the pipeline's models."""
    out = {}
    for comp in ("unet", "text_encoder", "text_encoder_2"):
        owner = getattr(pipe, comp, None)
        if owner is not None:
            out.update({f"{comp}.{name}": mod for name, mod in owner.named_modules()})
    return out


def extract_adapter(base: str | Path, tuned: str | Path, rank: int, *, conv_rank: int | None = None,
                    preset: str = "locon", method: str | None = None, param: float | None = None,
                    text_encoders: bool = True, min_diff: float = 0.0, tokenizer: str | Path | None = None,
                    device: str | torch.device = "cpu", progress=None) -> Resized:
    """The LoRA that takes `base` towards `tuned` (both an SDXL diffusers folder, single file or built-in name):
    linears at `rank`, convolutions at `conv_rank` (default `rank`), each at most that with a dynamic `method`.
    A layer whose difference is at most `min_diff` times its base weight's norm (0: exactly equal) is left out.
    `progress(i, n)` is called after each layer considered."""
    if rank < 1 or (conv_rank is not None and conv_rank < 1):
        raise AdapterError(f"rank={rank}, conv_rank={conv_rank}: each must be 1 or more")
    check_method(method, param)
    if min_diff < 0:
        raise AdapterError(f"min_diff={min_diff}: must be 0 or more")
    if Path(str(base)).resolve() == Path(str(tuned)).resolve():
        raise AdapterError(f"--base and --tuned are the same model ({base}): there is no difference to extract")
    pipe_b, pipe_t = _pipeline(base, tokenizer), _pipeline(tuned, tokenizer)
    targets, tuned_modules = _targets(pipe_b, preset, text_encoders), _modules(pipe_t)
    dev = torch.device(device)
    layers, rows, same = {}, [], 0
    for i, (key, mod_b) in enumerate(sorted(targets.items())):
        mod_t = tuned_modules.get(key)
        if mod_t is None or mod_t.weight.shape != mod_b.weight.shape:
            got = "no such layer" if mod_t is None else f"shape {tuple(mod_t.weight.shape)}"
            raise AdapterError(f"{tuned}: layer {key} has {got}, the base {tuple(mod_b.weight.shape)}: the two "
                               "models are not the same architecture")
        w = mod_b.weight.detach().to(dev, torch.float32)
        diff = mod_t.weight.detach().to(dev, torch.float32) - w
        norm = float(diff.norm())
        if norm == 0 or norm <= min_diff * float(w.norm()):
            same += 1
        else:
            u, s, vh = torch.linalg.svd(diff.flatten(1), full_matrices=False)
            r = conv_rank if (diff.dim() == 4 and conv_rank is not None) else rank
            layers[key], row = truncated(u, s, vh, tuple(diff.shape), r, method, param)
            rows.append(dataclasses.replace(row, name=key))
        if progress is not None:
            progress(i + 1, len(targets))
    if not layers:
        hint = f", or lower min_diff ({min_diff})" if min_diff else ""
        raise AdapterError(f"{tuned} does not differ from {base} in any of the {len(targets)} layers a {preset} "
                           f"LoRA holds: check the two paths{hint}")
    log.info("extracted %d layers; %d equal in both models left out", len(layers), same)
    meta = {"ss_sd_model_name": Path(str(base)).name, "sdxl_lora.extracted_from": Path(str(tuned)).name}
    return Resized(Adapter(layers, metadata=meta), rows)

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
from .resize import Resized, check_method, truncated

log = logging.getLogger(__name__)

# The text encoders' layers a LoRA for them holds (kohya targets CLIP's attention and MLP).
TE_LAYERS = (".self_attn.q_proj", ".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.out_proj", ".mlp.fc1",
             ".mlp.fc2")
_READ = ("unet", "text_encoder", "text_encoder_2")


class _Weights:
    """One model's UNet and text-encoder tensors, read one at a time from its safetensors files: a diffusers
    folder's component files, or a single-file checkpoint's original-layout keys (`single_file.sgm_source`).
    Loading both pipelines whole would hold two SDXL models in memory; here only the layer at hand is. Each
    read opens the file and closes it again, so the pages safetensors maps are not kept by the process."""

    def __init__(self, model: str | Path, role: str):
        from ...core.weights import header_shapes, read_json, weight_files
        from ..config import ModelConfig
        from ..model import COMPONENTS, check_folder, resolve_model_path, single_file_configs
        from .single_file import SDXL_BASE_CONFIG_DIR, check_single_file, unet_diffusers_to_sgm

        cfg = ModelConfig(path=str(model))
        self.path = resolve_model_path(cfg)
        if not self.path.exists():
            raise AdapterError(f"{role} {model}: no such file or folder; give a diffusers SDXL folder, a single-file "
                               ".safetensors checkpoint or a built-in model's name")
        self._mapping: dict[str, str] | None = None
        if self.path.is_file():
            self.config_dir = single_file_configs(self.path, cfg) or SDXL_BASE_CONFIG_DIR
            check_single_file(self.path, self.config_dir)
            self._mapping = unet_diffusers_to_sgm(read_json(self.config_dir / "unet" / "config.json"))
            files = {comp: [self.path] for comp in _READ}
        else:
            check_folder(self.path)
            self.config_dir = self.path
            files = {comp: weight_files(self.path / comp, COMPONENTS[comp][2]) for comp in _READ}
        self._file = {(comp, key): f for comp, fs in files.items() for f in fs for key in header_shapes(f)}

    def modules(self) -> dict[str, torch.nn.Module]:
        """The UNet and text encoders its configs describe, on the meta device, by component."""
        from .single_file import meta_models

        unet, _, te1, te2 = meta_models(self.config_dir)
        return {"unet": unet, "text_encoder": te1, "text_encoder_2": te2}

    def read(self, component: str, param: str) -> torch.Tensor | None:
        """The stored tensor of `component`'s parameter `param` (module naming), in its stored dtype; None when
        the model has no such tensor."""
        from safetensors import safe_open

        from .single_file import sgm_source

        if self._mapping is not None:
            try:
                where = [sgm_source(component, param, self._mapping)]
            except KeyError:
                return None
        else:  # transformers' CLIP files are stored with or without the `text_model.` level
            where = [(param, None), ("text_model." + param, None), (param.removeprefix("text_model."), None)]
        for key, third in where:
            f = self._file.get((component, key))
            if f is None:
                continue
            with safe_open(str(f), framework="pt") as fh:
                if third is None:
                    return fh.get_tensor(key)
                fused = fh.get_slice(key)  # the second text encoder's q, k, v stored as one in_proj
                rows = fused.get_shape()[0] // 3
                return fused[third * rows:(third + 1) * rows]
        return None


def _targets(modules: dict[str, torch.nn.Module], preset: str, text_encoders: bool) -> dict[str, torch.nn.Module]:
    """"unet.<path>" / "text_encoder.<path>" -> the (meta) module, for every layer the extraction considers."""
    from ..config import AdapterConfig
    from .. import slots as unet_slots

    unet = modules["unet"]
    named = dict(unet.named_modules())
    plan = unet_slots.make_plan(unet, AdapterConfig(preset=preset))
    out = {f"unet.{s.name}": named[s.name] for s in plan.targets}
    if text_encoders:
        for comp in ("text_encoder", "text_encoder_2"):
            for name, mod in modules[comp].named_modules():
                if isinstance(mod, torch.nn.Linear) and name.endswith(TE_LAYERS):
                    out[f"{comp}.{name}"] = mod
    return out


def extract_adapter(base: str | Path, tuned: str | Path, rank: int, *, conv_rank: int | None = None,
                    preset: str = "locon", method: str | None = None, param: float | None = None,
                    text_encoders: bool = True, min_diff: float = 0.0, device: str | torch.device = "cpu",
                    progress=None) -> Resized:
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
    weights_b, weights_t = _Weights(base, "--base"), _Weights(tuned, "--tuned")
    targets = _targets(weights_b.modules(), preset, text_encoders)
    dev = torch.device(device)
    layers, rows, same = {}, [], 0
    for i, (key, mod) in enumerate(sorted(targets.items())):
        comp, name = key.split(".", 1)
        stored_b, stored_t = weights_b.read(comp, name + ".weight"), weights_t.read(comp, name + ".weight")
        want = tuple(mod.weight.shape)
        for model, stored in ((base, stored_b), (tuned, stored_t)):
            if stored is None or tuple(stored.shape) != want:
                got = "no such layer" if stored is None else f"shape {tuple(stored.shape)}"
                raise AdapterError(f"{model}: layer {key} has {got}, the architecture {want}: the two models are "
                                   "not the same architecture")
        w = stored_b.to(dev, torch.float32)
        diff = stored_t.to(dev, torch.float32) - w
        del stored_b, stored_t
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

"""Merge: bake one or more LoRA adapters, each at its own strength, into a full SDXL checkpoint
(a diffusers folder, or one `.safetensors` in the original layout for ComfyUI/A1111/Forge).

Each adapted weight becomes W + strength * delta, computed in fp32 and stored in the checkpoint's dtype:
for LoRA delta = alpha / rank * up @ down, what `load_lora_weights` + `set_adapters(weights=[strength])`
computes on the fly; LoHa's and LoKr's are their own products (sdxl/formats/lycoris.py); DoRA's is the normalised
weight minus the base, so strength blends base and trained weight linearly, as ComfyUI and Forge do
(export.weight_with). Adapters are read with `export.load_adapter` against the base model's own layers, so a key
that fits no layer stops the merge instead of vanishing from the result.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from . import kohya
from ...core.fsutil import atomic_folder
from .export import Adapter, AdapterError, ExportExistsError, check_dest, load_adapter, weight_with

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class MergeError(AdapterError):
    """An adapter cannot be merged into this model; the message says why."""


def _module(named: dict[str, torch.nn.Module], path: str) -> torch.nn.Module | None:
    if path in named:
        return named[path]
    # CLIP-L's names lost `text_model.` in transformers >= 5.6; adapters may carry either.
    alt = path.removeprefix("text_model.") if path.startswith("text_model.") else f"text_model.{path}"
    return named.get(alt)


@torch.no_grad()
def merge_adapter(pipe, adapter: Adapter, strength: float = 1.0) -> int:
    """Add `strength` times the adapter's update to the pipeline's weights in place; returns the layer
    count. Every layer is checked before any weight changes, so a refused adapter leaves the model as it was.
    A quantized component (model.quantize) is dequantized first: a sum of weights needs them in full precision."""
    return merge_adapters(pipe, [(adapter, strength)])[0]


@torch.no_grad()
def merge_adapters(pipe, adapters: Sequence[tuple[Adapter, float]]) -> list[int]:
    """`merge_adapter` for several (adapter, strength) in order, one layer at a time: each changed weight is
    taken to fp32, every adapter's update added there, and stored once in the weight's dtype. So a pipeline
    loaded in its 16-bit storage dtype gets the same weights as one merged in fp32 and cast after, without
    holding the model in fp32. Returns each adapter's layer count."""
    from ...core.quantize import dequantize_model, is_quantized

    for comp in sorted({c for adapter, _ in adapters for c in adapter.components()}):
        model = getattr(pipe, comp, None)
        if model is not None and is_quantized(model):
            log.warning("the %s is quantized: dequantizing it to merge (the result is the dequantized weights plus "
                        "the adapter, what a QLoRA adapter saw in training)", comp)
            dequantize_model(model)
    named: dict[str, dict[str, torch.nn.Module]] = {}
    todo: dict[int, tuple[torch.nn.Module, list]] = {}  # id(module) -> (module, [(layer, strength), ...] in order)
    counts = []
    for adapter, strength in adapters:
        counts.append(len(adapter.layers))
        for key, layer in sorted(adapter.layers.items()):
            comp, path = key.split(".", 1)
            model = getattr(pipe, comp, None)
            if model is None:
                raise MergeError(f"{key}: the pipeline has no {comp}")
            if comp not in named:
                named[comp] = dict(model.named_modules())
            mod = _module(named[comp], path)
            if mod is None or not hasattr(mod, "weight"):
                raise MergeError(f"{key}: the {comp} has no such layer; was the adapter trained for another model?")
            if hasattr(mod, "base_layer"):
                raise MergeError(f"{key}: the {comp} already holds an unmerged peft adapter; merge into a clean model")
            shape = layer.update_shape  # of the update, without computing it yet
            if shape != tuple(mod.weight.shape):
                raise MergeError(f"{key}: the adapter's update has shape {list(shape)}, the layer's weight "
                                 f"{list(mod.weight.shape)}: the adapter was trained for another model")
            if layer.bias is not None and getattr(mod, "bias", None) is None:
                raise MergeError(f"{key}: the adapter has a LoRA bias for this layer, which has no bias in the base "
                                 "model: merging it would change the architecture (load the adapter instead)")
            todo.setdefault(id(mod), (mod, []))[1].append((layer, strength))
    for mod, updates in todo.values():
        w, b = mod.weight, getattr(mod, "bias", None)
        w32 = w.float()
        b32 = b.float() if b is not None and any(layer.bias is not None for layer, _ in updates) else None
        for layer, strength in updates:
            w32 = weight_with(w32, layer, strength)
            if layer.bias is not None:
                b32 = b32 + strength * layer.scale * layer.bias.float().to(b32.device)
        w.copy_(w32.to(w.dtype))
        if b32 is not None:
            b.copy_(b32.to(b.dtype))
    return counts


def _kept_weights(pipe, adapters: Sequence[Adapter]):
    """A function that puts back, in place, the weights (and biases) of the pipeline's layers that the
    adapters change, as they are now (kept on the CPU meanwhile)."""
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    named: dict[str, dict[str, torch.nn.Module]] = {}
    seen: set[int] = set()
    for adapter in adapters:
        for key, layer in adapter.layers.items():
            comp, path = key.split(".", 1)
            model = getattr(pipe, comp, None)
            if model is not None and comp not in named:
                named[comp] = dict(model.named_modules())
            mod = _module(named.get(comp, {}), path)
            if mod is None or not hasattr(mod, "weight"):
                continue  # merge_adapter refuses the adapter, naming the layer, before it changes a weight
            params = [mod.weight] + ([mod.bias] if layer.bias is not None and getattr(mod, "bias", None) is not None
                                     else [])
            for t in params:
                if id(t) not in seen:
                    seen.add(id(t))
                    kept.append((t, t.detach().to("cpu", copy=True)))

    @torch.no_grad()
    def put_back() -> None:
        for target, value in kept:
            target.copy_(value)

    return put_back


@contextmanager
def merged(pipe, adapter: Adapter):
    """Yields merge(strength): the pipeline's weights as they were plus `strength` times the adapter's update
    (`merge_adapter`), at one strength after another, for renders; when the block ends the weights the adapter
    changes are as they were (kept on the CPU meanwhile)."""
    put_back = _kept_weights(pipe, [adapter])

    def merge(strength: float) -> None:
        put_back()
        merge_adapter(pipe, adapter, strength)

    try:
        yield merge
    finally:
        put_back()


@contextmanager
def applied(pipe, loras: Sequence[tuple[str | Path, float]]):
    """The pipeline with each (adapter file, strength) merged into its weights, for renders (`sdxl-lora generate`,
    the UI's Generate tab); as it was when the block ends. Every kind is merged at its strength (`merge_adapters`,
    the update ComfyUI's and A1111/Forge's loaders apply, in the order given), as a run's previews merge the
    adapter being trained and Compare merges a checkpoint: the same adapter and settings give the same pixels in
    each. diffusers' `load_lora_weights` would run LoRA beside the weights (other float rounding), reads no
    LyCORIS LoHa or LoKr file, and drops a kohya DoRA file's dora_scale with a warning."""
    table = None
    merging: list[tuple[Adapter, float]] = []
    for path, strength in loras:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such adapter file")
        if table is None:
            table = kohya.LayerTable.from_pipeline(pipe)
        adapter = load_adapter(path, table)
        if adapter.unknown:
            raise MergeError(f"{path}: {adapter.problems[0]}; rendering without those layers would not show the "
                             "adapter as trained")
        merging.append((adapter, strength))
    put_back = _kept_weights(pipe, [a for a, _ in merging])
    try:
        if merging:
            merge_adapters(pipe, merging)
        yield pipe
    finally:
        put_back()


def parse_lora_arg(arg: str) -> tuple[Path, float]:
    """`FILE[:STRENGTH]` -> (path, strength); a trailing part that is not a number belongs to the path."""
    head, sep, tail = arg.rpartition(":")
    if sep:
        try:
            return Path(head), float(tail)
        except ValueError:
            pass
    return Path(arg), 1.0


def source_dtype(model_path: Path) -> torch.dtype:
    """The dtype the base's UNet weights are stored in (so a merged fp16 checkpoint stays fp16)."""
    from safetensors import safe_open

    files = [model_path] if model_path.is_file() else sorted((model_path / "unet").glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                if model_path.is_dir() or k.startswith("model.diffusion_model."):
                    return _ST_DTYPES.get(st.get_slice(k).get_dtype(), torch.float32)
    return torch.float32


def _quantized_base(pipe, adapters, as_trained: bool) -> None:
    """Warn about adapters trained on a quantized UNet; with `as_trained`, give the UNet the weights they saw."""
    methods = {}
    for path, _, adapter in adapters:
        method = adapter.metadata.get("sdxl_lora.quantize", "none")
        if method != "none":
            methods.setdefault(method, []).append(Path(path).name)
    if not methods:
        if as_trained:
            log.warning("--as-trained: no adapter says it was trained on a quantized base; merging into the "
                        "full-precision weights")
        return
    if len(methods) > 1 and as_trained:
        raise MergeError(f"--as-trained: the adapters were trained on differently quantized bases ({methods}); "
                         "merge them one at a time")
    for method, names in methods.items():
        if as_trained:
            log.warning("%s: trained on a %s-quantized UNet; merging into the UNet quantized to %s and dequantized "
                        "(the weights the adapter saw, quantization error included)", ", ".join(names), method, method)
        else:
            log.warning("%s: trained on a %s-quantized UNet, so it learned against the quantized weights; merged "
                        "into the full-precision ones the result is close to, not the same as, what was trained "
                        "(--as-trained merges into the dequantized weights instead)", ", ".join(names), method)
    if as_trained:
        from ...core.quantize import dequantize_model, quantize_model
        from ..quantize import unet_skip

        method = next(iter(methods))
        double = all(a.metadata.get("sdxl_lora.quant_double", "true") == "true" for _, _, a in adapters)
        quantize_model(pipe.unet, method, compute_dtype=torch.float32, double_quant=double, skip=unet_skip)
        dequantize_model(pipe.unet)


def merge_checkpoint(model: str | Path, loras: Sequence[tuple[str | Path, float]], out: str | Path, *,
                     tokenizer: str | Path | None = None, dtype: str = "auto", overwrite: bool = False,
                     as_trained: bool = False) -> Path:
    """Load the base model (diffusers folder, single file or "tiny-sdxl"), merge each (adapter, strength)
    in order and write the result: a single original-layout file when `out` ends in .safetensors,
    otherwise a diffusers folder. dtype "auto" keeps the base's storage dtype.

    An adapter trained on a quantized UNet (metadata `sdxl_lora.quantize`) learned against the quantized
    weights: merged into the full-precision ones (the default) it gives a model close to, not the same
    as, the one trained, and a warning says so. `as_trained` instead quantizes the UNet the same way and
    dequantizes it before merging: the weights the adapter saw, quantization error included."""
    from ..config import DEMO_NAME, TINY_NAME, ModelConfig
    from ..model import CONFIGS_FROM, load_pipeline, resolve_model_path
    from .single_file import save_single_file

    out = Path(out)
    if not loras:
        raise MergeError("no adapter to merge: give at least one --lora FILE[:STRENGTH]")
    if dtype != "auto" and dtype not in _DTYPES:
        raise MergeError(f"dtype={dtype!r}: must be auto, {', '.join(_DTYPES)}")
    for path, _ in loras:
        if not Path(path).exists():
            raise FileNotFoundError(f"--lora {path}: no such file")
    mcfg = ModelConfig(path=str(model), tokenizer=str(tokenizer) if tokenizer else None)
    model_path = resolve_model_path(mcfg)
    check_dest(out, overwrite, reads=(model_path, tokenizer, *(p for p, _ in loras)), reader="the merge",
               error=MergeError)
    stored = source_dtype(model_path)
    target = stored if dtype == "auto" else _DTYPES[dtype]
    # Loaded in a dtype that holds both the stored and the written weights exactly (fp16 when both are fp16, the
    # usual case: half of fp32's memory); merge_adapters computes each changed layer in fp32 and rounds once.
    # The quantized round trip of as_trained works in fp32.
    pipe = load_pipeline(mcfg, torch_dtype=torch.float32 if as_trained else torch.promote_types(stored, target))
    table = kohya.LayerTable.from_pipeline(pipe)
    merged = []
    adapters = []
    for path, strength in loras:
        adapter = load_adapter(path, table)
        if adapter.unknown:
            raise MergeError(f"{path}: {adapter.problems[0]}; merging the rest would give a model the adapter's "
                             "author never saw, so nothing was merged")
        adapters.append((path, strength, adapter))
    _quantized_base(pipe, adapters, as_trained)
    counts = merge_adapters(pipe, [(adapter, strength) for _, strength, adapter in adapters])
    for (path, strength, _), n in zip(adapters, counts):
        log.info("merged %s at strength %g: %d layers", Path(path).name, strength, n)
        merged.append({"lora": Path(path).name, "strength": strength, "layers": n})
    note = {"sdxl_lora.merged": json.dumps(merged)}
    if str(model) in (DEMO_NAME, TINY_NAME):  # not SDXL base's shapes: the file says whose configs it needs
        note[CONFIGS_FROM] = str(model)
    if out.suffix == ".safetensors":
        return save_single_file(pipe, out, overwrite=overwrite, dtype=target, metadata=note)
    if target != torch.float32:
        pipe.to(target)
    with atomic_folder(out, overwrite, ExportExistsError) as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
    return out

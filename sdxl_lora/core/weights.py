"""A model folder's files checked before a loader reads them: its JSON configs parse, its weights are
safetensors (pickles are refused, never loaded) and each file is whole. A loader meeting any of these
fails with a traceback deep inside diffusers or transformers; here each is one sentence naming the file.
The tasks raise these problems as their own model errors, with what to do."""
from __future__ import annotations

import json
from pathlib import Path

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

# How a user turns a folder's pickle weights into safetensors, on a machine where the file is trusted.
CONVERT_HINT = ("convert them once, where you trust the file, by loading the model with its library and saving it "
                "with save_pretrained(FOLDER, safe_serialization=True), which writes .safetensors files")


class WeightFileError(ValueError):
    """A config or weight file a loader would trip on; the message names the file and what is wrong."""


class PickleWeights(WeightFileError):
    """A folder whose weights are pickles only; the message says how to convert them."""


def read_json(path: Path) -> dict:
    """The JSON object in `path`."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise WeightFileError(f"{path} is not a text file (byte {e.start} is not UTF-8)") from None
    except json.JSONDecodeError as e:
        raise WeightFileError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(value, dict):
        raise WeightFileError(f"{path} holds a JSON {type(value).__name__}, not the object of settings it should")
    return value


def header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in a .safetensors file, from its header alone (no weights read); the header also
    says how long the file must be, so a copy that stopped part-way is caught here."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except SafetensorError as e:
        raise WeightFileError(f"{path} is damaged or not a safetensors file ({e}): it may be truncated (a "
                              "copy or download that stopped part-way)") from None


def float_dtypes() -> dict[str, "torch.dtype"]:
    """The torch dtypes of the floating dtypes a safetensors header names (16 bits and wider)."""
    import torch

    return {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def stored_float_dtype(files: list[Path]) -> "torch.dtype | None":
    """The one floating dtype every floating tensor of these .safetensors files is stored in (from their
    headers alone), or None where they mix several."""
    from safetensors import safe_open

    names = float_dtypes()
    found = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            found |= {f.get_slice(k).get_dtype() for k in f.keys()}
    floats = {names[d] for d in found if d in names}
    return floats.pop() if len(floats) == 1 else None


def weight_files(folder: Path, stem: str) -> list[Path]:
    """The safetensors files a loader reads for `stem` (transformers' "model", diffusers'
    "diffusion_pytorch_model") in `folder`: STEM.safetensors, or the shards STEM.safetensors.index.json
    lists; each one checked whole (header_shapes). Only pickle weights there: refused, naming them."""
    single, index = folder / f"{stem}.safetensors", folder / f"{stem}.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        if not shards:
            raise WeightFileError(f"{index} lists no weight files (its weight_map is empty)")
        files = [folder / s for s in shards]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise WeightFileError(f"{index} lists {len(absent)} weight file(s) that are not there: "
                                  f"{', '.join(absent[:3])}{', ...' if len(absent) > 3 else ''}")
    elif single.is_file():
        files = [single]
    else:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES) \
            if folder.is_dir() else []
        if pickles:
            raise PickleWeights(f"{folder} has only pickle weights ({', '.join(pickles[:3])}): a pickle can run "
                                  f"code when loaded, so it is never read; {CONVERT_HINT}")
        others = sorted(p.name for p in folder.glob("*.safetensors")) if folder.is_dir() else []
        raise WeightFileError(f"{folder} has no {single.name}" + (f" (it has {', '.join(others[:3])}: give a "
                              f"folder whose weights are named {single.name})" if others else ""))
    for f in files:
        header_shapes(f)
    return files


def shape_problems(files: list[Path], expected: dict[str, tuple[int, ...]]) -> list[str]:
    """How the tensors in `files` differ from `expected` (name -> shape, e.g. a model's state_dict on the
    meta device): the ones missing and the ones of another shape, a few named. Extra tensors are not a
    problem (loaders ignore them)."""
    found: dict[str, tuple[int, ...]] = {}
    for f in files:
        found.update(header_shapes(f))
    missing = sorted(expected.keys() - found.keys())
    other = sorted(k for k in expected.keys() & found.keys() if tuple(expected[k]) != found[k])
    out = []
    if missing:
        out.append(f"{len(missing)} of its {len(expected)} tensors missing (e.g. {', '.join(missing[:2])})")
    if other:
        k = other[0]
        out.append(f"{len(other)} of another shape (e.g. {k}: {list(found[k])} in the file, "
                   f"{list(expected[k])} in the config)")
    return out

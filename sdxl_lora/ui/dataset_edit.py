"""What the Dataset tab writes into a dataset folder: captions edited in the table, bulk caption edits (prefix,
suffix, find/replace, the trigger word where missing), uploaded images and captions, and captions made by a
local captioning model. Every file goes through `Folders.inside`, is written atomically, and a caption is
written only beside its own image; images are never modified.

The page holds the scanned images as `items`: [[absolute image path, caption], ...], in table order.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sdxl_lora.sdxl.config import DataConfig
from sdxl_lora.core.fsutil import atomic_write_bytes, atomic_write_text, check_destination
from sdxl_lora.sdxl.images import IMAGE_EXTENSIONS

from .folders import Folders, PathRefused

SCOPES = ("every image in the folder", "the ticked rows")
OPERATIONS = ("add prefix", "add suffix", "find and replace", "add the trigger word where missing")


def clean(text: str) -> str:
    # One line, single spaces: what training reads (sdxl.data collapses whitespace the same way).
    return " ".join(str(text).split())


def extension(ext: str) -> str:
    """The caption extension the tab shows, checked by the schema; the error names the field."""
    ext = (ext or "").strip()
    try:
        return DataConfig(caption_extension=ext).caption_extension
    except ValueError as e:
        raise ValueError(f"caption extension {ext!r}: {e}") from e


def sidecar(f: Folders, image: str | Path, ext: str) -> Path:
    """The caption file of `image`: beside it, in its own folder, inside the datasets folder."""
    path = f.inside(image, "datasets")
    side = f.inside(os.path.splitext(path)[0] + extension(ext), "datasets")
    if side.parent != path.parent or not path.is_file():
        raise PathRefused(f"{side} is not beside {path.name}; a caption is written next to its image only")
    return side


def file_name(f: Folders, image: str) -> str:
    """An image as the table names it: its path under the datasets folder."""
    return os.path.relpath(image, f.datasets)


def thumbnail(image: str) -> str:
    from urllib.parse import quote

    return f"![]({'/gradio_api/file=' + quote(str(image))})"


def table(f: Folders, items: list[list[str]], ticked: set[int] = frozenset()) -> list[list]:
    """The rows the page shows: tick box, thumbnail, file, caption (the only editable cells: tick and caption)."""
    return [[i in ticked, thumbnail(path), file_name(f, path), caption] for i, (path, caption) in enumerate(items)]


def _rows(data) -> list[list]:
    # gr.Dataframe hands a pandas frame (its default type); tests hand lists.
    return data.values.tolist() if hasattr(data, "values") else [list(r) for r in (data or [])]


def _caption(row) -> str:
    return clean(row[3]) if isinstance(row[3], str) else ""


def _matching(f: Folders, items, data) -> list[list]:
    rows = _rows(data)
    if len(rows) != len(items) or any(str(r[2]) != file_name(f, it[0]) for r, it in zip(rows, items)):
        raise PathRefused("the table does not match the scanned images (another folder was scanned since); "
                          "Scan again, then edit")
    return rows


def _write(f: Folders, changes: list[tuple[int, str]], items, ext: str) -> list[list[str]]:
    """Write each (index, caption) beside its image (all checked before any is written); the new items."""
    targets = [(i, sidecar(f, items[i][0], ext), text) for i, text in changes]
    out = [list(it) for it in items]
    for i, side, text in targets:
        atomic_write_text(side, text + "\n")
        out[i][1] = text
    return out


def save_table(f: Folders, items, data, ext: str):
    """Write the captions edited in the table; (items, message)."""
    rows = _matching(f, items, data)
    changes = [(i, _caption(r)) for i, r in enumerate(rows) if _caption(r) != clean(items[i][1])]
    if not changes:
        return items, "no caption changed: edit a caption cell, then Save"
    items = _write(f, changes, items, ext)
    names = ", ".join(os.path.basename(sidecar(f, items[i][0], ext)) for i, _ in changes[:5])
    return items, f"saved {len(changes)} caption(s): {names}" + (" ..." if len(changes) > 5 else "")


@dataclass(frozen=True)
class BulkEdit:
    operation: str
    text: str = ""  # the prefix, the suffix or the trigger word
    find: str = ""
    replace: str = ""

    def check(self) -> "BulkEdit":
        if self.operation not in OPERATIONS:
            raise ValueError(f"bulk edit: {self.operation!r} is not one of {', '.join(OPERATIONS)}")
        if self.operation == "find and replace" and not self.find:
            raise ValueError("find: empty; type the text to replace")
        if self.operation != "find and replace" and not clean(self.text):
            what = "trigger word" if self.operation.startswith("add the trigger") else self.operation[4:]
            raise ValueError(f"{what}: empty; type the text to add")
        return self

    def apply(self, caption: str) -> str:
        from sdxl_lora.sdxl.captions import has_word

        text = clean(self.text)
        if self.operation == "add prefix":
            return _join(text, caption)
        if self.operation == "add suffix":
            return _join(caption, text)
        if self.operation == "find and replace":
            return clean(caption.replace(self.find, self.replace))
        # The trigger word first, as kohya's captions and this trainer's fallback caption put it.
        return caption if has_word(caption, text) else _join(f"{text}," if caption else text, caption)


def _join(a: str, b: str) -> str:
    if not a or not b:
        return clean(a or b)
    return clean(a + b if b[0] in ",.;:" else f"{a} {b}")


def bulk_changes(f: Folders, items, data, edit: BulkEdit, scope: str) -> list[tuple[int, str, str]]:
    """(index, caption now, caption after) for each caption the edit changes, over the scope."""
    rows = _matching(f, items, data)
    unsaved = sum(_caption(r) != clean(it[1]) for r, it in zip(rows, items))
    if unsaved:
        raise ValueError(f"the table has {unsaved} unsaved caption edit(s): Save captions first (or Scan to drop them)")
    if scope not in SCOPES:
        raise ValueError(f"apply to: {scope!r} is not one of {', '.join(SCOPES)}")
    picked = [i for i, r in enumerate(rows) if scope == SCOPES[0] or bool(r[0])]
    if not picked:
        raise ValueError("apply to: no row is ticked; tick the images to edit, or pick every image in the folder")
    edit.check()
    return [(i, items[i][1], after) for i in picked if (after := edit.apply(items[i][1])) != clean(items[i][1])]


def bulk_preview(f: Folders, items, data, edit: BulkEdit, scope: str) -> str:
    changes = bulk_changes(f, items, data, edit, scope)
    n = len(items) if scope == SCOPES[0] else sum(bool(r[0]) for r in _rows(data))
    lines = [f"{len(changes)} of {n} caption(s) would change; nothing is written until Apply."]
    lines += [f"- {file_name(f, items[i][0])}: {before!r} -> {after!r}" for i, before, after in changes[:5]]
    return "\n".join(lines) + ("\n- ..." if len(changes) > 5 else "")


def bulk_apply(f: Folders, items, data, edit: BulkEdit, scope: str, ext: str):
    """Write the edit's captions; (items, message)."""
    changes = bulk_changes(f, items, data, edit, scope)
    items = _write(f, [(i, after) for i, _, after in changes], items, ext)
    return items, f"{len(changes)} caption(s) written ({edit.operation})"


# ------------------------------------------------------------------------------------------ uploads

def upload(f: Folders, folder: str, files: list[tuple[str, str | Path]], ext: str, overwrite: bool) -> str:
    """Copy uploaded (name, temp file) pairs into the dataset folder `folder` (made if new): images that
    decode as the scan checks them, and UTF-8 caption files of the tab's extension. Refused: other types,
    names with path parts or a leading dot, and existing files unless `overwrite`. The good ones are written."""
    from sdxl_lora.sdxl.data import _read_text
    from sdxl_lora.sdxl.images import ImageProblem, probe_image

    ext = extension(ext)
    if not files:
        raise ValueError("files: none chosen; pick images (and their caption files) to upload")
    root = f.inside(folder or "", "datasets")
    written, refused = [], []
    for name, src in files:
        base = os.path.basename(str(name).replace("\\", "/"))
        stem, suffix = os.path.splitext(base)
        if base != name or not stem or base.startswith("."):
            refused.append(f"{name}: a file name only (no folders, no leading dot)")
            continue
        if suffix.lower() not in IMAGE_EXTENSIONS and suffix != ext:
            refused.append(f"{name}: not an image ({', '.join(sorted(IMAGE_EXTENSIONS))}) or a caption ({ext})")
            continue
        try:
            if suffix == ext:
                _read_text(Path(src), "caption")
            else:
                probe_image(src, DataConfig().max_pixels)
        except (ValueError, ImageProblem) as e:
            refused.append(f"{name}: {e}")
            continue
        dest = f.inside(root / base, "datasets")
        if dest.exists() and not overwrite:
            refused.append(f"{name}: {file_name(f, str(dest))} already exists; tick 'overwrite files already there' to replace it")
            continue
        try:
            check_destination(dest, True, [src], "the upload", error=PathRefused)
        except PathRefused as e:  # the file itself, or a folder that is a run's record
            refused.append(f"{name}: {e}")
            continue
        atomic_write_bytes(dest, Path(src).read_bytes())
        written.append(base)
    lines = [f"uploaded {len(written)} file(s) into {file_name(f, str(root))}" + (f": {', '.join(written)}" if written
                                                                                   else "")]
    if refused:
        lines.append(f"\nrefused {len(refused)}:")
        lines += [f"- {r}" for r in refused]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- captioning

def captioner_choices(models: Path) -> list[str]:
    """Folders under the models folder that hold an image-to-text model (transformers config, a processor's
    settings, safetensors weights) or a WD14-style tagger (model.onnx, selected_tags.csv), relative to it."""
    out = []
    for folder, dirs, names in os.walk(models):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        image_processor = {"preprocessor_config.json", "processor_config.json"} & set(names)
        tagger = {"model.onnx", "selected_tags.csv"} <= set(names)
        if tagger or "config.json" in names and image_processor and any(n.endswith(".safetensors") for n in names):
            out.append(os.path.relpath(folder, models))
            dirs[:] = []
    return out


GENERAL_LABEL = "tagger: least probability of a general tag"
CHARACTER_LABEL = "tagger: least probability of a character tag"


def caption(f: Folders, folder: str, model: str, ext: str, overwrite: bool, prefix: str, on_progress=None,
            general: float | None = None, character: float | None = None) -> str:
    """`sdxl-lora dataset caption` on a dataset folder with a model under the models folder, or `sdxl-lora dataset
    tag` with a tagger there at the thresholds `general` and `character` (None: the tagger's defaults); the
    report."""
    import torch

    from sdxl_lora.sdxl.captioner import caption_folder
    from sdxl_lora.sdxl.tagger import CHARACTER_THRESHOLD, GENERAL_THRESHOLD, is_tagger, tag_folder

    root = f.inside(folder or "", "datasets")
    if not model:
        raise ValueError("captioning model: none picked; put an image-to-text model folder under the models folder")
    net = f.inside(model, "models")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if is_tagger(net):  # the prefix is the trigger word
        thresholds = []
        for label, value, default in ((GENERAL_LABEL, general, GENERAL_THRESHOLD),
                                      (CHARACTER_LABEL, character, CHARACTER_THRESHOLD)):
            value = default if value is None else float(value)
            # Checked here to name the page's box (the tagger's own message names the CLI's flag).
            if not 0 < value <= 1:
                raise ValueError(f"'{label}' is {value:g}: give a probability above 0 and at most 1, e.g. {default}")
            thresholds.append(value)
        report = tag_folder(root, net, extension=extension(ext), overwrite=overwrite, trigger=prefix or "",
                            general_threshold=thresholds[0], character_threshold=thresholds[1], device=device,
                            on_progress=on_progress)
    else:
        report = caption_folder(root, net, extension=extension(ext), overwrite=overwrite, prefix=prefix or "",
                                device=device, on_progress=on_progress)
    return "\n".join(report.lines()).replace("--overwrite", "ticking 'replace existing captions'")

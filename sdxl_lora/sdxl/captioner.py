"""Captions made on the spot: `sdxl-lora dataset caption DIR --model PATH` writes a sidecar caption beside
every image that has none, with a local image-to-text model through transformers (BLIP, GIT, Florence-2 and
the other models of AutoModelForImageTextToText whose code ships with transformers).

The model is read from a local folder only (nothing is downloaded) and from safetensors only; no remote
code runs. Existing captions are kept unless asked; each caption is written atomically; images are only
read.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from .config import DataConfig
from ..core.fsutil import atomic_write_text
from .data import _root, _walk
from .dataset import DataError
from .images import IMAGE_EXTENSIONS, ImageProblem, open_image

log = logging.getLogger(__name__)


@dataclass
class CaptionReport:
    written: list[Path] = field(default_factory=list)  # the caption files written
    kept: list[Path] = field(default_factory=list)  # images whose caption was there already
    failed: list[tuple[Path, str]] = field(default_factory=list)  # images that could not be read

    def lines(self) -> list[str]:
        out = [f"captions written: {len(self.written)}; kept (already there): {len(self.kept)}"
               + ("" if not self.kept else " — --overwrite replaces them")]
        out += [f"  skipped {p}: {why}" for p, why in self.failed]
        return out


def load_captioner(path: str | Path, device: str = "cpu"):
    """(processor, model) from a local transformers folder; the error says what to give instead."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise DataError(f"--model {path}: not a folder — give a local transformers folder of an image-to-text "
                        "model (config.json, model.safetensors, the processor's files); nothing is downloaded")
    if not any(folder.glob("*.safetensors")):
        raise DataError(f"--model {folder}: no .safetensors weights there (pickled weights are not loaded) — "
                        "convert the model to safetensors or use a folder that has them")
    try:
        processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
        model = AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True, use_safetensors=True)
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"--model {folder} cannot be loaded as an image-to-text model: {e}") from e
    return processor, model.to(device).eval()


def images_without_caption(folder: Path, extension: str, overwrite: bool) -> tuple[list[Path], list[Path]]:
    """(images to caption, images that keep their caption) under folder, hidden files left out."""
    todo, kept = [], []
    mask = DataConfig().mask_suffix
    for sub, names in _walk(folder):
        present = set(names)
        stems = {os.path.splitext(n)[0] for n in names}
        for name in names:
            stem, ext = os.path.splitext(name)
            if ext.lower() not in IMAGE_EXTENSIONS or (stem.endswith(mask) and stem[:-len(mask)] in stems):
                continue  # not an image, or an image's loss mask
            (kept if stem + extension in present and not overwrite else todo).append(sub / name)
    return todo, kept


def caption_in_batches(folder: str | Path, extension: str, overwrite: bool, report: CaptionReport, command: str,
                       desc: str, batch_size: int, on_progress: Callable[[int, int], None] | None,
                       load: Callable[[], Callable[[list[Path], list, str], None]]) -> CaptionReport:
    """What every captioner does around its model: the images under `folder` without a `<stem><extension>`
    beside them (every image with overwrite) read in batches, `load()` called once there is work and its
    `write(paths, images, extension)` captioning each batch into `report`, progress on a bar (or on_progress)."""
    extension = DataConfig(caption_extension=extension).caption_extension  # the schema's check of the extension
    root = _root(str(folder), command)
    todo, report.kept = images_without_caption(root, extension, overwrite)
    if not todo:
        return report
    write = load()
    bar = tqdm(total=len(todo), desc=desc, unit="img", disable=None if on_progress is None else True)
    for start in range(0, len(todo), batch_size):
        batch, images = [], []
        for path in todo[start:start + batch_size]:
            try:
                images.append(open_image(path, DataConfig().max_pixels))
                batch.append(path)
            except ImageProblem as e:
                report.failed.append((path, str(e)))
        if images:
            write(batch, images, extension)
        done = min(start + batch_size, len(todo))
        bar.update(done - bar.n)
        if on_progress is not None:
            on_progress(done, len(todo))
    bar.close()
    return report


@torch.no_grad()
def caption_folder(folder: str | Path, model: str | Path, *, extension: str = ".txt", overwrite: bool = False,
                   prompt: str | None = None, max_new_tokens: int = 40, batch_size: int = 4, device: str = "cpu",
                   prefix: str = "", on_progress: Callable[[int, int], None] | None = None) -> CaptionReport:
    """Caption every image under `folder` that has no `<stem><extension>` beside it (every image with
    overwrite), writing `prefix` + the model's text. `prompt` starts the text for models that take one (BLIP's
    conditional captioning: "a photo of")."""
    report = CaptionReport()

    def load():
        processor, net = load_captioner(model, device)

        def write(batch: list[Path], images: list, extension: str) -> None:
            kwargs = {"text": [prompt] * len(images)} if prompt else {}
            inputs = processor(images=images, return_tensors="pt", **kwargs).to(device)
            out = net.generate(**inputs, max_new_tokens=max_new_tokens)
            for path, text in zip(batch, processor.batch_decode(out, skip_special_tokens=True)):
                if not text.strip():  # an empty caption file would only stand in the way of a better one
                    report.failed.append((path, "the model gave no text; no caption written"))
                    continue
                caption = " ".join(f"{prefix} {text}".split())
                report.written.append(atomic_write_text(path.with_name(path.stem + extension), caption + "\n"))
        return write

    return caption_in_batches(folder, extension, overwrite, report, "dataset caption", "captioning", batch_size,
                              on_progress, load)

"""Tag captions: `sdxl-lora dataset tag DIR --tagger FOLDER` writes booru-style tags ("1girl, solo, red hair")
beside every image that has no caption, with a WD14-style ONNX tagger run by onnxruntime (the tagger extra).

Models tuned on tagged data (Pony, Illustrious, NoobAI) are trained with such captions. The folder is the
layout the WD14 taggers are published in: `model.onnx` (input: a batch of square BGR images in 0-255,
NHWC; output: one probability per tag) and `selected_tags.csv` (tag_id, name, category, count; category 9 is a
rating, 4 a character, 0 a general tag). Nothing is downloaded. The preprocessing is the publisher's: the
image on white, padded to a square, resized (bicubic) to the model's input size.
"""
from __future__ import annotations

import csv
import importlib.util
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..core.config import ConfigError, MissingPackage
from ..core.fsutil import atomic_write_text
from .captioner import CaptionReport, caption_in_batches
from .dataset import DataError

RATING, GENERAL, CHARACTER = 9, 0, 4
# The thresholds of the publisher's own demo: a general tag at 0.35 is usually right, a character needs more.
GENERAL_THRESHOLD, CHARACTER_THRESHOLD = 0.35, 0.85
# Emoticon tags whose underscores are the face, not spaces (the list the WD14 web UI keeps).
KAOMOJI = {"0_0", "(o)_(o)", "+_+", "+_-", "._.", "<o>_<o>", "<|>_<|>", "=_=", ">_<", "3_3", "6_9", ">_o", "@_@",
           "^_^", "o_o", "u_u", "x_x", "|_|", "||_||"}


@dataclass
class Tags:
    names: list[str]
    categories: list[int]


@dataclass
class TagReport(CaptionReport):
    tags: Counter = field(default_factory=Counter)  # how many captions written hold each tag

    def lines(self) -> list[str]:
        out = super().lines()
        if self.written:
            common = ", ".join(f"{t} ({n})" for t, n in self.tags.most_common(10))
            out.insert(1, f"tags written: {sum(self.tags.values())} ({len(self.tags)} distinct, "
                          f"{sum(self.tags.values()) / len(self.written):.1f} a caption); most common: {common}")
        return out


def is_tagger(folder: Path) -> bool:
    return (folder / "model.onnx").is_file() and (folder / "selected_tags.csv").is_file()


def read_tags(path: Path) -> Tags:
    """The tag list beside the model, in the model's output order."""
    names, categories = [], []
    with open(path, newline="", encoding="utf-8") as f:
        rows = csv.DictReader(f)
        if not rows.fieldnames or not {"name", "category"} <= set(rows.fieldnames):
            raise DataError(f"{path}: a tag list needs the columns name and category (the WD14 layout: tag_id, "
                            f"name, category, count); it has {rows.fieldnames}")
        for row in rows:
            names.append(row["name"])
            categories.append(int(row["category"]))
    return Tags(names, categories)


def load_tagger(folder: str | Path, device: str = "cpu"):
    """(onnxruntime session, tags) from a local folder; the errors say what to give instead."""
    if importlib.util.find_spec("onnxruntime") is None:
        raise MissingPackage("the tagger needs onnxruntime, which is not installed: pip install 'sdxl_lora[tagger]'")
    import onnxruntime

    folder = Path(folder).expanduser()
    if not folder.is_dir() or not is_tagger(folder):
        raise DataError(f"--tagger {folder}: needs a folder holding model.onnx and selected_tags.csv (the layout "
                        "the WD14 taggers are published in); nothing is downloaded")
    providers = (["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"])
    available = onnxruntime.get_available_providers()
    session = onnxruntime.InferenceSession(str(folder / "model.onnx"),
                                           providers=[p for p in providers if p in available])
    tags = read_tags(folder / "selected_tags.csv")
    width = session.get_outputs()[0].shape[-1]
    if isinstance(width, int) and width != len(tags.names):
        raise DataError(f"{folder}: model.onnx gives {width} tag probabilities and selected_tags.csv lists "
                        f"{len(tags.names)} tags; they must come from the same release")
    return session, tags


def _pixels(image, size: int):
    """The publisher's preprocessing: on white, padded to a square, resized bicubic; BGR, 0-255, float32."""
    import numpy as np
    from PIL import Image

    rgba = image.convert("RGBA")
    flat = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    flat.alpha_composite(rgba)
    side = max(flat.size)
    square = Image.new("RGB", (side, side), (255, 255, 255))
    square.paste(flat.convert("RGB"), ((side - flat.width) // 2, (side - flat.height) // 2))
    square = square.resize((size, size), Image.BICUBIC)
    return np.asarray(square, dtype=np.float32)[:, :, ::-1]


def spaced(tag: str, underscores: bool) -> str:
    return tag if underscores or tag in KAOMOJI else tag.replace("_", " ")


def choose(probs, tags: Tags, general: float, character: float, ratings: bool, underscores: bool) -> list[str]:
    """One image's tags: characters over `character`, then general tags over `general`, each by confidence;
    with `ratings`, the likeliest rating first."""
    picked = {GENERAL: [], CHARACTER: []}
    best_rating = None
    for i, p in enumerate(probs):
        kind = tags.categories[i]
        if kind == RATING:
            if best_rating is None or p > probs[best_rating]:
                best_rating = i
        elif kind == CHARACTER and p >= character or kind not in (RATING, CHARACTER) and p >= general:
            picked[CHARACTER if kind == CHARACTER else GENERAL].append((float(p), i))
    out = [tags.names[best_rating]] if ratings and best_rating is not None else []
    for kind in (CHARACTER, GENERAL):
        out += [tags.names[i] for _, i in sorted(picked[kind], key=lambda t: -t[0])]
    return [spaced(t, underscores) for t in out]


def tag_folder(folder: str | Path, tagger: str | Path, *, extension: str = ".txt", overwrite: bool = False,
               general_threshold: float = GENERAL_THRESHOLD, character_threshold: float = CHARACTER_THRESHOLD,
               ratings: bool = False, trigger: str = "", underscores: bool = False, batch_size: int = 8,
               device: str = "cpu", on_progress: Callable[[int, int], None] | None = None) -> TagReport:
    """Tag every image under `folder` that has no `<stem><extension>` beside it (every image with overwrite):
    `trigger`, then the tagger's tags, comma-separated."""
    import numpy as np

    for name, value in (("general threshold", general_threshold), ("character threshold", character_threshold)):
        if not 0 < value <= 1:
            raise ConfigError(f"--{name.replace(' ', '-')} {value}: a probability in (0, 1], e.g. {GENERAL_THRESHOLD}")
    report = TagReport()

    def load():
        session, tags = load_tagger(tagger, device)
        put = session.get_inputs()[0]
        size = put.shape[1] if isinstance(put.shape[1], int) else 448

        def write(batch: list[Path], images: list, extension: str) -> None:
            pixels = np.stack([_pixels(im, size) for im in images])
            (probs,) = session.run([session.get_outputs()[0].name], {put.name: pixels})
            for path, row in zip(batch, probs):
                chosen = choose(row, tags, general_threshold, character_threshold, ratings, underscores)
                if not chosen:  # an empty caption file would only stand in the way of a better one
                    report.failed.append((path, "no tag reached the thresholds; no caption written"))
                    continue
                words = ([trigger.strip()] if trigger.strip() else []) + [t for t in chosen if t != trigger.strip()]
                report.tags.update(chosen)
                report.written.append(atomic_write_text(path.with_name(path.stem + extension), ", ".join(words) + "\n"))
        return write

    return caption_in_batches(folder, extension, overwrite, report, "dataset tag", "tagging", batch_size, on_progress,
                              load)

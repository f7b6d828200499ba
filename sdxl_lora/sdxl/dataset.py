"""What a dataset scan finds (sdxl/data.py: scan): the usable images (Item), the files skipped (Problem), each
dataset as configured (DatasetSpec), and the Dataset that holds them with the report `dataset inspect` prints."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from sdxl_lora.sdxl.config import DataConfig


@dataclass(frozen=True)
class Problem:
    """A file that was skipped, and why."""
    path: Path
    reason: str


@dataclass
class Item:
    """One usable image: where it is, its caption and the bucket it trains in."""
    path: Path
    caption: str  # the caption file's text, whitespace collapsed; "" when it has none
    repeats: int
    size: tuple[int, int]  # (width, height) as displayed, i.e. after EXIF orientation
    bucket: tuple[int, int]  # (width, height), multiples of bucket_step
    dataset: Path  # the data.dirs entry (or [[data.datasets]] path) it came from
    has_caption: bool
    mask: Path | None = None  # with data.masked_loss: its loss mask (white learns, black is ignored)
    # Its dataset's settings (data.* with the [[data.datasets]] table over them); None: the caller's config.
    settings: DataConfig | None = None
    is_reg: bool = False  # a regularization image: no trigger word, loss times train.prior_loss_weight
    source: int = 0  # the index of its DatasetSpec in Dataset.specs


@dataclass
class DatasetSpec:
    """One dataset as configured: a data.dirs entry, or a [[data.datasets]] table with its own settings."""
    index: int  # its position in Dataset.specs (Item.source)
    name: str
    root: Path
    settings: DataConfig  # data.* with this dataset's table over it
    resolution: int
    repeats: int | None = None  # the table's repeats, over kohya folder names
    is_reg: bool = False
    field: str = "data.dirs"  # where errors point: "data.datasets[1]"


class DataError(Exception):
    """The dataset cannot be used as configured; the message says what to do."""


@dataclass
class Dataset:
    items: list[Item]
    problems: list[Problem]
    resolution: int
    bucket_step: int
    roots: list[Path] = field(default_factory=list)
    # Things a user should know that are not errors (fallback captions, upscaled images...).
    notes: list[str] = field(default_factory=list)
    specs: list[DatasetSpec] = field(default_factory=list)

    def __len__(self) -> int:
        return sum(item.repeats for item in self.items)

    def expanded(self) -> list[int]:
        """Item index for every position of an epoch: item i appears items[i].repeats times."""
        return [i for i, item in enumerate(self.items) for _ in range(item.repeats)]

    def bucket_histogram(self, items: list[Item] | None = None) -> dict[tuple[int, int], int]:
        """Images per bucket (not counting repeats), narrowest (tallest) bucket first. A bucket is a shape:
        datasets at different resolutions have buckets of different areas, so they never share a batch."""
        counts = Counter(item.bucket for item in (self.items if items is None else items))
        return dict(sorted(counts.items(), key=lambda kv: (kv[0][0] / kv[0][1], kv[0])))

    def spec_items(self, spec: DatasetSpec) -> list[Item]:
        return [it for it in self.items if it.source == spec.index]

    def summary(self) -> list[dict]:
        """Per dataset: what it holds and how it trains (the run's dataset event, the UI)."""
        out = []
        for spec in self.specs:
            mine = self.spec_items(spec)
            out.append({"name": spec.name, "path": str(spec.root), "images": len(mine),
                        "samples": sum(it.repeats for it in mine), "resolution": spec.resolution,
                        "is_regularization": spec.is_reg, "trigger_word": spec.settings.trigger_word,
                        "buckets": {f"{w}x{h}": n for (w, h), n in self.bucket_histogram(mine).items()}})
        return out

    def report(self) -> str:
        n = len(self.items)
        resolutions = sorted({spec.resolution for spec in self.specs} or {self.resolution})
        shown_res = ", ".join(map(str, resolutions))
        lines = [f"{n} images ({len(self)} per epoch with repeats) from {len(self.specs or self.roots)} "
                 f"dataset(s); resolution {shown_res}, bucket sides in steps of {self.bucket_step}"]
        for spec in self.specs:
            mine = self.spec_items(spec)
            repeats = sorted({it.repeats for it in mine})
            shown = "" if repeats in ([], [1]) else f", repeats {', '.join(map(str, repeats))}"
            label = str(spec.root) if spec.field == "data.dirs" else f"{spec.field} {spec.name} ({spec.root})"
            extra = []
            if len(resolutions) > 1:
                extra.append(f"resolution {spec.resolution}")
            if spec.is_reg:
                extra.append("regularization")
            if spec.settings.trigger_word and spec.field != "data.dirs":
                extra.append(f"trigger {spec.settings.trigger_word!r}")
            lines.append(f"  {label}: {len(mine)} images{shown}" + "".join(f", {e}" for e in extra))
        captioned = sum(it.has_caption for it in self.items)
        pct = f" ({100 * captioned / n:.0f}%)" if n else ""
        lines.append(f"captions: {captioned} of {n} images have one{pct}")
        for res in resolutions:
            hist = self.bucket_histogram([it for it in self.items if self._resolution_of(it) == res])
            if not hist:
                continue
            lines.append("buckets (width x height: images):" if len(resolutions) == 1 else
                         f"buckets at resolution {res} (width x height: images):")
            top = max(hist.values())
            for (w, h), count in hist.items():
                bar = "#" * max(1, round(30 * count / top))
                lines.append(f"  {w:>5}x{h:<5} {count:>6}  {bar}")
        lines.extend(f"note: {note}" for note in self.notes)
        if self.problems:
            lines.append(f"problems: {len(self.problems)}, each skipped")
            lines.extend(f"  {p.path}: {p.reason}" for p in self.problems)
        else:
            lines.append("problems: none")
        return "\n".join(lines)

    def _resolution_of(self, item: Item) -> int:
        return self.specs[item.source].resolution if self.specs else self.resolution

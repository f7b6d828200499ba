"""SDXL training data: find images and captions, bucket them by aspect, load pixels with SDXL's
micro-conditioning, build captions, and draw batches one bucket at a time.

`scan()` reads every file once before training: bad images and captions are listed with their
reason and skipped, a caption setting that matches nothing stops the run with the fix, and the run
stops only if nothing usable remains. Source files are only ever opened for reading.
"""
from __future__ import annotations

import csv
import errno
import io
import json
import logging
import math
import os
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from sdxl_lora.sdxl.config import DataConfig
from sdxl_lora.sdxl.images import IMAGE_EXTENSIONS, ImageProblem, open_image, probe_image

log = logging.getLogger(__name__)

# Caption extensions people use; checked when the configured one matches nothing.
CAPTION_EXTENSIONS = (".txt", ".caption", ".tag", ".md")
METADATA_FILES = ("metadata.jsonl", "metadata.csv")
METADATA_CAPTION_FIELDS = ("text", "caption")
# kohya's folder convention: "10_sks dog" means every image inside is seen 10 times an epoch.
_REPEATS_PREFIX = re.compile(r"^([1-9][0-9]*)_(.+)$")
_MAX_LISTED = 20
# A caption file is read to this many bytes. The text encoders take 77 tokens (a few hundred characters) and a
# long tag list is a few KiB, so every real caption is read whole, shuffled tags included; a file that is no
# caption (a log or a dump saved as .txt) costs one small read, not minutes and gigabytes of tokenizing.
CAPTION_BYTES = 64 * 1024
# kohya's wildcard: {a|b|c}, one choice each time; {{ and }} are braces themselves.
_WILDCARD = re.compile(r"\{([^{}]*\|[^{}]*)\}")


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


# ---------------------------------------------------------------------------------------- buckets

def make_buckets(resolution: int, step: int, max_aspect: float) -> list[tuple[int, int]]:
    """(width, height) buckets with sides in multiples of `step`, area at most about resolution^2 and
    aspect at most `max_aspect`; for each height the widest such width is kept. Sorted by aspect."""
    if step < 8 or step % 8:
        raise DataError(f"data.bucket_step={step} must be a positive multiple of 8 (the VAE downsamples by 8)")
    if resolution < step:
        raise DataError(f"resolution {resolution} is smaller than data.bucket_step={step}; lower the step")
    if max_aspect < 1.0:
        raise DataError(f"data.max_aspect={max_aspect} must be at least 1.0 (it bounds long side / short side)")
    side = max(step, round(resolution / step) * step)
    area = side * side
    widest: dict[int, int] = {}  # height -> widest landscape width that fits the area
    w = side
    while True:
        h = (area // w) // step * step
        if h < step or w / h > max_aspect:
            break
        widest[h] = w
        w += step
    buckets = {(w, h) for h, w in widest.items()} | {(h, w) for h, w in widest.items()}
    return sorted(buckets, key=lambda b: (b[0] / b[1], b))


def nearest_bucket(size: tuple[int, int], buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is closest to the image's, by log-aspect (so 2:1 and 1:2 are
    equally far from 1:1); ties go to the larger bucket."""
    w, h = size
    target = math.log(w / h)
    return min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - target), -b[0] * b[1], b))


# ------------------------------------------------------------------------------------------- scan

@dataclass
class _Candidate:
    root: Path
    path: Path
    repeats: int
    caption: str | None
    mask: Path | None = None


def _mask_of(stem: str, present: set[str], suffix: str) -> str | None:
    """The file name of an image's mask (`<stem><suffix>.<image ext>`) when the folder has one."""
    for name in sorted(present):
        s, ext = os.path.splitext(name)
        if s == stem + suffix and ext.lower() in IMAGE_EXTENSIONS:
            return name
    return None


@dataclass
class _CaptionCount:
    images: int = 0
    matched: int = 0  # images with a sidecar of the configured extension
    other: Counter = field(default_factory=Counter)  # uncaptioned images with another extension's sidecar


def _root(d: str, where: str) -> Path:
    p = Path(d).expanduser().absolute()
    if not p.exists():
        try:
            p.stat()
        except OSError as e:  # exists() says False for a loop and a dangling link alike
            if e.errno == errno.ELOOP:
                raise DataError(f"{where}: {p} is a symlink loop (its links lead back to themselves); point "
                                "it at the folder that holds the images, or give that folder itself") from None
        if p.is_symlink():
            raise DataError(f"{where}: {p} is a symlink to {os.readlink(p)}, which does not exist — point it at "
                            "the folder that holds the images, or give that folder itself")
        raise DataError(f"{where}: {p} does not exist — check the path")
    if not p.is_dir():
        raise DataError(f"{where}: {p} is a file, not a folder — give the folder that holds the images")
    return p


def _roots(cfg: DataConfig) -> list[Path]:
    if not cfg.dirs:
        raise DataError("data.dirs is empty; give at least one folder of images")
    return [_root(d, "data.dirs") for d in cfg.dirs]


def dataset_specs(cfg: DataConfig, resolution: int) -> list[DatasetSpec]:
    """The datasets a config trains on: its [[data.datasets]] tables, each with data.* under its own settings,
    or else one per data.dirs entry with data.* as it is."""
    if not cfg.datasets:
        return [DatasetSpec(i, root.name, root, cfg, resolution) for i, root in enumerate(_roots(cfg))]
    specs = []
    for i, d in enumerate(cfg.datasets):
        where = f"data.datasets[{i}]"
        if d.path is None:
            continue  # images the base model makes from class_prompt when training starts (sdxl/class_images.py)
        root = _root(d.path, f"{where}.path")
        settings = d.settings(cfg)
        if d.is_regularization:
            # A regularization image shows the class, not the concept: it never learns the trigger word.
            settings = settings.model_copy(update={"trigger_word": ""})
        specs.append(DatasetSpec(len(specs), d.name or root.name, root, settings, settings.resolution or resolution,
                                 repeats=d.repeats, is_reg=d.is_regularization, field=where))
    if all(spec.is_reg for spec in specs):
        raise DataError("every [[data.datasets]] table has is_regularization=true, so nothing teaches the concept "
                        "— add a dataset of your subject (is_regularization=false)")
    return specs


def live_text(cfg: DataConfig) -> bool:
    """Whether some dataset's captions change from one use to the next (tag shuffle or tag dropout), so its
    text embeddings are encoded per sample and the text encoders stay on the device."""
    return any(_live(s) for s in [cfg, *(d.settings(cfg) for d in cfg.datasets)])


def _live(settings: DataConfig) -> bool:
    return settings.shuffle_tags or settings.tag_dropout > 0 or settings.wildcards


def live_caption(item: Item, cfg: DataConfig) -> bool:
    """Whether this image's caption changes from one use to the next, so it is encoded per sample."""
    s = item.settings if item.settings is not None else cfg
    return s.shuffle_tags or s.tag_dropout > 0 or (s.wildcards and _WILDCARD.search(item.caption) is not None)


def _walk(root: Path) -> list[tuple[Path, list[str]]]:
    """(folder, file names) for every folder under root, in a stable order, hidden entries skipped
    (.DS_Store, macOS '._x.jpg' resource forks, .git, caches)."""
    out = []
    def fail(e: OSError) -> None:
        raise DataError(f"cannot list {e.filename}: {e.strerror} — check its permissions")
    for folder, dirs, files in os.walk(root, onerror=fail):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out.append((Path(folder), sorted(f for f in files if not f.startswith("."))))
    return out


def _repeats(root: Path, folder: Path) -> int:
    # The deepest "N_name" folder from the root down to the image decides, so a "10_sks" root or a
    # "10_sks" subfolder both work, and nested sets can override their parent.
    repeats = 1
    for name in (root.name, *folder.relative_to(root).parts):
        m = _REPEATS_PREFIX.match(name)
        if m:
            repeats = int(m.group(1))
    return repeats


def _clean(text: str) -> str:
    # Line breaks and runs of spaces carry no meaning to a text encoder; one line of text does.
    return " ".join(text.split())


def _read_text(path: Path, what: str) -> str:
    """Read a UTF-8 file; raise ValueError whose message is the reason (for a Problem)."""
    return _read_prefix(path, what, None)[0]


def _read_prefix(path: Path, what: str, limit: int | None) -> tuple[str, int]:
    """The first `limit` bytes of a UTF-8 file (all of it: None) as text, and the file's size; ValueError whose
    message is the reason (for a Problem)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(-1 if limit is None else limit)
    except OSError as e:
        raise ValueError(f"cannot read the {what}: {e.strerror or e}") from e
    try:
        return data.decode("utf-8-sig"), size
    except UnicodeDecodeError as e:
        if len(data) < size and e.reason == "unexpected end of data":
            return data[:e.start].decode("utf-8-sig"), size  # the bound cut a character in two
        raise ValueError(f"{what} is not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}) "
                         "— re-save it as UTF-8") from e


def _read_metadata(path: Path, problems: list[Problem]) -> dict[str, tuple[str, int]]:
    """Captions from a metadata.jsonl/.csv: normalised image path -> (caption, line number).

    A damaged line is listed as a problem; a file whose captions cannot be found at all stops the
    run, since training would otherwise silently ignore every caption in it.
    """
    try:
        text = _read_text(path, "metadata file")
    except ValueError as e:
        raise DataError(f"{path}: {e}") from e
    rows: list[tuple[int, dict]] = []
    if path.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append(Problem(path, f"line {n} is not valid JSON ({e.msg}); that line is ignored"))
                continue
            if not isinstance(obj, dict):
                problems.append(Problem(path, f"line {n} is not a JSON object; that line is ignored"))
                continue
            rows.append((n, obj))
        fields = sorted({k for _, obj in rows for k in obj})
    else:
        # newline="" lets a quoted caption span lines, as CSV allows.
        reader = csv.DictReader(io.StringIO(text, newline=""))
        fields = list(reader.fieldnames or [])
        rows = [(reader.line_num, row) for row in reader]
    if rows and ("file_name" not in fields or not any(f in fields for f in METADATA_CAPTION_FIELDS)):
        raise DataError(f"{path}: needs a 'file_name' field and a 'text' or 'caption' field; it has "
                        f"{', '.join(map(repr, fields)) or 'none'} — rename the fields")
    out: dict[str, tuple[str, int]] = {}
    for n, row in rows:
        name = row.get("file_name")
        caption = next((row[f] for f in METADATA_CAPTION_FIELDS if row.get(f) is not None), None)
        if not isinstance(name, str) or not name.strip():
            problems.append(Problem(path, f"line {n} has no file_name; that line is ignored"))
            continue
        if not isinstance(caption, str):
            problems.append(Problem(path, f"line {n} ({name}) has no text or caption; that line is ignored"))
            continue
        out[os.path.normpath(path.parent / name)] = (_clean(caption), n)
    return out


def _caption_extension_error(cfg: DataConfig, counts: dict[Path, _CaptionCount],
                             where: str = "data") -> str | None:
    ext = cfg.caption_extension
    total = sum(c.images for c in counts.values())
    matched = sum(c.matched for c in counts.values())
    other = sum((c.other for c in counts.values()), Counter())
    if matched == 0 and other:
        best, n = other.most_common(1)[0]
        also = "".join(f", {k} have '{e}'" for e, k in other.most_common()[1:])
        return (f"caption_extension='{ext}' matched 0 of {total} images; {n} have '{best}'{also} "
                f"— set {where}.caption_extension='{best}'")
    for root, c in counts.items():
        if c.matched == 0 and c.other:
            best, n = c.other.most_common(1)[0]
            return (f"caption_extension='{ext}' matched 0 of {c.images} images in {root} (it matched "
                    f"{matched} in the other folders); {n} there have '{best}' — one caption_extension "
                    f"applies to every folder in data.dirs, so give those captions the '{ext}' "
                    f"extension (in a copy of the folder) or train that folder separately")
    return None


def _find(cfg: DataConfig, roots: list[Path], problems: list[Problem], seen: set[str],
          where: str = "data") -> tuple[list[_Candidate], list[str]]:
    """Every image under the roots with its caption (or None); caption problems go to `problems`. `seen`
    holds the images earlier datasets took (an image is used once)."""
    candidates: list[_Candidate] = []
    counts: dict[Path, _CaptionCount] = {}
    ignored: Counter = Counter()
    duplicates = 0
    masks_seen = 0
    long_captions: list[tuple[str | Path, int]] = []  # (where, bytes)
    known = set(CAPTION_EXTENSIONS) | {cfg.caption_extension}
    for root in roots:
        folders = _walk(root)
        metadata: dict[str, tuple[str, int]] = {}
        meta_file: dict[str, Path] = {}
        for folder, names in folders:
            for mname in METADATA_FILES:
                if mname in names:
                    found = _read_metadata(folder / mname, problems)
                    metadata.update(found)
                    meta_file.update(dict.fromkeys(found, folder / mname))
        used: set[str] = set()
        count = counts.setdefault(root, _CaptionCount())
        for folder, names in folders:
            present = set(names)
            repeats = _repeats(root, folder)
            stems = {os.path.splitext(n)[0] for n in names if os.path.splitext(n)[1].lower() in IMAGE_EXTENSIONS}
            for name in names:
                stem, ext = os.path.splitext(name)
                if ext.lower() not in IMAGE_EXTENSIONS:
                    if ext.lower() not in known and name not in METADATA_FILES:
                        ignored[ext.lower() or "(no extension)"] += 1
                    continue
                if cfg.mask_suffix and stem.endswith(cfg.mask_suffix) and stem[:-len(cfg.mask_suffix)] in stems:
                    masks_seen += 1  # an image's mask, never a training image itself
                    continue
                path = folder / name
                norm = os.path.normpath(path)
                real = os.path.realpath(path)
                if real in seen:
                    # Overlapping data.dirs (a folder and its subfolder) must not double an image's weight.
                    duplicates += 1
                    used.add(norm)
                    continue
                seen.add(real)
                count.images += 1
                caption: str | None = None
                if stem + cfg.caption_extension in present:
                    count.matched += 1
                    side = folder / (stem + cfg.caption_extension)
                    try:
                        text, size = _read_prefix(side, "caption", CAPTION_BYTES)
                    except ValueError as e:
                        problems.append(Problem(side, f"{e}; its image {name} was skipped"))
                        used.add(norm)
                        continue
                    if size > CAPTION_BYTES:
                        long_captions.append((side, size))
                    caption = _clean(text) or None  # an empty caption file counts as none (it gets the fallback)
                if norm in metadata:
                    used.add(norm)
                    if caption is None:  # a sidecar next to the image wins over a metadata file
                        caption, line = metadata[norm]
                        if len(data := caption.encode()) > CAPTION_BYTES:
                            long_captions.append((f"{meta_file[norm]} line {line}", len(data)))
                            caption = data[:CAPTION_BYTES].decode("utf-8", "ignore")
                if caption is None:
                    for alt in CAPTION_EXTENSIONS:
                        if alt != cfg.caption_extension and stem + alt in present:
                            count.other[alt] += 1
                            break
                mask = _mask_of(stem, present, cfg.mask_suffix) if cfg.masked_loss else None
                candidates.append(_Candidate(root, path, repeats, caption, folder / mask if mask else None))
        for norm, (_, line) in metadata.items():
            if norm not in used:
                what = "is not a supported image type" if os.path.exists(norm) else "was not found"
                problems.append(Problem(meta_file[norm], f"line {line}: {norm} {what}; that line is ignored"))
    error = _caption_extension_error(cfg, counts, where)
    if error:
        raise DataError(error)
    notes = []
    if ignored:
        kinds = ", ".join(f"{ext}: {n}" for ext, n in sorted(ignored.items()))
        notes.append(f"ignored {sum(ignored.values())} file(s) that are not images or captions ({kinds}); "
                     f"images must be one of {' '.join(sorted(IMAGE_EXTENSIONS))}")
    if duplicates:
        notes.append(f"{duplicates} image(s) were reached through more than one dataset folder and are used once")
    if long_captions:
        shown = ", ".join(f"{p} ({size / 2**20:.1f} MiB)" for p, size in long_captions[:3])
        more = f" and {len(long_captions) - 3} more" if len(long_captions) > 3 else ""
        notes.append(f"{len(long_captions)} caption(s) are over {CAPTION_BYTES // 1024} KiB and train with their first "
                     f"{CAPTION_BYTES // 1024} KiB only (the text encoders read 77 tokens): {shown}{more} — is each "
                     "a caption?")
    if masks_seen and not cfg.masked_loss:
        notes.append(f"{masks_seen} file(s) named '<image>{cfg.mask_suffix}.*' look like loss masks: they are not "
                     "trained as images, and not used as masks either (set data.masked_loss=true to use them)")
    return candidates, notes


def _probe(candidates: list[_Candidate], max_pixels: int,
           on_progress: Callable[[int, int], None] | None) -> list[tuple[int, int] | ImageProblem]:
    def one(c: _Candidate) -> tuple[int, int] | ImageProblem:
        try:
            return probe_image(c.path, max_pixels)
        except ImageProblem as e:
            return e
    total = len(candidates)
    results = []
    # Decoding releases the GIL, so a few threads use the cores; more would only hold more images in memory.
    workers = max(1, min(4, os.cpu_count() or 1))
    bar = tqdm(total=total, desc="checking images", unit="img", disable=None if on_progress is None else True)
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        for done, result in enumerate(pool.map(one, candidates), 1):
            results.append(result)
            bar.update(1)
            if on_progress is not None:
                on_progress(done, total)
    finally:
        # A stop between images (Ctrl-C, SIGTERM: training.py) drops the ones not checked yet, not waiting for them.
        pool.shutdown(cancel_futures=True)
    bar.close()
    return results


def fallback_caption(cfg: DataConfig) -> str:
    """What an image without a caption trains with: "<trigger_word> <class_token>" (either may be empty)."""
    return " ".join(part for part in (cfg.trigger_word.strip(), cfg.class_token.strip()) if part)


def scan(cfg: DataConfig, resolution: int,
         on_progress: Callable[[int, int], None] | None = None) -> Dataset:
    """Find every image and caption of every dataset, check each image decodes, and bucket the good ones at
    their dataset's resolution.

    on_progress(done, total) is called as images are checked (a terminal bar is shown otherwise).
    Raises DataError when a folder is missing, the caption setting matches nothing while another
    extension would, a metadata file is unusable, or no usable image remains.
    """
    specs = dataset_specs(cfg, resolution)
    pending = [i for i, d in enumerate(cfg.datasets) if d.path is None]
    problems: list[Problem] = []
    # An image is used once per role: a folder may be both training images and (say, with class captions of
    # another extension) regularization inputs for train.prior_prediction.
    seen: dict[bool, set[str]] = {False: set(), True: set()}
    notes: list[str] = [f"data.datasets[{i}]: {cfg.datasets[i].class_images} image(s) of "
                         f"{cfg.datasets[i].class_prompt!r} are made by the base model when training starts"
                         for i in pending]
    found: list[tuple[DatasetSpec, _Candidate]] = []
    if not cfg.datasets:
        # data.dirs: one set of settings for every folder, checked together (as before datasets tables).
        candidates, notes = _find(cfg, [spec.root for spec in specs], problems, seen[False])  # no tables: none pending
        by_root = {}
        for spec in specs:
            by_root.setdefault(spec.root, spec)
        found = [(by_root[c.root], c) for c in candidates]
    else:
        for spec in specs:
            candidates, more = _find(spec.settings, [spec.root], problems, seen[spec.is_reg], spec.field)
            if not candidates and not any(p.path.is_relative_to(spec.root) for p in problems):
                raise DataError(f"{spec.field}.path: no images found in {spec.root} (looked for "
                                f"{' '.join(sorted(IMAGE_EXTENSIONS))}) — point it at a folder of images or "
                                "remove the table")
            notes += [f"{spec.field} ({spec.name}): {n}" for n in more]
            found += [(spec, c) for c in candidates]
    roots = [spec.root for spec in specs]
    if not found and not problems:
        raise DataError(f"no images found in {', '.join(map(str, roots))} (looked for "
                        f"{' '.join(sorted(IMAGE_EXTENSIONS))}) — point data.dirs at a folder of images"
                        + (f"; {notes[0]}" if notes else ""))
    buckets = {}
    for spec in specs:
        if spec.resolution not in buckets:
            buckets[spec.resolution] = make_buckets(spec.resolution, cfg.bucket_step, cfg.max_aspect)
    items: list[Item] = []
    upscaled: Counter = Counter()
    over_aspect = 0
    for (spec, c), result in zip(found, _probe([c for _, c in found], cfg.max_pixels, on_progress)):
        if isinstance(result, ImageProblem):
            problems.append(Problem(c.path, str(result)))
            continue
        w, h = result
        if min(w, h) < cfg.min_side:
            problems.append(Problem(c.path, f"{w}x{h} is too small to train on (a side under "
                                            f"data.min_side={cfg.min_side} px)"))
            continue
        small_side = spec.resolution * cfg.min_size_fraction
        if w * h < small_side * small_side:
            if spec.settings.small_images == "skip":
                problems.append(Problem(
                    c.path, f"{w}x{h} is under the {small_side:.0f}x{small_side:.0f} pixel count that "
                            f"data.min_size_fraction={cfg.min_size_fraction} of resolution {spec.resolution} asks "
                            "for, and data.small_images='skip' (set 'upscale' to use it)"))
                continue
            upscaled[round(small_side)] += 1
        if max(w / h, h / w) > cfg.max_aspect:
            over_aspect += 1
        if c.mask is not None:
            _check_mask(c.mask, c.path, (w, h), cfg.max_pixels)
        items.append(Item(path=c.path, caption=c.caption or "", repeats=spec.repeats or c.repeats, size=(w, h),
                          bucket=nearest_bucket((w, h), buckets[spec.resolution]), dataset=c.root,
                          has_caption=bool(c.caption), mask=c.mask, settings=spec.settings, is_reg=spec.is_reg,
                          source=spec.index))
    for spec in specs:
        mine = [it for it in items if it.source == spec.index]
        uncaptioned = sum(not it.has_caption for it in mine)
        if not uncaptioned:
            continue
        where = "" if spec.field == "data.dirs" else f"{spec.field} ({spec.name}): "
        fallback = fallback_caption(spec.settings)
        if fallback:
            message = f"{where}{uncaptioned} of {len(mine)} images have no caption; they train with {fallback!r}"
        else:
            fix = "data.trigger_word or data.class_token" if not where else f"{spec.field}.class_token"
            message = (f"{where}{uncaptioned} of {len(mine)} images have no caption and no fallback, so they train "
                       f"with an empty caption — set {fix} to give them one")
        log.warning(message)
        notes.append(message)
        if not cfg.datasets:
            break  # one set of settings: one note for every folder
    if cfg.masked_loss:
        unmasked = [it for it in items if it.mask is None]
        if unmasked:
            notes.append(f"data.masked_loss: {len(unmasked)} of {len(items)} images have no mask "
                         f"('<image>{cfg.mask_suffix}.png' beside it) and train on every pixel, e.g. "
                         f"{unmasked[0].path.name}")
    for side, n in sorted(upscaled.items()):
        notes.append(f"{n} image(s) are smaller than {side}x{side} pixels and "
                     "will be upscaled (data.small_images='skip' leaves them out)")
    if over_aspect:
        notes.append(f"{over_aspect} image(s) are more elongated than data.max_aspect={cfg.max_aspect} "
                     "and will be cropped to the nearest bucket")
    if any(it.is_reg for it in items):
        items, note = balance_regularization(items)
        notes.append(note)
    dataset = Dataset(items=items, problems=problems, resolution=resolution,
                      bucket_step=cfg.bucket_step, roots=roots, notes=notes, specs=specs)
    if problems:
        log.warning("%d problem(s) found and skipped; the dataset report lists each with its reason", len(problems))
    if not items:
        listed = "\n".join(f"  {p.path}: {p.reason}" for p in problems[:_MAX_LISTED])
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise DataError(f"no usable images remain in {', '.join(map(str, roots))}; every file was skipped:\n"
                        f"{listed}{more}\nfix or replace those files, or point data.dirs at another folder")
    return dataset


def balance_regularization(items: list[Item]) -> tuple[list[Item], str]:
    """Regularization images repeated (or left out) so that an epoch holds as many regularization samples as
    training samples, and a note saying so.

    This is kohya's balance (sd-scripts, library/train_util.py, DreamBoothDataset.__init__, commit
    48d368fa557731ad0488c07304dfeba8c07910eb): going through the regularization images in order, each is taken
    with its own repeats until their count reaches the training samples'; when that is not reached yet after
    all of them, the round goes on adding one repeat to each in turn. With more regularization samples than
    training samples the last ones are not used. Order: the scan's (dataset tables, then paths), so it is the
    same every run.
    """
    train = [it for it in items if not it.is_reg]
    reg = [it for it in items if it.is_reg]
    target = sum(it.repeats for it in train)
    before = sum(it.repeats for it in reg)
    used: list[Item] = []
    total = 0
    for it in reg:  # first round: each with its configured repeats
        if total >= target:
            break
        used.append(it)
        total += it.repeats
    while total < target:  # later rounds: one more repeat each, in turn
        for it in used:
            it.repeats += 1
            total += 1
            if total >= target:
                break
    left = len(reg) - len(used)
    note = (f"regularization: {len(reg)} image(s), {before} sample(s) per epoch as configured, balanced to "
            f"{total} to match the {target} training sample(s) per epoch (as kohya does)")
    if left:
        note += f"; {left} image(s) beyond that are not used — fewer regularization images or more repeats on " \
                "the training datasets would use them"
    kept = {id(it) for it in used}
    return [it for it in items if not it.is_reg or id(it) in kept], note


def inspect_text(cfg: DataConfig, resolution: int, doctor: bool = False, batch_size: int = 1) -> str:
    """The dataset report `sdxl-lora dataset inspect` prints, with the doctor's findings (sdxl/doctor.py);
    DataError propagates with its fix."""
    dataset = scan(cfg, resolution)
    if not doctor:
        return dataset.report()
    from .doctor import doctor_lines

    return "\n".join([dataset.report(), *doctor_lines(dataset, batch_size)])


# ------------------------------------------------------------------------------ pixels & captions

def load_pixels(item: Item, crop: str, flip: bool,
                rng: random.Random) -> tuple[torch.Tensor, tuple[int, int, int, int, int, int]]:
    """Pixels float32 [3, H, W] in [-1, 1] at exactly the item's bucket, and SDXL's time_ids.

    The image is resized so it covers the bucket, mirrored if `flip` (the caller draws it, so a
    cache can key on it), then cropped: "center", or "random" (position drawn from rng).
    time_ids = (original_h, original_w, crop_top, crop_left, target_h, target_w) as SDXL was trained:
    original size before resizing, crop top-left in the resized (and mirrored) image, as diffusers'
    SDXL training example computes them.
    """
    w, h = item.size
    # The scan already applied data.max_pixels; this limit only guards against a file replaced since.
    limit = max(w * h, DataConfig.model_fields["max_pixels"].default)
    try:
        img = open_image(item.path, max_pixels=limit)
    except ImageProblem as e:
        raise ImageProblem(f"{item.path}: {e} (it was readable when the dataset was scanned; "
                           "was it changed or replaced since?)") from e
    if img.size != (w, h):
        raise ImageProblem(f"{item.path} is now {img.size[0]}x{img.size[1]} but was {w}x{h} when the dataset "
                           "was scanned — the file changed; start the run again to rescan")
    bw, bh = item.bucket
    scale = max(bw / w, bh / h)
    rw, rh = max(bw, round(w * scale)), max(bh, round(h * scale))
    if (rw, rh) != (w, h):
        # reducing_gap first shrinks big photos by a cheap integer box filter, then Lanczos finishes.
        img = img.resize((rw, rh), Image.Resampling.LANCZOS, reducing_gap=3.0 if scale < 1 else None)
    if flip:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if crop == "center":
        top, left = int(round((rh - bh) / 2.0)), int(round((rw - bw) / 2.0))
    elif crop == "random":
        top, left = rng.randint(0, rh - bh), rng.randint(0, rw - bw)
    else:
        raise ValueError(f"crop={crop!r}: use 'center' or 'random'")
    img = img.crop((left, top, left + bw, top + bh))
    arr = np.asarray(img, dtype=np.uint8)
    pixels = torch.from_numpy(arr.copy()).permute(2, 0, 1).float().div_(127.5).sub_(1.0).contiguous()
    return pixels, (h, w, top, left, bh, bw)


def _check_mask(mask: Path, image: Path, size: tuple[int, int], max_pixels: int) -> None:
    try:
        msize = probe_image(mask, max_pixels)
    except ImageProblem as e:
        raise DataError(f"mask {mask} (of {image.name}) cannot be read: {e} — fix or remove it") from e
    if msize != size:
        raise DataError(f"mask {mask} is {msize[0]}x{msize[1]} but its image {image.name} is {size[0]}x{size[1]}; "
                        "a mask must have its image's size — resize the mask (or remove it to train on every pixel)")


def load_mask(item: Item, flip: bool, time_ids) -> torch.Tensor:
    """The item's loss mask, float32 [1, H/8, W/8] in [0, 1] at latent resolution: resized, mirrored and
    cropped exactly as its image was (the crop read from the image's time_ids), then box-averaged down
    by the VAE's factor 8, so a latent pixel's weight is the mean of the pixels it covers. All ones
    (every pixel learns) when the item has no mask."""
    bw, bh = item.bucket
    if item.mask is None:
        return torch.ones(1, bh // 8, bw // 8)
    w, h = item.size
    img = open_image(item.mask, max_pixels=max(w * h, DataConfig.model_fields["max_pixels"].default)).convert("L")
    if img.size != (w, h):
        raise DataError(f"mask {item.mask} is now {img.size[0]}x{img.size[1]} but its image is {w}x{h}; "
                        "a mask must have its image's size")
    # The same cover-resize as load_pixels (bilinear: a mask's grey levels must stay within [0, 1]).
    scale = max(bw / w, bh / h)
    rw, rh = max(bw, round(w * scale)), max(bh, round(h * scale))
    if (rw, rh) != (w, h):
        img = img.resize((rw, rh), Image.Resampling.BILINEAR)
    if flip:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    top, left = int(time_ids[2]), int(time_ids[3])
    img = img.crop((left, top, left + bw, top + bh)).resize((bw // 8, bh // 8), Image.Resampling.BOX)
    return torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)[None].contiguous()


def _has_word(text: str, word: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text) is not None


def _tags(text: str, settings: DataConfig) -> tuple[list[str], list[str], list[str]]:
    """A caption's comma-separated tags as (kept first, free, kept last): data.keep_tokens_separator marks the
    kept parts when the caption has it (kohya's 'a, b ||| c, d ||| e'), else the first keep_tokens are kept."""
    def split(part: str) -> list[str]:
        return [t.strip() for t in part.split(",") if t.strip()]
    sep = settings.keep_tokens_separator
    if sep and sep in text:
        head, rest = text.split(sep, 1)
        rest, _, tail = rest.partition(sep)
        return split(head), split(rest), split(tail)
    tags = split(text)
    keep = max(0, settings.keep_tokens)
    return tags[:keep], tags[keep:], []


def _wildcards(text: str, rng: random.Random | None) -> str:
    """Each {a|b|c} replaced by one of its choices (rng None: the first, for the text cache)."""
    text = text.replace("{{", "\0").replace("}}", "\1")
    text = _WILDCARD.sub(lambda m: (rng.choice if rng else (lambda c: c[0]))(m.group(1).split("|")).strip(), text)
    return text.replace("\0", "{").replace("\1", "}")


def make_caption(item: Item, cfg: DataConfig, rng: random.Random, fixed: bool = False) -> str:
    """The caption an image trains with this time, by its dataset's settings (item.settings; `cfg` for an item
    made without them). In order, as kohya's sd-scripts process a caption:

    - caption dropout: with probability caption_dropout the caption is "" (for classifier-free guidance);
    - no caption: "<trigger_word> <class_token>";
    - caption_prefix and caption_suffix around it;
    - wildcards: each {a|b|c} becomes one of its choices;
    - tags: the kept ones (keep_tokens, or keep_tokens_separator) stay in place, each other tag is left out with
      probability tag_dropout, and with shuffle_tags the rest are shuffled;
    - a trigger word missing from the caption is put first, so every image teaches it (a regularization
      dataset has none).

    fixed=True: the caption without its random parts (no dropout, no shuffle), as the text cache holds it.
    """
    s = item.settings if item.settings is not None else cfg
    if not fixed and s.caption_dropout > 0 and rng.random() < s.caption_dropout:
        return ""
    text = item.caption if item.has_caption else fallback_caption(s)
    text = " ".join(part for part in (s.caption_prefix.strip(), text, s.caption_suffix.strip()) if part)
    if s.wildcards:
        text = _wildcards(text, None if fixed else rng)
    tagged = s.keep_tokens_separator and s.keep_tokens_separator in text
    if tagged or (not fixed and _live(s)):
        head, rest, tail = _tags(text, s)
        if not fixed and s.tag_dropout > 0:
            rest = [t for t in rest if rng.random() >= s.tag_dropout]
        if not fixed and s.shuffle_tags:
            rng.shuffle(rest)
        text = ", ".join(head + rest + tail)
    trigger = s.trigger_word.strip()
    if trigger and not _has_word(text, trigger):
        text = f"{trigger}, {text}" if text else trigger
    return text


# ---------------------------------------------------------------------------------------- sampler

class BucketBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Batches of positions in `dataset.expanded()`, every batch from one bucket (so they stack).

    Each epoch shuffles within buckets and then the order of batches, from (seed, epoch) alone, so
    a resumed run sees the same batches. With several processes (DDP) the epoch is cut into global
    batches of batch_size x num_replicas, and each global batch is split between the processes: at
    every step they all train on the same bucket, no image comes twice in an epoch, and the global
    batch holds exactly the images one process with batch_size x num_replicas would take at that
    step. A bucket's last, partial global batch is split as evenly as it goes (when it has fewer
    images than processes, its images are repeated so each process has one); drop_last leaves
    partial batches out instead. Positions (skip_next, len) count global batches, so they mean the
    same on any number of processes.
    """

    def __init__(self, dataset: Dataset, batch_size: int, seed: int, num_replicas: int = 1,
                 rank: int = 0, drop_last: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must be in 0..{num_replicas - 1}")
        super().__init__()
        self.batch_size = batch_size
        self.global_batch_size = batch_size * num_replicas
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = drop_last
        self.epoch = 0
        self.skip = 0
        groups: dict[tuple[int, int], list[int]] = {}
        for pos, i in enumerate(dataset.expanded()):
            groups.setdefault(dataset.items[i].bucket, []).append(pos)
        self._groups = dict(sorted(groups.items()))
        sizes = [len(g) for g in self._groups.values()]
        if not sizes:
            raise DataError("the dataset has no images to draw batches from")
        gb = self.global_batch_size
        self._total = sum(n // gb if drop_last else -(-n // gb) for n in sizes)
        if self._total < 1:
            raise DataError(f"batch_size={batch_size} x {num_replicas} process(es) with drop_last leaves no full "
                            f"batch (the largest bucket has {max(sizes)} images) — lower train.batch_size or add images")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip_next(self, batches: int) -> None:
        """The next iteration leaves out its first `batches` global batches (resuming mid-epoch). Kept
        apart from set_epoch, which may be called again on every iteration."""
        self.skip = batches

    def __len__(self) -> int:
        return self._total

    def batch_shapes(self) -> list[tuple[tuple[int, int], int]]:
        """(bucket, batch size) of every batch this process can be given: each bucket's full batches and
        its last, partial one (what CUDA graphs capture, one pair per shape)."""
        gb, shapes = self.global_batch_size, set()
        for bucket, positions in self._groups.items():
            n = len(positions)
            sizes = {gb} if n >= gb else set()
            if n % gb and not self.drop_last:
                sizes.add(n % gb)
            shapes |= {(bucket, len(self.share(list(range(size))))) for size in sizes}
        return sorted(shapes)

    def global_batches(self) -> list[list[int]]:
        """The epoch's global batches, in order: the same whatever this process's rank."""
        # A string seed hashes the same in every process (unlike hash() of a tuple).
        rng = random.Random(f"{self.seed}:{self.epoch}")
        batches = []
        for positions in self._groups.values():
            order = list(positions)
            rng.shuffle(order)
            for start in range(0, len(order), self.global_batch_size):
                batch = order[start:start + self.global_batch_size]
                if len(batch) == self.global_batch_size or not self.drop_last:
                    batches.append(batch)
        rng.shuffle(batches)
        return batches

    def share(self, batch: list[int]) -> list[int]:
        """This process's contiguous slice of a global batch (sizes differ by at most one)."""
        n = self.num_replicas
        if len(batch) < n:
            batch = [batch[i % len(batch)] for i in range(n)]
        size, extra = divmod(len(batch), n)
        start = self.rank * size + min(self.rank, extra)
        return batch[start:start + size + (self.rank < extra)]

    def __iter__(self) -> Iterator[list[int]]:
        skip, self.skip = self.skip, 0
        for batch in self.global_batches()[skip:]:
            yield self.share(batch)

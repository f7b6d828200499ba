"""SDXL training data: find every dataset's images, captions and masks, check each image once, and bucket
the good ones by aspect (`scan`); the report and the doctor's findings `dataset inspect` prints.

`scan()` reads every file once before training: bad images and captions are listed with their
reason and skipped, a caption setting that matches nothing stops the run with the fix, and the run
stops only if nothing usable remains. Source files are only ever opened for reading.

The rest of the data path has a module each: what a scan finds (dataset.py), buckets and the batch sampler
(buckets.py), captions (captions.py), pixels and masks (pixels.py). Callers import their names from those
modules, not from here.
"""
from __future__ import annotations

import csv
import errno
import io
import json
import logging
import os
import re
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from sdxl_lora.sdxl.config import DataConfig
from sdxl_lora.sdxl.images import IMAGE_EXTENSIONS, ImageProblem, probe_image

from .buckets import make_buckets, nearest_bucket
from .captions import fallback_caption
from .dataset import DataError, Dataset, DatasetSpec, Item, Problem
from .pixels import check_mask

__all__ = ["CAPTION_BYTES", "CAPTION_EXTENSIONS", "balance_regularization", "dataset_specs", "inspect_text", "scan"]

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
            check_mask(c.mask, c.path, (w, h), cfg.max_pixels)
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


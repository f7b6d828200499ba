"""The dataset doctor (`sdxl-lora dataset inspect`): what in a scanned dataset is likely to hurt training,
though none of it is an error: duplicate and near-duplicate images, captions without their dataset's trigger
word, the tags every caption repeats, subjects upscaled a lot to fit their bucket, and steps and repeats
suggested for the dataset's size. It only reads the images.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
from PIL import Image
from tqdm import tqdm

from .cache import file_digest
from .captions import has_word
from .dataset import Dataset, Item
from .images import ImageProblem, open_image

# The dHash's side (HASH x HASH bits) and how many bits may differ for two images to count as near-duplicates:
# a re-save, a resize or a small crop of one image stays within it; different photos of one subject rarely do.
HASH = 16
NEAR_BITS = 24
# dHash sees only brightness gradients: near-duplicates also have about the same colours (no cell of their 8x8
# thumbnails differs by more than this, on 0..255), so the same shape in two colours is not one.
NEAR_COLOUR = 48.0
# An image scaled up more than this to cover its bucket trains on interpolated detail.
UPSCALE_LIMIT = 2.0
# The views of each training image the suggested steps aim at: the common rule of thumb for one subject
# (kohya's "10 repeats x 10 epochs").
VIEWS_PER_IMAGE = 100
_SHOWN = 5


def dhash(img: Image.Image, size: int = HASH) -> np.ndarray:
    """The difference hash of an image, size x size bits packed in bytes: grey, shrunk to (size + 1) x size,
    one bit per pair of neighbours in a row (is the left one brighter). The idea is Neal Krawetz's dHash
    ("Kind of Like That", The Hacker Factor Blog, 2013): it follows the gradients of the picture, so it
    survives resizing and recompression."""
    small = np.asarray(img.convert("L").resize((size + 1, size), Image.Resampling.BOX), dtype=np.int16)
    return np.packbits(small[:, :-1] > small[:, 1:])


def colours(img: Image.Image) -> np.ndarray:
    """An 8x8 RGB thumbnail, as float32: what dHash leaves out."""
    return np.asarray(img.convert("RGB").resize((8, 8), Image.Resampling.BOX), dtype=np.float32)


@dataclass
class Findings:
    duplicates: list[list[Item]]  # groups of byte-identical images
    near: list[list[Item]]  # groups of images whose dHashes are within NEAR_BITS (and not identical)
    no_trigger: dict[int, list[Item]]  # dataset index -> its captioned images whose caption lacks the trigger
    with_trigger: dict[int, int]  # dataset index -> how many of its captions hold the trigger
    reg_with_trigger: list[Item]  # regularization captions that hold a training dataset's trigger word
    tags: Counter
    captioned: int
    upscaled: list[tuple[Item, float]]


def _groups(items: list[Item], same) -> list[list[Item]]:
    """Connected groups of items under the relation same(i, j), each group of two or more, in item order."""
    parent = list(range(len(items)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in same:
        parent[find(i)] = find(j)
    groups: dict[int, list[Item]] = {}
    for i, it in enumerate(items):
        groups.setdefault(find(i), []).append(it)
    return [g for g in groups.values() if len(g) > 1]


def examine(dataset: Dataset, show: bool = True) -> Findings:
    items = dataset.items
    digests, hashes, thumbs = [], [], []
    for it in tqdm(items, desc="doctor: hashing images", unit="img", disable=None if show else True):
        digests.append(file_digest(it.path))
        try:
            img = open_image(it.path, max(it.size[0] * it.size[1], 1))
            hashes.append(dhash(img))
            thumbs.append(colours(img))
        except ImageProblem:
            hashes.append(None)  # changed since the scan; the scan's report is the place for it
            thumbs.append(None)
    by_digest: dict[str, list[int]] = {}
    for i, d in enumerate(digests):
        by_digest.setdefault(d, []).append(i)
    exact = [(g[0], j) for g in by_digest.values() for j in g[1:]]
    duplicates = _groups(items, exact)
    # Near-duplicates: every pair's Hamming distance, one row at a time (n^2 / 2 XORs), then the colours of the
    # close ones.
    known = [i for i, h in enumerate(hashes) if h is not None]
    codes = np.stack([hashes[i] for i in known]) if known else np.zeros((0, HASH * HASH // 8), np.uint8)
    pairs = []
    for a in range(len(known)):
        dist = np.unpackbits(np.bitwise_xor(codes[a + 1:], codes[a]), axis=1).sum(axis=1)
        for b in np.nonzero(dist <= NEAR_BITS)[0]:
            i, j = known[a], known[a + 1 + int(b)]
            if digests[i] != digests[j] and np.abs(thumbs[i] - thumbs[j]).max() <= NEAR_COLOUR:
                pairs.append((i, j))
    near = _groups(items, pairs)
    no_trigger: dict[int, list[Item]] = {}
    with_trigger: dict[int, int] = {}
    triggers = {spec.settings.trigger_word.strip() for spec in dataset.specs if not spec.is_reg} - {""}
    reg_with_trigger = []
    for it in items:
        if not it.has_caption:
            continue  # the fallback caption holds the trigger word
        trigger = (it.settings.trigger_word.strip() if it.settings is not None else "")
        if it.is_reg:
            if any(has_word(it.caption, t) for t in triggers):
                reg_with_trigger.append(it)
        elif trigger and not has_word(it.caption, trigger):
            no_trigger.setdefault(it.source, []).append(it)
        elif trigger:
            with_trigger[it.source] = with_trigger.get(it.source, 0) + 1
    tags: Counter = Counter()
    for it in items:
        if it.has_caption:
            tags.update({t.strip().lower() for t in it.caption.split(",") if t.strip()})
    upscaled = []
    for it in items:
        scale = max(it.bucket[0] / it.size[0], it.bucket[1] / it.size[1])
        if scale > UPSCALE_LIMIT:
            upscaled.append((it, scale))
    return Findings(duplicates, near, no_trigger, with_trigger, reg_with_trigger, tags, sum(it.has_caption for it in items),
                    sorted(upscaled, key=lambda p: -p[1]))


def suggestion(dataset: Dataset, batch_size: int) -> list[str]:
    """Steps for the dataset's size, and repeats that balance its training datasets, each with how it is derived."""
    train = [it for it in dataset.items if not it.is_reg]
    if not train:
        return []
    mean_repeats = sum(it.repeats for it in train) / len(train)
    epochs = max(1, math.ceil(VIEWS_PER_IMAGE / mean_repeats))
    per_epoch = math.ceil(len(dataset) / batch_size)
    lines = [f"suggested train.steps: about {epochs * per_epoch} — each of the {len(train)} training image(s) seen "
             f"about {VIEWS_PER_IMAGE} times (the rule of thumb for one subject, kohya's 10 repeats x 10 epochs): "
             f"{VIEWS_PER_IMAGE} / {mean_repeats:g} repeats on average = {epochs} epoch(s) of {per_epoch} step(s) "
             f"({len(dataset)} samples, batch {batch_size}); fewer if previews look overcooked"]
    sizes = {spec.index: sum(1 for it in train if it.source == spec.index) for spec in dataset.specs
             if not spec.is_reg}
    sizes = {k: n for k, n in sizes.items() if n}
    if len(sizes) > 1:
        top = max(sizes.values())
        parts = [f"{dataset.specs[k].name}: {max(1, round(top / n))}" for k, n in sizes.items()]
        lines.append(f"suggested repeats, so each training dataset counts about the same per epoch (the largest "
                     f"one's image count over each one's): {', '.join(parts)}")
    return lines


def lacking(missing: int, holding: int, name: str | None, trigger: str) -> tuple[str, str]:
    """What the doctor says of a dataset's captions without its trigger word: the finding, and what to do. Where
    others in it hold the word, the ones without may be a prior set on purpose (other subjects the model should
    keep drawing as before, as in the bundled sample data), which the trigger word would teach as the concept too:
    both ways on are named."""
    said = f"{missing} caption(s){f' in {name}' if name else ''} lack the trigger word {trigger!r}"
    if not holding:
        return said, "training puts it first in each; add it to the captions, or leave that to training"
    return (f"{said}, which {holding} hold",
            "if those show other subjects the model should keep drawing as before (a prior set, as in the bundled "
            "sample data), leave their captions and train them without the word (no trigger word for the run, as "
            "the default job does, or their own folder ticked as regularization); if they show your subject, add "
            "the word to them")


def doctor_lines(dataset: Dataset, batch_size: int, show: bool = True) -> list[str]:
    f = examine(dataset, show)

    def names(group: list[Item]) -> str:
        return ", ".join(str(it.path) for it in group[:_SHOWN]) + (" ..." if len(group) > _SHOWN else "")

    lines = ["doctor:"]
    if f.duplicates:
        lines.append(f"  duplicates: {len(f.duplicates)} group(s) of identical files, each trains as many times as "
                     "it is there — keep one of each")
        lines += [f"    {names(g)}" for g in f.duplicates]
    if f.near:
        lines.append(f"  near-duplicates: {len(f.near)} group(s) of images that look the same (difference hash "
                     f"within {NEAR_BITS} of {HASH * HASH} bits, about the same colours) — keep the best of each "
                     "unless they differ on purpose")
        lines += [f"    {names(g)}" for g in f.near]
    if not f.duplicates and not f.near:
        lines.append("  duplicates: none (identical or near-identical)")
    for source, missing in f.no_trigger.items():
        spec = dataset.specs[source]
        said, advice = lacking(len(missing), f.with_trigger.get(source, 0), spec.name, spec.settings.trigger_word)
        lines.append(f"  {said} — {advice}: {names(missing)}")
    if f.reg_with_trigger:
        lines.append(f"  {len(f.reg_with_trigger)} regularization caption(s) hold a training dataset's trigger word, "
                     f"which then learns the class too — remove it: {names(f.reg_with_trigger)}")
    tagged = f.captioned and sum(f.tags.values()) >= 2 * f.captioned
    if f.tags and not tagged:
        lines.append("  tags: the captions are sentences, not comma-separated tags (no tag table)")
    elif f.tags:
        lines.append(f"  tags (comma-separated, in how many of the {f.captioned} captions):")
        for tag, n in f.tags.most_common(15):
            lines.append(f"    {n:>6}  {100 * n / f.captioned:>3.0f}%  {tag}")
    if f.upscaled:
        lines.append(f"  {len(f.upscaled)} image(s) upscaled more than {UPSCALE_LIMIT:g}x to cover their bucket (the "
                     "subject trains on interpolated detail) — use larger images or a lower resolution:")
        lines += [f"    {it.path}: {it.size[0]}x{it.size[1]} -> {it.bucket[0]}x{it.bucket[1]} ({s:.1f}x)"
                  for it, s in f.upscaled[:_SHOWN]]
    lines += [f"  {line}" for line in suggestion(dataset, batch_size)]
    return lines

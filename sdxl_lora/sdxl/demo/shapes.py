"""Synthetic captioned shapes, made by code, and a detector that scores generated images for a concept.

The generator draws one coloured shape on a plain background ("a red circle on a grey background"),
deterministic from (seed, index): no files, any number of images, on any device, in batches. It feeds
the demo base's pretraining (sdxl/demo/pretrain.py: circles, squares and triangles) and the demo LoRA's
images (a shape the base never saw: the star).

The detector is deliberately small and deterministic, with no learned weights, so a score means the
same thing on every machine: segment the foreground by its colour distance to the background (the
median colour of the border), keep the largest connected blob, and read
  - shape from two descriptors: fill (blob area / bounding-box area: square 1, circle 0.79,
    triangle 0.51, star 0.41) and solidity (blob area / convex-hull area: about 1 for the convex
    shapes, 0.59 for the star);
  - colour from the blob's mean colour against the palette.
Each becomes a probability with an "other" class, so noise and blobs that are no shape score low.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220),
           "yellow": (235, 210, 40), "purple": (140, 50, 170), "orange": (240, 140, 30)}
BACKGROUNDS = {"white": (245, 245, 245), "black": (20, 20, 20), "grey": (128, 128, 128)}
# What the demo base is pretrained on, and the concept it never sees (taught by the demo LoRA).
BASE_SHAPES = ("circle", "square", "triangle")
NEW_SHAPES = ("star",)
SHAPES = BASE_SHAPES + NEW_SHAPES
STAR_INNER = 0.45  # inner / outer radius of the 5-pointed star (a regular pentagram is 0.38; fatter is easier)


@dataclass(frozen=True)
class Spec:
    """One image: a shape of `colour` on `background`, centred at (cx, cy) with radius r (fractions of the side)."""
    shape: str
    colour: str
    background: str
    cx: float
    cy: float
    r: float

    @property
    def caption(self) -> str:
        article = "an" if self.colour[0] in "aeiou" else "a"
        return f"{article} {self.colour} {self.shape} on a {self.background} background"


def spec(seed: int, index: int, shapes: tuple[str, ...] = BASE_SHAPES) -> Spec:
    """The index-th image of the set `seed`: decided by (seed, index) alone, so any worker, any order,
    any device makes the same image."""
    rng = random.Random(f"shapes:{seed}:{index}")
    r = rng.uniform(0.2, 0.34)
    return Spec(shape=rng.choice(shapes), colour=rng.choice(list(COLOURS)), background=rng.choice(list(BACKGROUNDS)),
                cx=0.5 + rng.uniform(-0.12, 0.12), cy=0.5 + rng.uniform(-0.12, 0.12), r=r)


def all_captions(shapes: tuple[str, ...] = BASE_SHAPES) -> list[str]:
    """Every caption the set can have, in a fixed order."""
    return [Spec(s, c, b, 0.5, 0.5, 0.3).caption for s in shapes for c in COLOURS for b in BACKGROUNDS]


def _vertices(shape: str) -> np.ndarray:
    """Unit polygon (radius 1, centre 0, y down) of a shape drawn as a polygon."""
    if shape == "square":
        return np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], dtype=np.float32)
    if shape == "triangle":
        return np.array([[0, -1], [1, 1], [-1, 1]], dtype=np.float32)
    if shape == "star":
        # Upright 5-pointed star: outer points at -90 + 72k degrees, inner ones half-way between.
        pts = []
        for k in range(10):
            a = math.radians(-90 + 36 * k)
            rad = 1.0 if k % 2 == 0 else STAR_INNER
            pts.append((rad * math.cos(a), rad * math.sin(a)))
        return np.array(pts, dtype=np.float32)
    raise ValueError(f"no polygon for shape {shape!r}; shapes are {', '.join(SHAPES)}")


def _inside_polygon(px: torch.Tensor, py: torch.Tensor, verts: torch.Tensor) -> torch.Tensor:
    """Even-odd test of points (px, py: [G]) against polygons verts [n, V, 2] -> bool [n, G].
    torch has no polygon fill; this is the crossing-number rule, vectorised over images and pixels."""
    x0, y0 = verts[..., 0, None], verts[..., 1, None]                       # [n, V, 1]
    nxt = torch.roll(verts, -1, dims=1)
    x1, y1 = nxt[..., 0, None], nxt[..., 1, None]
    crosses = (y0 > py) != (y1 > py)                                       # [n, V, G]
    xi = x0 + (py - y0) * (x1 - x0) / torch.where(y1 == y0, torch.ones_like(y1), y1 - y0)
    return ((crosses & (px < xi)).sum(dim=1) % 2) == 1


def render(specs: list[Spec], size: int, device: torch.device | str = "cpu", supersample: int = 2) -> torch.Tensor:
    """Images [B, 3, size, size] in [0, 1], antialiased by supersampling."""
    n = len(specs)
    hi = size * supersample
    coords = (torch.arange(hi, device=device, dtype=torch.float32) + 0.5) / hi
    py, px = torch.meshgrid(coords, coords, indexing="ij")
    px, py = px.reshape(-1), py.reshape(-1)
    mask = torch.zeros(n, hi * hi, dtype=torch.bool, device=device)
    for shape in {s.shape for s in specs}:
        idx = [i for i, s in enumerate(specs) if s.shape == shape]
        geo = torch.tensor([[specs[i].cx, specs[i].cy, specs[i].r] for i in idx], device=device)
        cx, cy, r = geo[:, 0:1], geo[:, 1:2], geo[:, 2:3]
        if shape == "circle":
            m = (px - cx) ** 2 + (py - cy) ** 2 < r ** 2
        else:
            unit = torch.as_tensor(_vertices(shape), device=device)
            verts = unit[None] * r[:, :, None] + torch.stack([cx, cy], dim=-1)
            m = _inside_polygon(px, py, verts)
        mask[idx] = m
    fg = torch.tensor([COLOURS[s.colour] for s in specs], device=device, dtype=torch.float32) / 255
    bg = torch.tensor([BACKGROUNDS[s.background] for s in specs], device=device, dtype=torch.float32) / 255
    m = mask.float().view(n, 1, hi, hi)
    img = m * fg[:, :, None, None] + (1 - m) * bg[:, :, None, None]
    return F.avg_pool2d(img, supersample) if supersample > 1 else img


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    arr = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(a) for a in arr]


def write_set(folder: str | Path, specs: list[Spec], size: int = 256, prefix: str = "",
              trigger: str = "") -> list[Path]:
    """Write the images with .txt captions (a captioned folder the SDXL task reads), the trigger word
    first when given ("sks, a red star on a white background"); returns the image paths."""
    from ...core.fsutil import atomic_save, atomic_write_text

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, s in enumerate(specs):
        img = to_pil(render([s], size))[0]
        stem = f"{prefix}{i:02d}_{s.colour}_{s.shape}"
        paths.append(atomic_save(folder / f"{stem}.png", lambda tmp, img=img: img.save(tmp, format="PNG")))
        atomic_write_text(folder / f"{stem}.txt", (f"{trigger}, " if trigger else "") + s.caption + "\n")
    return paths


# ------------------------------------------------------------------------------------------ detector

# Descriptor prototypes (fill, solidity) of each shape, as the generator draws them (measured on its
# own images at 64-256 px; tests/sdxl/test_demo_base.py checks the detector against the generator).
PROTOTYPES = {"circle": (0.785, 0.97), "square": (1.0, 1.0), "triangle": (0.515, 0.965), "star": (0.41, 0.59)}
_SHAPE_SIGMA = 0.07
_COLOUR_SIGMA = 0.12        # in [0, 1] RGB units
_OTHER_LOGIT = -4.5         # an "other" class at 3 sigma: what fits no prototype scores low
_FG_THRESHOLD = 0.2         # colour distance from the background that counts as foreground
_FLAT = 0.08                # median colour spread (RGB units) below which a region counts as flat


@dataclass
class Detection:
    shape: dict[str, float]     # P(shape) for each of SHAPES, plus "other"
    colour: dict[str, float]    # P(colour) for each of COLOURS, plus "other"
    features: dict[str, float]  # fill, solidity, area (fraction of the image), objectness


def _as_arrays(images) -> list[np.ndarray]:
    """PIL images or a tensor [B, 3, H, W] in [0, 1] -> float arrays [H, W, 3] in [0, 1]."""
    if isinstance(images, torch.Tensor):
        return list(images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy())
    return [np.asarray(im.convert("RGB"), dtype=np.float32) / 255 for im in images]


def _spread_runs(labels: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Each horizontal run of mask pixels takes the largest label in it."""
    h, w = mask.shape
    starts = mask.copy()
    starts[:, 1:] &= ~mask[:, :-1]
    run = np.cumsum(starts.reshape(-1)).reshape(h, w)
    top = np.zeros(int(run.max()) + 1, dtype=labels.dtype)
    np.maximum.at(top, run[mask], labels[mask])
    out = labels.copy()
    out[mask] = top[run[mask]]
    return out


def _largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected blob of a bool mask [H, W]. No scipy here: labels spread along rows, then
    columns, until they settle (two or three rounds for a shape; capped for pathological speckle)."""
    h, w = mask.shape
    labels = np.where(mask, np.arange(1, h * w + 1).reshape(h, w), 0)
    for _ in range(64):
        new = _spread_runs(_spread_runs(labels, mask).T, mask.T).T
        if np.array_equal(new, labels):
            break
        labels = new
    counts = np.bincount(labels.reshape(-1))
    counts[0] = 0
    return labels == int(counts.argmax())


def _hull_area(mask: np.ndarray) -> float:
    """Area of the convex hull of the mask's pixel squares (monotone chain on each row's outer corners)."""
    rows = np.nonzero(mask.any(axis=1))[0]
    pts = []
    for y in rows:
        xs = np.nonzero(mask[y])[0]
        pts += [(xs[0], y), (xs[0], y + 1), (xs[-1] + 1, y), (xs[-1] + 1, y + 1)]
    pts = sorted(set(pts))
    if len(pts) < 3:
        return 0.0

    def cross(o, a, b):
        return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])

    lower, upper = [], []
    for p in pts:
        while len(lower) >= 2 and cross(lower[-2], lower[-1], p) <= 0:
            lower.pop()
        lower.append(p)
    for p in reversed(pts):
        while len(upper) >= 2 and cross(upper[-2], upper[-1], p) <= 0:
            upper.pop()
        upper.append(p)
    hull = lower[:-1] + upper[:-1]
    return 0.5 * abs(sum(x0 * y1 - x1 * y0 for (x0, y0), (x1, y1) in zip(hull, hull[1:] + hull[:1])))


def _softmax(logits: dict[str, float]) -> dict[str, float]:
    top = max(logits.values())
    ex = {k: math.exp(v - top) for k, v in logits.items()}
    z = sum(ex.values())
    return {k: v / z for k, v in ex.items()}


def detect_one(img: np.ndarray) -> Detection:
    h, w, _ = img.shape
    border = np.concatenate([img[0], img[-1], img[:, 0], img[:, -1]])
    bg = np.median(border, axis=0)
    fg = np.linalg.norm(img - bg, axis=-1) > _FG_THRESHOLD
    none = Detection({**{s: 0.0 for s in SHAPES}, "other": 1.0}, {**{c: 0.0 for c in COLOURS}, "other": 1.0},
                     {"fill": 0.0, "solidity": 0.0, "area": float(fg.mean()), "objectness": 0.0})
    if fg.sum() < 0.01 * h * w:
        return none
    blob = _largest_component(fg)
    area = float(blob.sum())
    ys, xs = np.nonzero(blob)
    bbox = float((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
    fill = area / bbox
    solidity = area / max(_hull_area(blob), 1.0)
    objectness = area / float(fg.sum())  # one blob, not scattered speckle
    feats = {"fill": fill, "solidity": solidity, "area": area / (h * w), "objectness": objectness}
    if area < 0.01 * h * w or area > 0.8 * h * w:
        return Detection(none.shape, none.colour, feats)
    # The colour of the blob's inside (an eroded core where it has one: edges are antialiased blends).
    core = blob.copy()
    core[1:-1, 1:-1] &= blob[:-2, 1:-1] & blob[2:, 1:-1] & blob[1:-1, :-2] & blob[1:-1, 2:]
    inside = img[core if core.sum() >= 4 else blob]
    mean = inside.mean(axis=0)
    # A shape is flat colour on a flat background: how far its pixels stray from their colour (median
    # distance), inside and on the border. Noise and texture stray far, whatever the blob's outline.
    feats["shape_spread"] = float(np.median(np.linalg.norm(inside - mean, axis=-1)))
    feats["background_spread"] = float(np.median(np.linalg.norm(border - bg, axis=-1)))
    logits = {s: -((fill - f0) ** 2 + (solidity - s0) ** 2) / (2 * _SHAPE_SIGMA ** 2)
              for s, (f0, s0) in PROTOTYPES.items()}
    # Speckle around the blob, or texture, makes it less of a shape: weight moves to "other".
    logits["other"] = (_OTHER_LOGIT + 20 * max(0.0, 0.9 - objectness)
                       + 40 * max(0.0, feats["shape_spread"] - _FLAT) + 40 * max(0.0, feats["background_spread"] - _FLAT))
    clog = {c: -float(np.sum((mean - np.array(rgb) / 255) ** 2)) / (2 * _COLOUR_SIGMA ** 2)
            for c, rgb in COLOURS.items()}
    clog["other"] = _OTHER_LOGIT
    return Detection(_softmax(logits), _softmax(clog), feats)


def detect(images) -> list[Detection]:
    """Detections for PIL images or a tensor [B, 3, H, W] in [0, 1]."""
    return [detect_one(a) for a in _as_arrays(images)]


def concept_scores(images, concept: str) -> list[float]:
    """Per image: the probability that it shows `concept`, one or more words among the shapes and
    colours ("star", "red", "red star": the product of the parts)."""
    words = concept.lower().split()
    unknown = [w for w in words if w not in SHAPES and w not in COLOURS]
    if not words or unknown:
        raise ValueError(f"concept {concept!r}: the detector knows the shapes {', '.join(SHAPES)} and the colours "
                         f"{', '.join(COLOURS)}; give one or more of those words")
    out = []
    for d in detect(images):
        p = 1.0
        for w in words:
            p *= d.shape[w] if w in SHAPES else d.colour[w]
        out.append(p)
    return out


def concept_score(images, concept: str) -> float:
    """Mean probability over the images that they show `concept` (see concept_scores)."""
    scores = concept_scores(images, concept)
    return sum(scores) / len(scores) if scores else math.nan


def _words(prompt: str) -> set[str]:
    return set(prompt.lower().replace(",", " ").split())


def pixel_change(a, b) -> float:
    """Mean absolute difference of two images, per pixel and channel, RGB in [0, 1]: 0 is the same image."""
    (x,), (y,) = _as_arrays([a]), _as_arrays([b])
    if x.shape != y.shape:
        raise ValueError(f"images of different sizes ({x.shape[1]}x{x.shape[0]} and {y.shape[1]}x{y.shape[0]}) "
                         "cannot be compared pixel by pixel")
    return float(np.abs(x - y).mean())


def report_concept(run, step: int, concept: str, prompts: list[str], images, baseline=None) -> dict | None:
    """The preview hook (preview.concept): score the step's previews for `concept` over the prompts that
    name one of its words (the trigger prompts); log it and write a "concept" event. Prompts that name
    none of its words: nothing to score, None.

    The other prompts are what an adapter should leave alone; the event measures them two ways:
      - each one's own shape (the shape word it names, if any): P(own shape), mean in "others_score";
      - with `baseline` (the same prompts rendered by the base at the same seeds: the step-0 preview),
        the mean absolute pixel change from it (RGB in [0, 1]), mean in "others_change".
    A prompt rendered several times (seeds) counts as one entry with its images' mean.
    Event: {step, concept, score, chance, prompts: {prompt: score}, images, others: {prompt: {shape, score,
    change}}, others_images, others_score, others_change}."""
    import logging

    words = set(concept.lower().split())
    chosen = [i for i, p in enumerate(prompts) if words & _words(p)]
    if not chosen:  # checked first: the detector over full-size previews is not free
        logging.getLogger(__name__).debug("preview.concept=%r: no preview prompt names it; not scored", concept)
        return None
    scores = concept_scores(images, concept)
    score = sum(scores[i] for i in chosen) / len(chosen)
    # A prompt may be rendered several times (several seeds): per prompt, the mean over its images; the
    # overall figures are means over all images.
    by_prompt: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_prompt.setdefault(p, []).append(i)

    def mean(values):
        values = list(values)
        return round(sum(values) / len(values), 4)

    per_prompt = {p: mean(scores[i] for i in idx) for p, idx in by_prompt.items() if idx[0] in chosen}
    others, own_scores, changes = {}, [], []
    for p, idx in by_prompt.items():
        if idx[0] in chosen:
            continue
        own = next((w for w in p.lower().replace(",", " ").split() if w in SHAPES), None)
        entry: dict = {"shape": own}
        if own:
            own_here = concept_scores([images[i] for i in idx], own)
            own_scores += own_here
            entry["score"] = mean(own_here)
        if baseline is not None:
            change_here = [pixel_change(images[i], baseline[i]) for i in idx]
            changes += change_here
            entry["change"] = mean(change_here)
        others[p] = entry
    fields: dict = {}
    if others:
        fields["others"] = others
        if own_scores:
            fields["others_score"] = mean(own_scores)
        if baseline is not None:
            fields["others_change"] = mean(changes)
    chance = 1 / len(SHAPES)
    run.event("concept", step=step, concept=concept, score=round(score, 4), chance=chance, prompts=per_prompt,
              images=len(chosen), others_images=len(prompts) - len(chosen), **fields)
    log = logging.getLogger(__name__)
    log.info("step %d: concept %r scores %.2f on %d preview(s) of %d prompt(s) (chance %.2f)", step, concept, score,
             len(chosen), len(per_prompt), chance)
    if "others_score" in fields or "others_change" in fields:
        log.info("step %d: the %d other prompt(s): own shape %s, pixel change from the base %s", step, len(others),
                 f"{fields['others_score']:.2f}" if "others_score" in fields else "-",
                 f"{fields['others_change']:.3f}" if "others_change" in fields else "-")
    return {"score": score, "prompts": per_prompt, **fields}


# ------------------------------------------------------------------------------- the demo LoRA's data

# The concept the demo base never saw, with its trigger word (sample_data/, docs/demo_base.md). "sks" is
# in the tiny tokenizer's corpus, so it is one token.
DEMO_CONCEPT = "star"
DEMO_TRIGGER = "sks"
# The default job's previews: the trigger prompts (the star should appear), then the same colours and
# backgrounds with shapes the base knows and no trigger (they should stay as the base draws them).
DEMO_PROMPTS = ("sks, a red star on a white background", "sks, a yellow star on a black background",
                "a red circle on a white background", "a green triangle on a white background")
# Each prompt is rendered at these seeds: one render per prompt is too few to score a concept by (a
# single unlucky seed reads 0.00 or 1.00); more would not fit the default job's CPU budget.
DEMO_SEEDS = (0, 1)


def demo_spec(seed: int, index: int) -> Spec:
    """The index-th image of the demo concept: a large star (radius 0.30-0.34 of the side) of any colour
    on a white or black background. Large, and not on grey: the demo base's VAE, which never saw a star,
    gives such stars back with their points (P(star) 0.67-0.95 after encoding and decoding), while
    stars of radius 0.22 (0.08-0.16) or on grey (0.03-0.48) come back as blobs (docs/demo_base.md)."""
    rng = random.Random(f"demo:{seed}:{index}")
    colours = list(COLOURS)
    # Every colour on both backgrounds within 12 images; positions and sizes drawn.
    return Spec(shape=DEMO_CONCEPT, colour=colours[index % len(colours)],
                background=("white", "black")[(index // len(colours)) % 2],
                cx=0.5 + rng.uniform(-0.06, 0.06), cy=0.5 + rng.uniform(-0.06, 0.06), r=rng.uniform(0.30, 0.34))


def write_demo_concept(folder: str | Path, n: int = 16, seed: int = 1234, size: int = 128) -> list[Path]:
    """The demo LoRA's images: n stars (demo_spec) captioned like the base's set with the trigger word
    first ("sks, a red star on a white background"). 128 px: the base's native size, the size it was
    pretrained at (SDXL's size conditioning then says 128 x 128 in training as in the previews; larger
    images would train the adapter under an original size the base never saw)."""
    return write_set(folder, [demo_spec(seed, i) for i in range(n)], size=size, trigger=DEMO_TRIGGER)


def demo_prior_specs(n: int = 48, seed: int = 99) -> list[Spec]:
    """The prior-preservation images of the demo set: n shapes the base knows (spec(), its pretraining
    distribution), on white or black as the stars are, captioned without the trigger word."""
    out: list[Spec] = []
    index = 0
    while len(out) < n:
        s = spec(seed, index)
        index += 1
        if s.background != "grey":
            out.append(s)
    return out


def write_demo_set(folder: str | Path, n: int = 16, prior: int = 48, size: int = 128) -> list[Path]:
    """The default job's data (sample_data/images): the n stars with the trigger word (write_demo_concept),
    and `prior` shapes the base already knows, without it (DreamBooth's prior preservation: training on
    both keeps the plain prompts drawing what the base drew while the trigger learns the star). Three prior
    shapes to a star: with as many as the stars the plain prompts' images moved about twice as far from the
    base's (docs/demo_base.md)."""
    return write_demo_concept(folder, n=n, size=size) + write_set(folder, demo_prior_specs(prior), size=size,
                                                                  prefix="prior")


def write_demo_prompts(path: str | Path) -> Path:
    """The preview prompts of the default job: each of DEMO_PROMPTS at each of DEMO_SEEDS (`--d`), one a line."""
    from ...core.fsutil import atomic_write_text

    return atomic_write_text(path, "".join(f"{p} --d {d}\n" for p in DEMO_PROMPTS for d in DEMO_SEEDS))

"""Make sample_data/: a small captioned image set of coloured shapes and a prompts file for previews.

Deterministic: running it again writes the same files. Sizes vary so that aspect buckets get used.
    python sample_data/make_sample_data.py
"""
from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220),
           "yellow": (235, 210, 40), "purple": (140, 50, 170), "orange": (240, 140, 30)}
BACKGROUNDS = {"white": (245, 245, 245), "black": (20, 20, 20), "grey": (128, 128, 128)}
SHAPES = ("circle", "square", "triangle")
SIZES = ((256, 256), (256, 256), (320, 224), (224, 320))


def draw(shape: str, colour, background, size, rng: random.Random) -> Image.Image:
    w, h = size
    img = Image.new("RGB", size, background)
    d = ImageDraw.Draw(img)
    r = int(min(w, h) * rng.uniform(0.25, 0.38))
    cx = int(w / 2 + rng.uniform(-0.1, 0.1) * w)
    cy = int(h / 2 + rng.uniform(-0.1, 0.1) * h)
    if shape == "circle":
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif shape == "square":
        d.rectangle((cx - r, cy - r, cx + r, cy + r), fill=colour)
    else:
        d.polygon(((cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)), fill=colour)
    return img


def main() -> None:
    rng = random.Random(1234)
    out = HERE / "images"
    out.mkdir(parents=True, exist_ok=True)
    colours = list(COLOURS)
    backgrounds = list(BACKGROUNDS)
    for i in range(16):
        shape = SHAPES[i % len(SHAPES)]
        colour = colours[(i * 5) % len(colours)]
        bg = backgrounds[(i // 3) % len(backgrounds)]
        size = SIZES[i % len(SIZES)]
        img = draw(shape, COLOURS[colour], BACKGROUNDS[bg], size, rng)
        stem = f"{i:02d}_{colour}_{shape}"
        img.save(out / f"{stem}.png", optimize=True)
        (out / f"{stem}.txt").write_text(f"a {colour} {shape} on a {bg} background\n", encoding="utf-8")
    (HERE / "prompts.txt").write_text(
        "a red circle on a white background\n"
        "a blue square on a black background\n", encoding="utf-8")


if __name__ == "__main__":
    main()

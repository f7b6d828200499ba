"""What writing a preview set costs: the tiles and the labelled grid saved as PNG at Pillow's default zlib level
and at the level the trainer's previews use (preview.PREVIEW_PNG_LEVEL), seconds and megabytes.

    python3 benchmarks/png_write.py                       # three smooth random 1024x1024 images
    python3 benchmarks/png_write.py RUN/samples/step-000000-0*.png   # a run's own preview tiles

The run waits for these files at every preview step (the `writing` part of the log's `previews at step N` line).
"""
from __future__ import annotations

import argparse
import io
import json
import time

import numpy as np
from PIL import Image, ImageFilter

from sdxl_lora.sdxl.preview import PREVIEW_PNG_LEVEL, grid


def _images(paths: list[str], count: int, size: int) -> list[Image.Image]:
    if paths:
        return [Image.open(p).convert("RGB") for p in paths]
    rng = np.random.default_rng(0)
    # Blurred noise: neither the incompressible noise of an untrained base nor a flat image.
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).filter(ImageFilter.GaussianBlur(4 + i))
            for i in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("images", nargs="*", help="PNG files to write (default: random ones)")
    ap.add_argument("--count", type=int, default=3)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    images = _images(args.images, args.count, args.size)
    labels = [f"prompt {i}" for i in range(len(images))]
    for level in (6, PREVIEW_PNG_LEVEL):
        times, size = [], 0
        for _ in range(args.repeat):
            started = time.perf_counter()
            size = 0
            for im in [*images, grid(images, labels=labels)]:
                buf = io.BytesIO()
                im.save(buf, format="PNG", compress_level=level)
                size += buf.tell()
            times.append(time.perf_counter() - started)
        print(json.dumps({"level": level, "images": len(images), "seconds": [round(t, 3) for t in times],
                          "best_s": round(min(times), 3), "mb": round(size / 1e6, 2)}))


if __name__ == "__main__":
    main()

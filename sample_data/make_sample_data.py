"""Make sample_data/: the demo LoRA's concept (16 captioned stars with the trigger word `sks`, a shape
the demo base never saw), 16 shapes the base knows without the trigger (prior preservation), and the
preview prompts (the trigger prompts, then prompts without it).

Deterministic: running it again writes the same files (sdxl_lora/sdxl/demo/shapes.py draws them from a seed).
Old images in sample_data/images are removed first, so the folder holds exactly this set.
    python sample_data/make_sample_data.py
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

from sdxl_lora.sdxl.demo import shapes  # noqa: E402


def main() -> None:
    images = HERE / "images"
    if images.is_dir():
        for f in images.iterdir():
            if f.suffix.lower() in (".png", ".txt"):
                f.unlink()
    paths = shapes.write_demo_set(images)
    shapes.write_demo_prompts(HERE / "prompts.txt")
    print(f"{len(paths)} images in {images}; prompts in {HERE / 'prompts.txt'}")


if __name__ == "__main__":
    main()

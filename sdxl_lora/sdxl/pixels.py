"""An image's pixels as it trains (resized to cover its bucket, mirrored, cropped) with SDXL's time_ids, and its
loss mask cut the same way at latent resolution."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from sdxl_lora.sdxl.config import DataConfig
from sdxl_lora.sdxl.images import ImageProblem, open_image, probe_image

from .dataset import DataError, Item


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


def check_mask(mask: Path, image: Path, size: tuple[int, int], max_pixels: int) -> None:
    """Refuse a mask that cannot be read or whose size is not its image's (the scan calls it once per mask)."""
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

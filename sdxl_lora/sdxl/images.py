"""Open a user's image file safely: refuse bombs before decoding, apply EXIF orientation, return 8-bit RGB.

Every failure (empty, not an image, truncated, undecodable, too many pixels, unknown colour mode)
raises ImageProblem whose message is the reason in plain words, so a dataset scan can list it and
move on. Files are only ever opened for reading. No torch here: this is used by scans and UIs too.
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff"})

# What Pillow's decoders raise on damaged data. TIFF and a few other plugins surface malformed tags
# as IndexError/KeyError/TypeError, and zlib/struct errors can escape from PNG and TIFF internals.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, KeyError, TypeError,
                  struct.error, zlib.error)

# EXIF orientations 5-8 turn the image a quarter turn, so its displayed width and height swap.
_SWAPS_SIDES = {5, 6, 7, 8}
_ORIENTATION_TAG = 0x0112
_WHITE = (255, 255, 255)


class ImageProblem(Exception):
    """An image cannot be used; the message is the reason, in plain words."""


def _open(path: Path, max_pixels: int) -> Image.Image:
    """Open lazily (header only) and enforce the pixel limit before any pixel data is decoded."""
    try:
        if path.stat().st_size == 0:
            raise ImageProblem("empty file (0 bytes)")
    except OSError as e:
        raise ImageProblem(f"cannot read the file: {e.strerror or e}") from e
    # Pillow has its own bomb guard (a warning at MAX_IMAGE_PIXELS, an error at twice that). Raise it
    # to ours so data.max_pixels is the limit that decides; only ever raised, never lowered.
    if Image.MAX_IMAGE_PIXELS is not None and max_pixels > Image.MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        img = Image.open(path)
    except UnidentifiedImageError as e:
        raise ImageProblem("not an image Pillow can read (unknown or damaged format)") from e
    except Image.DecompressionBombError as e:
        raise ImageProblem(f"too many pixels ({e}); over data.max_pixels={max_pixels:,} — "
                           "raise data.max_pixels if this image is meant to be used") from e
    except _DECODE_ERRORS as e:
        raise ImageProblem(f"cannot read the image header: {e}") from e
    w, h = img.size
    if w * h > max_pixels:
        img.close()
        raise ImageProblem(f"{w}x{h} = {w * h:,} pixels is over data.max_pixels={max_pixels:,} "
                           "(decompression-bomb guard) — raise data.max_pixels if this image is meant to be used")
    if w < 1 or h < 1:
        img.close()
        raise ImageProblem(f"image has no pixels ({w}x{h})")
    return img


def _orientation(img: Image.Image) -> int:
    try:
        return int(img.getexif().get(_ORIENTATION_TAG, 1))
    except _DECODE_ERRORS:
        # A damaged EXIF block must not cost the user the image; it is then shown as stored.
        return 1


def _decode(img: Image.Image) -> None:
    try:
        img.load()
    except _DECODE_ERRORS as e:
        reason = str(e) or type(e).__name__
        if "truncated" in reason:
            raise ImageProblem(f"truncated file: {reason} — re-export or re-download it") from e
        raise ImageProblem(f"cannot decode the image: {reason}") from e


def _to_uint8(arr: np.ndarray, mode: str) -> np.ndarray:
    """Scale high-bit-depth gray to 0..255 by its bit depth (Pillow's own convert clips at 255)."""
    if mode == "F":
        a = arr.astype(np.float64)
        finite = a[np.isfinite(a)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        # Float images are usually 0..1; anything else is stretched to its own range.
        if lo < 0.0 or hi > 1.0:
            a = (a - lo) / (hi - lo) if hi > lo else np.zeros_like(a)
        return np.clip(np.nan_to_num(a) * 255.0 + 0.5, 0, 255).astype(np.uint8)
    a = arr.astype(np.int64)
    if a.min() >= 0 and a.max() <= 65535:
        # 16-bit data (mode "I;16*", or "I" holding a 16-bit PNG/TIFF): 65535 -> 255, 32896 -> 128.
        return ((a * 255 + 32767) // 65535).astype(np.uint8)
    lo, hi = int(a.min()), int(a.max())
    return (((a - lo) * 255) // max(hi - lo, 1)).astype(np.uint8)


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert any Pillow mode to 8-bit RGB; transparency is composited on white."""
    mode = img.mode
    if mode == "RGB" and "transparency" not in img.info:
        return img
    if mode.startswith("I") or mode == "F":
        gray = Image.fromarray(_to_uint8(np.asarray(img), mode), mode="L")
        return gray.convert("RGB")
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info
    try:
        if has_alpha:
            # Dropping alpha would show whatever colour sits under transparent pixels (often black).
            rgba = img.convert("RGBA")
            background = Image.new("RGBA", rgba.size, _WHITE + (255,))
            return Image.alpha_composite(background, rgba).convert("RGB")
        return img.convert("RGB")
    except ValueError as e:
        raise ImageProblem(f"colour mode {mode!r} cannot be converted to RGB: {e}") from e


def displayed_size(img: Image.Image) -> tuple[int, int]:
    """(width, height) as the image is displayed, i.e. after its EXIF orientation."""
    w, h = img.size
    return (h, w) if _orientation(img) in _SWAPS_SIDES else (w, h)


def probe_image(path: str | Path, max_pixels: int) -> tuple[int, int]:
    """Check an image is usable and return its displayed (width, height), decoding it cheaply.

    The whole file is decoded, so truncated and damaged files are caught before training, but JPEGs
    are decoded at 1/8 scale (the DCT allows it) which makes a scan of large photos fast.
    """
    path = Path(path)
    img = _open(path, max_pixels)
    try:
        full = img.size
        if img.format == "JPEG":
            w, h = img.size
            img.draft(None, (max(1, w // 8), max(1, h // 8)))
        # Decoded before anything reads its metadata: reading a PNG's EXIF may load the pixels itself, and
        # a damaged image data stream then went unnoticed (the orientation falls back quietly), only to
        # stop latent caching later.
        _decode(img)
        size = (full[1], full[0]) if _orientation(img) in _SWAPS_SIDES else full
        # A 1x1 corner goes through the same conversion the trainer uses, catching unknown modes.
        to_rgb(img.crop((0, 0, 1, 1)))
        return size
    finally:
        img.close()


def open_image(path: str | Path, max_pixels: int) -> Image.Image:
    """Open, guard, fully decode, apply EXIF orientation and convert to 8-bit RGB."""
    path = Path(path)
    img = _open(path, max_pixels)
    try:
        _decode(img)
        try:
            oriented = ImageOps.exif_transpose(img)
        except _DECODE_ERRORS:
            # Damaged EXIF: use the pixels as stored rather than lose the image.
            oriented = img
        rgb = to_rgb(oriented)
        if rgb is img:
            rgb = img.copy()  # detach from the file so closing it below is safe
        return rgb
    finally:
        img.close()

"""The SDXL data pipeline as a user meets it: bad files listed and skipped, images the right way up
and the right colours, captions found (or a clear stop), buckets, batches and caches.

Every image is built inside the test, in tmp_path.
"""
from __future__ import annotations

import hashlib
import json
import io
import logging
import random
import struct
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sdxl_lora.sdxl.config import DataConfig
from sdxl_lora.sdxl.images import ImageProblem, open_image, probe_image
from sdxl_lora.sdxl.cache import TensorCache, cache_key, file_digest
from sdxl_lora.sdxl.buckets import BucketBatchSampler, make_buckets, nearest_bucket
from sdxl_lora.sdxl.captions import make_caption
from sdxl_lora.sdxl.data import inspect_text, scan
from sdxl_lora.sdxl.dataset import DataError, Dataset, Item
from sdxl_lora.sdxl.pixels import load_pixels

RED, BLUE = (255, 0, 0), (0, 0, 255)


# ------------------------------------------------------------------------------------ helpers

def save(img: Image.Image, path: Path, caption: str | None = "a test image", **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, **kw)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root (hidden ones too) -> sha256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def rotated_jpeg(path: Path) -> Image.Image:
    """A JPEG stored sideways with EXIF orientation 6; displayed it is 256x128, red left, blue right."""
    shown = Image.new("RGB", (256, 128), BLUE)
    shown.paste(RED, (0, 0, 128, 128))
    stored = shown.transpose(Image.Transpose.ROTATE_90)  # what a phone writes: 128x256
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    save(stored, path, "a sideways photo", quality=95, exif=exif)
    return shown


def png_header_only(path: Path, w: int, h: int) -> None:
    """A PNG that claims w x h pixels but holds no pixel data: a decompression bomb's header."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b""))


def gray16() -> Image.Image:
    values = np.array([[0, 32896, 65535, 257 * 64]], dtype=np.uint16).repeat(32, 0).repeat(16, 1)
    return Image.fromarray(values)  # 64x32, mode I;16


def make_bad_dataset(root: Path) -> None:
    """The issue's dataset of awkward files, plus a few ordinary ones."""
    rng = np.random.default_rng(0)
    save(Image.new("RGB", (96, 64), (10, 200, 30)), root / "good.png", "a green field")
    noise = Image.fromarray(rng.integers(0, 255, (256, 256, 3), dtype=np.uint8))
    buf = io.BytesIO()
    noise.save(buf, "JPEG", quality=90)
    (root / "truncated.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    (root / "truncated.txt").write_text("cut short", encoding="utf-8")
    (root / "zero.png").write_bytes(b"")
    (root / "zero.txt").write_text("nothing", encoding="utf-8")
    (root / "notes.png").write_text("this is a text file with the wrong name\n", encoding="utf-8")
    save(Image.new("RGB", (1, 1), RED), root / "pixel.png", "one pixel")
    save(gray16(), root / "gray16.png", "sixteen bit gray")
    save(Image.new("CMYK", (64, 64), (0, 255, 255, 0)), root / "cmyk.jpg", "a red square, printed")
    save(Image.new("RGBA", (64, 64), (255, 0, 0, 0)), root / "rgba.png", "see-through")
    rotated_jpeg(root / "rotated.jpg")
    # 8000x8000 of one gray compresses to a few tens of kB; it is under the default pixel limit.
    save(Image.new("L", (8000, 8000), 90), root / "huge.png", "a very big gray")
    save(Image.new("RGB", (64, 96), BLUE), root / "uncaptioned.png", caption=None)
    save(Image.new("RGB", (64, 64), RED), root / "latin1.png", caption=None)
    (root / "latin1.txt").write_bytes("un caf\u00e9".encode("latin-1"))
    save(Image.new("RGB", (80, 64), RED), root / "mon café déjà vu ñ.png", "café au lait, ñandú")


# ------------------------------------------------------------------------------ the bad dataset

def test_bad_files_are_listed_good_ones_kept_and_sources_untouched(tmp_path, caplog):
    root = tmp_path / "data"
    make_bad_dataset(root)
    before = snapshot(root)
    cfg = DataConfig(dirs=[str(root)], trigger_word="ohwx")

    with caplog.at_level(logging.WARNING):
        ds = scan(cfg, resolution=256)

    assert sorted(it.path.name for it in ds.items) == sorted([
        "good.png", "gray16.png", "cmyk.jpg", "rgba.png", "rotated.jpg", "huge.png",
        "uncaptioned.png", "mon café déjà vu ñ.png"])
    reasons = {p.path.name: p.reason for p in ds.problems}
    assert set(reasons) == {"truncated.jpg", "zero.png", "notes.png", "pixel.png", "latin1.txt"}
    assert "truncated" in reasons["truncated.jpg"]
    assert "empty file" in reasons["zero.png"]
    assert "not an image" in reasons["notes.png"]
    assert "1x1" in reasons["pixel.png"] and "too small" in reasons["pixel.png"]
    assert "not UTF-8" in reasons["latin1.txt"] and "latin1.png was skipped" in reasons["latin1.txt"]

    by_name = {it.path.name: it for it in ds.items}
    assert by_name["mon café déjà vu ñ.png"].caption == "café au lait, ñandú"
    assert by_name["rotated.jpg"].size == (256, 128)
    assert by_name["huge.png"].size == (8000, 8000)
    assert not by_name["uncaptioned.png"].has_caption
    assert "1 of 8 images have no caption; they train with 'ohwx'" in caplog.text

    report = ds.report()
    assert "8 images" in report and "captions: 7 of 8" in report
    for name, reason in reasons.items():
        assert f"{name}: {reason}" in report

    # Everything usable really loads at its bucket size, with a caption.
    rng = random.Random(0)
    for item in ds.items:
        pixels, time_ids = load_pixels(item, "center", False, rng)
        assert pixels.shape == (3, item.bucket[1], item.bucket[0])
        assert -1.0 <= pixels.min() and pixels.max() <= 1.0
        assert time_ids[:2] == (item.size[1], item.size[0])
        assert make_caption(item, cfg, rng).startswith("ohwx")

    assert snapshot(root) == before  # same names, same bytes, nothing added


def test_nothing_usable_stops_with_the_list_of_problems(tmp_path):
    root = tmp_path / "broken"
    root.mkdir()
    (root / "a.png").write_bytes(b"")
    (root / "b.jpg").write_text("not really", encoding="utf-8")
    with pytest.raises(DataError) as err:
        scan(DataConfig(dirs=[str(root)]), 256)
    message = str(err.value)
    assert "no usable images" in message
    assert "a.png: empty file" in message and "b.jpg: not an image" in message


def test_missing_folder_and_empty_folder_say_what_to_do(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        scan(DataConfig(dirs=[str(tmp_path / "nope")]), 256)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "clip.gif").write_bytes(b"GIF89a")
    with pytest.raises(DataError, match=r"no images found.*\.gif: 1"):
        scan(DataConfig(dirs=[str(tmp_path / "empty")]), 256)


def test_a_dataset_folder_that_is_a_symlink_loop_or_leads_nowhere_is_named_as_such(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "gone").symlink_to(tmp_path / "moved")
    for given, said in (("loop", "is a symlink loop"), ("loop/10_me", "is a symlink loop"),
                        ("gone", f"is a symlink to {tmp_path / 'moved'}, which does not exist")):
        with pytest.raises(DataError) as e:
            scan(DataConfig(dirs=[str(tmp_path / given)]), 256)
        assert f"{tmp_path / given} {said}" in str(e.value) and f"{given} does not exist" not in str(e.value)


# ----------------------------------------------------------------------------- image handling

def test_exif_rotated_image_trains_in_displayed_orientation(tmp_path):
    path = tmp_path / "d" / "photo.jpg"
    rotated_jpeg(path)

    img = open_image(path, max_pixels=10**8)
    assert img.size == (256, 128)
    px = np.asarray(img).astype(int)
    assert np.abs(px[:, :100] - RED).max() < 20  # left is red, as displayed
    assert np.abs(px[:, -100:] - BLUE).max() < 20

    item = scan(DataConfig(dirs=[str(path.parent)]), 256).items[0]
    assert item.size == (256, 128) and item.bucket[0] > item.bucket[1]  # a landscape bucket
    pixels, _ = load_pixels(item, "center", False, random.Random(0))
    rgb = ((pixels + 1) * 127.5).permute(1, 2, 0).numpy()
    assert np.abs(rgb[:, :100] - RED).max() < 20
    assert np.abs(rgb[:, -100:] - BLUE).max() < 20


def test_transparency_is_composited_on_white(tmp_path):
    rgba = Image.new("RGBA", (4, 2), (255, 0, 0, 0))  # fully transparent red
    rgba.putpixel((1, 0), (0, 0, 0, 128))  # half-transparent black
    rgba.putpixel((2, 0), (0, 0, 255, 255))  # opaque blue
    save(rgba, tmp_path / "rgba.png", None)
    px = np.asarray(open_image(tmp_path / "rgba.png", 10**8))
    assert tuple(px[1, 0]) == (255, 255, 255)
    assert np.abs(px[0, 1].astype(int) - 127).max() <= 1
    assert tuple(px[0, 2]) == BLUE

    pal = Image.new("P", (2, 1), 0)
    pal.putpalette([0, 0, 0, 0, 255, 0])  # index 0 black (transparent), 1 green
    pal.putpixel((1, 0), 1)
    save(pal, tmp_path / "pal.png", None, transparency=0)
    px = np.asarray(open_image(tmp_path / "pal.png", 10**8))
    assert tuple(px[0, 0]) == (255, 255, 255) and tuple(px[0, 1]) == (0, 255, 0)


@pytest.mark.parametrize("fmt", ["png", "tiff"])
def test_16bit_gray_is_scaled_to_8bit_not_clipped(tmp_path, fmt):
    img = gray16()
    if fmt == "tiff":
        img = img.convert("I")  # a 32-bit integer image holding 16-bit values
    save(img, tmp_path / f"g.{fmt}", None)
    px = np.asarray(open_image(tmp_path / f"g.{fmt}", 10**8))
    assert px.shape == (32, 64, 3)
    assert [int(px[0, x, 0]) for x in (0, 16, 32, 48)] == [0, 128, 255, 64]


def test_cmyk_jpeg_keeps_its_colour(tmp_path):
    save(Image.new("CMYK", (16, 16), (0, 255, 255, 0)), tmp_path / "c.jpg", None)
    px = np.asarray(open_image(tmp_path / "c.jpg", 10**8)).astype(int)
    assert np.abs(px - RED).max() < 10


def test_pixel_limit_refuses_bombs_before_decoding(tmp_path):
    # The header claims 3000x3000 but there is no pixel data: a decoder would report truncation,
    # so a pixel-limit reason proves the guard ran on the header alone.
    png_header_only(tmp_path / "bomb.png", 3000, 3000)
    with pytest.raises(ImageProblem, match=r"3000x3000 = 9,000,000 pixels is over data.max_pixels=1,000,000"):
        probe_image(tmp_path / "bomb.png", max_pixels=1_000_000)
    # Beyond Pillow's own bomb error the reason still names the setting.
    png_header_only(tmp_path / "giant.png", 20000, 20000)
    with pytest.raises(ImageProblem, match="max_pixels"):
        open_image(tmp_path / "giant.png", max_pixels=100_000_000)

    save(Image.new("L", (8000, 8000), 90), tmp_path / "d" / "huge.png")
    save(Image.new("RGB", (64, 64), RED), tmp_path / "d" / "ok.png")
    ds = scan(DataConfig(dirs=[str(tmp_path / "d")], max_pixels=10_000_000), 256)
    assert [it.path.name for it in ds.items] == ["ok.png"]
    assert "max_pixels=10,000,000" in ds.problems[0].reason


def test_small_images_upscaled_or_skipped_by_setting(tmp_path):
    save(Image.new("RGB", (64, 64), RED), tmp_path / "small.png")
    save(Image.new("RGB", (256, 256), BLUE), tmp_path / "big.png")
    ds = scan(DataConfig(dirs=[str(tmp_path)]), 256)  # 64x64 < (256 * 0.5)^2
    assert len(ds.items) == 2 and any("upscaled" in n for n in ds.notes)
    pixels, time_ids = load_pixels(next(i for i in ds.items if i.path.name == "small.png"),
                                   "center", False, random.Random(0))
    assert pixels.shape == (3, 256, 256) and time_ids == (64, 64, 0, 0, 256, 256)

    ds = scan(DataConfig(dirs=[str(tmp_path)], small_images="skip"), 256)
    assert [it.path.name for it in ds.items] == ["big.png"]
    assert ds.problems[0].path.name == "small.png" and "small_images='skip'" in ds.problems[0].reason


# ----------------------------------------------------------------------------------- captions

def test_caption_extension_mismatch_stops_and_names_the_fix(tmp_path):
    for i in range(20):
        save(Image.new("RGB", (32, 32), RED), tmp_path / f"{i:02d}.png", f"image {i}")
    with pytest.raises(DataError) as err:
        scan(DataConfig(dirs=[str(tmp_path)], caption_extension=".caption"), 256)
    assert str(err.value) == ("caption_extension='.caption' matched 0 of 20 images; 20 have '.txt' "
                              "— set data.caption_extension='.txt'")


def test_caption_extension_mismatch_in_one_of_several_folders_stops(tmp_path):
    save(Image.new("RGB", (32, 32), RED), tmp_path / "a" / "x.png", None)
    (tmp_path / "a" / "x.caption").write_text("from a", encoding="utf-8")
    save(Image.new("RGB", (32, 32), RED), tmp_path / "b" / "y.png", "from b")  # .txt
    cfg = DataConfig(dirs=[str(tmp_path / "a"), str(tmp_path / "b")], caption_extension=".caption")
    with pytest.raises(DataError, match=r"matched 0 of 1 images in .*b .*1 there have '\.txt'"):
        scan(cfg, 256)


def test_kohya_repeat_folders_and_several_datasets(tmp_path):
    for i in range(2):
        save(Image.new("RGB", (64, 64), RED), tmp_path / "one" / "10_sks dog" / f"{i}.png")
    save(Image.new("RGB", (64, 64), RED), tmp_path / "one" / "plain" / "p.png")
    save(Image.new("RGB", (64, 64), RED), tmp_path / "3_reg" / "nested" / "r.png")
    ds = scan(DataConfig(dirs=[str(tmp_path / "one"), str(tmp_path / "3_reg")]), 256)
    repeats = {it.path.name: it.repeats for it in ds.items}
    assert repeats == {"0.png": 10, "1.png": 10, "p.png": 1, "r.png": 3}
    assert len(ds) == 24
    assert sorted(Counter(ds.expanded()).values()) == [1, 3, 10, 10]
    assert {it.dataset.name for it in ds.items} == {"one", "3_reg"}


def test_metadata_jsonl_and_csv(tmp_path):
    d = tmp_path / "hf"
    for name in ("a.png", "b.png", "sub/c.png", "own.png"):
        save(Image.new("RGB", (64, 64), RED), d / name, caption=None)
    (d / "own.txt").write_text("from the sidecar", encoding="utf-8")
    (d / "metadata.jsonl").write_text(
        '{"file_name": "a.png", "text": "caption of a"}\n'
        '{"file_name": "sub/c.png", "caption": "caption of c"}\n'
        'this line is broken\n'
        '{"file_name": "gone.png", "text": "no such file"}\n'
        '{"file_name": "own.png", "text": "from metadata"}\n', encoding="utf-8")
    ds = scan(DataConfig(dirs=[str(d)]), 256)
    captions = {it.path.name: it.caption for it in ds.items}
    assert captions == {"a.png": "caption of a", "b.png": "", "c.png": "caption of c",
                        "own.png": "from the sidecar"}
    reasons = sorted(p.reason for p in ds.problems)
    assert any("line 3 is not valid JSON" in r for r in reasons)
    assert any("line 4" in r and "gone.png was not found" in r for r in reasons)

    (d / "metadata.jsonl").unlink()
    (d / "metadata.csv").write_text('file_name,text\na.png,"a, from csv"\n', encoding="utf-8")
    captions = {it.path.name: it.caption for it in scan(DataConfig(dirs=[str(d)]), 256).items}
    assert captions["a.png"] == "a, from csv"

    (d / "metadata.csv").write_text("file_name,prompt\na.png,x\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"metadata.csv: needs a 'file_name' field and a 'text' or 'caption'"):
        scan(DataConfig(dirs=[str(d)]), 256)


def test_make_caption_trigger_fallback_shuffle_and_dropout():
    def item(caption):
        return Item(Path("x.png"), caption, 1, (64, 64), (64, 64), Path("."), bool(caption))
    cfg = DataConfig(trigger_word="ohwx", class_token="dog")
    rng = random.Random(0)
    assert make_caption(item(""), cfg, rng) == "ohwx dog"
    assert make_caption(item("a dog on grass"), cfg, rng) == "ohwx, a dog on grass"
    assert make_caption(item("ohwx dog on grass"), cfg, rng) == "ohwx dog on grass"
    assert make_caption(item(""), DataConfig(), rng) == ""

    cfg = DataConfig(shuffle_tags=True, keep_tokens=2)
    tags = "first, second, " + ", ".join(f"t{i}" for i in range(10))
    orders = {make_caption(item(tags), cfg, rng) for _ in range(20)}
    assert len(orders) > 1  # it shuffles
    for caption in orders:
        parts = caption.split(", ")
        assert parts[:2] == ["first", "second"] and sorted(parts[2:]) == sorted(f"t{i}" for i in range(10))

    cfg = DataConfig(caption_dropout=0.5, trigger_word="ohwx")
    results = [make_caption(item("a cat"), cfg, random.Random(s)) for s in range(200)]
    assert 60 < results.count("") < 140 and set(results) == {"", "ohwx, a cat"}


# ------------------------------------------------------------------------------------ buckets

@pytest.mark.parametrize("resolution", [512, 768, 1024])
def test_buckets_have_step_sides_and_about_the_training_area(resolution):
    buckets = make_buckets(resolution, 64, 2.0)
    assert (resolution, resolution) in buckets
    assert len(buckets) >= 5
    for w, h in buckets:
        assert w % 64 == 0 and h % 64 == 0
        assert 0.9 * resolution**2 <= w * h <= resolution**2
        assert max(w / h, h / w) <= 2.0
    assert set(buckets) == {(h, w) for w, h in buckets}  # portrait for every landscape


def test_each_image_gets_the_nearest_aspect_bucket(tmp_path):
    sizes = {"square.png": (300, 300), "wide.png": (600, 300), "tall.png": (300, 450),
             "panorama.png": (1000, 200)}
    for name, size in sizes.items():
        save(Image.new("RGB", size, RED), tmp_path / name)
    ds = scan(DataConfig(dirs=[str(tmp_path)]), 1024)
    buckets = make_buckets(1024, 64, 2.0)
    for it in ds.items:
        w, h = it.size
        best = min(abs(np.log(bw / bh) - np.log(w / h)) for bw, bh in buckets)
        assert abs(np.log(it.bucket[0] / it.bucket[1]) - np.log(w / h)) == pytest.approx(best)
    got = {it.path.name: it.bucket for it in ds.items}
    assert got["square.png"] == (1024, 1024) and got["wide.png"] == (1408, 704)
    assert got["tall.png"] == (832, 1216) and got["panorama.png"] == (1408, 704)
    assert nearest_bucket((1216, 832), buckets) == (1216, 832)
    assert any("more elongated" in n for n in ds.notes)


# ------------------------------------------------------------------------ pixels and time_ids

def coded_image(w: int, h: int) -> Image.Image:
    """Red channel = row (y), green channel = column scaled to 0..255: position readable from pixels."""
    y, x = np.mgrid[0:h, 0:w]
    arr = np.stack([y % 256, x * 255 // (w - 1), np.zeros_like(x)], -1).astype(np.uint8)
    return Image.fromarray(arr)


def to_uint8(pixels: torch.Tensor) -> np.ndarray:
    return ((pixels + 1) * 127.5).round().to(torch.int64).permute(1, 2, 0).numpy()


def test_time_ids_and_pixels_for_a_known_crop(tmp_path):
    src = coded_image(320, 240)
    save(src, tmp_path / "c.png")
    item = scan(DataConfig(dirs=[str(tmp_path)]), 256).items[0]
    assert item.bucket == (320, 192)  # 4:3 is nearer 5:3 than 1:1 in log-aspect

    pixels, time_ids = load_pixels(item, "center", False, random.Random(0))
    assert time_ids == (240, 320, 24, 0, 192, 320)  # (orig h, orig w, top, left, target h, target w)
    got = to_uint8(pixels)
    assert (got[:, 0, 0] == np.arange(24, 24 + 192)).all()  # row 0 of the crop is source row 24

    tops = set()
    for seed in range(8):
        pixels, time_ids = load_pixels(item, "random", False, random.Random(seed))
        top = time_ids[2]
        tops.add(top)
        assert 0 <= top <= 48 and to_uint8(pixels)[0, 0, 0] == top
    assert len(tops) > 1

    pixels, time_ids = load_pixels(item, "center", True, random.Random(0))
    got = to_uint8(pixels)
    assert got[0, 0, 1] == 255 and got[0, -1, 1] == 0  # mirrored: the right edge is now on the left

    save(coded_image(640, 480), tmp_path / "c.png")  # twice the size: resized, same crop
    item2 = scan(DataConfig(dirs=[str(tmp_path)]), 256).items[0]
    _, time_ids = load_pixels(item2, "center", False, random.Random(0))
    assert time_ids == (480, 640, 24, 0, 192, 320)

    with pytest.raises(ImageProblem, match="changed"):
        load_pixels(item, "center", False, random.Random(0))  # the file is no longer 320x240


# ------------------------------------------------------------------------------------ sampler

def sampler_dataset() -> Dataset:
    items = []
    for i in range(7):
        items.append(Item(Path(f"a{i}.png"), "", 1, (1, 1), (1024, 1024), Path("."), False))
    for i in range(3):
        items.append(Item(Path(f"b{i}.png"), "", 2, (2, 1), (1408, 704), Path("."), False))
    for i in range(5):
        items.append(Item(Path(f"c{i}.png"), "", 1, (1, 2), (704, 1408), Path("."), False))
    return Dataset(items, [], 1024, 64)  # 18 positions per epoch


def test_sampler_batches_one_bucket_each_and_covers_the_epoch():
    ds = sampler_dataset()
    expanded = ds.expanded()
    sampler = BucketBatchSampler(ds, batch_size=2, seed=1)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 10  # 4 + 3 + 3 batches
    for batch in batches:
        assert len({ds.items[expanded[p]].bucket for p in batch}) == 1
    assert sorted(p for b in batches for p in b) == list(range(18))

    full = list(BucketBatchSampler(ds, batch_size=2, seed=1, drop_last=True))
    assert len(full) == 8 and all(len(b) == 2 for b in full)


def test_sampler_is_deterministic_per_seed_and_epoch():
    ds = sampler_dataset()
    def run(seed, epoch):
        s = BucketBatchSampler(ds, batch_size=2, seed=seed)
        s.set_epoch(epoch)
        return list(s)
    assert run(1, 0) == run(1, 0)
    assert run(1, 1) != run(1, 0)
    assert run(2, 0) != run(1, 0)
    assert sorted(map(sorted, run(1, 1))) != sorted(map(sorted, run(1, 0)))  # reshuffled within buckets


@pytest.mark.parametrize("replicas", [2, 5])
def test_sampler_replicas_split_each_global_batch_and_cover_the_epoch_once(replicas):
    ds = sampler_dataset()
    expanded = ds.expanded()
    shares = []
    for rank in range(replicas):
        s = BucketBatchSampler(ds, batch_size=2, seed=3, num_replicas=replicas, rank=rank)
        s.set_epoch(4)
        shares.append(list(s))
        assert len(shares[-1]) == len(s)  # every process takes the same number of steps
    one = BucketBatchSampler(ds, batch_size=2 * replicas, seed=3)
    one.set_epoch(4)
    for step, batch in enumerate(one):
        together = [p for share in shares for p in share[step]]
        assert set(together) == set(batch)  # one process with the whole global batch takes the same images
        assert len({ds.items[expanded[p]].bucket for p in together}) == 1  # one bucket per step
    positions = [p for share in shares for b in share for p in b]
    assert set(positions) == set(range(18))
    if replicas == 2:  # only the 5-image bucket's tail (1 image, 2 processes) repeats its image
        assert len(positions) == 19


def test_sampler_tails_smaller_than_the_process_count_repeat_and_drop_last_drops_them():
    ds = sampler_dataset()  # buckets of 7, 6 and 5 positions
    shares = [list(BucketBatchSampler(ds, 2, seed=0, num_replicas=3, rank=r)) for r in range(3)]
    assert [len(s) for s in shares] == [4, 4, 4]  # global batches of 6: 7 -> 6+1, 6 -> 6, 5 -> 5
    assert all(len(b) >= 1 for s in shares for b in s)
    assert {p for share in shares for b in share for p in b} == set(range(18))
    dropped = [list(BucketBatchSampler(ds, 2, seed=0, num_replicas=3, rank=r, drop_last=True)) for r in range(3)]
    flat = [p for share in dropped for b in share for p in b]
    assert [len(s) for s in dropped] == [2, 2, 2] and len(flat) == len(set(flat)) == 12


# -------------------------------------------------------------------------------------- cache

def test_cache_roundtrip_and_corrupt_entries_are_misses(tmp_path):
    cache = TensorCache(tmp_path / "cache")
    key = cache_key("digest", (128, 128), "center", False, "vae-id")
    latents = {"latents": torch.randn(4, 16, 16), "half": torch.randn(3).to(torch.bfloat16)}
    assert cache.get(key) is None and key not in cache
    cache.put(key, latents)
    got = cache.get(key)
    assert got is not None and set(got) == set(latents)
    assert torch.equal(got["latents"], latents["latents"]) and got["half"].dtype == torch.bfloat16

    path = cache.path(key)
    data = path.read_bytes()
    path.write_bytes(data[:-7])  # a torn write
    assert cache.get(key) is None
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # one damaged byte in the tensor data
    assert cache.get(key) is None
    cache.put(key, latents)  # rewritten after the miss
    assert torch.equal(cache.get(key)["latents"], latents["latents"])
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp files left behind


def test_cache_keys_follow_content_not_names(tmp_path):
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    save(Image.new("RGB", (8, 8), RED), a, None)
    save(Image.new("RGB", (8, 8), RED), b, None)
    assert file_digest(a) == file_digest(b)  # same bytes, same key, whatever the name
    save(Image.new("RGB", (8, 8), BLUE), b, None)
    assert file_digest(a) != file_digest(b)
    k = cache_key(file_digest(a), (1024, 1024), "center", False)
    assert k == cache_key(file_digest(a), (1024, 1024), "center", False)
    assert k != cache_key(file_digest(a), (1024, 1024), "center", True)
    assert cache_key("1") != cache_key(1)
    # Changing how keys are made silently invalidates every user's cache: do it on purpose only.
    assert cache_key("x", 1, (2, 3)) == hashlib.sha256(b'["x",1,[2,3]]').hexdigest()


def test_inspect_text_reports_counts_buckets_and_problems(tmp_path):
    save(Image.new("RGB", (128, 64), RED), tmp_path / "wide.png")
    save(Image.new("RGB", (64, 64), RED), tmp_path / "sq.png", caption=None)
    (tmp_path / "bad.png").write_bytes(b"")
    text = inspect_text(DataConfig(dirs=[str(tmp_path)]), 256)
    assert "2 images" in text and "captions: 1 of 2 images have one (50%)" in text
    assert "320x192" in text and "256x256" in text
    assert "bad.png: empty file (0 bytes)" in text


def test_a_png_with_corrupt_image_data_is_a_problem_at_the_scan_as_at_caching(tmp_path):
    # The scan decodes what latent caching decodes: a PNG whose IDAT data is damaged (its chunk checksum
    # made to match, as a careless tool writes it) is listed as a problem, not counted usable.
    import struct
    import zlib

    import numpy as np

    rng = np.random.default_rng(0)
    good = tmp_path / "good.png"
    Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(good)
    data = bytearray(good.read_bytes())
    at = data.find(b"IDAT")
    length = struct.unpack(">I", data[at - 4:at])[0]
    for k in range(at + 4 + length // 2, at + 4 + length // 2 + 16):
        data[k] ^= 0xFF
    data[at + 4 + length:at + 8 + length] = struct.pack(">I", zlib.crc32(bytes(data[at:at + 4 + length])))
    bad = tmp_path / "bad.png"
    bad.write_bytes(bytes(data))
    for p in (good, bad):
        p.with_suffix(".txt").write_text("a caption\n")
    with pytest.raises(ImageProblem):
        open_image(bad, 10**8)
    with pytest.raises(ImageProblem, match="cannot decode"):
        probe_image(bad, 10**8)
    ds = scan(DataConfig(dirs=[str(tmp_path)]), 64)
    assert [it.path.name for it in ds.items] == ["good.png"]
    assert [p.path.name for p in ds.problems] == ["bad.png"]


def test_a_huge_caption_file_is_read_to_its_first_64_kib_and_the_report_names_it(tmp_path, capsys):
    # A 50 MB "caption" (a log saved as .txt, say) beside normal images: the scan reads a bounded prefix (the
    # text encoders use 77 tokens of it) and `dataset inspect` says which file it is, instead of "problems: none".
    import tracemalloc

    from sdxl_lora.cli import main
    from sdxl_lora.sdxl.data import CAPTION_BYTES

    save(Image.new("RGB", (64, 64), RED), tmp_path / "a.png", caption=None)
    save(Image.new("RGB", (64, 64), BLUE), tmp_path / "b.png", caption="a blue square")
    huge = tmp_path / "a.txt"
    with open(huge, "wb") as f:  # the bound falls inside the first "ü": that character is left out, not an error
        f.write(b"a red square, " + b"x" * (CAPTION_BYTES - 15) + "ünïcode, ".encode() * (50 * 2**20 // 11))
    # The same for a caption in a metadata file (read whole: it holds every image's caption).
    save(Image.new("RGB", (64, 64), BLUE), tmp_path / "c.png", caption=None)
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"file_name": "c.png", "text": "blue, " * 30000}) + "\n")
    tracemalloc.start()
    try:
        dataset = scan(DataConfig(dirs=[str(tmp_path)]), 64)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, peak  # a prefix of the 50 MiB file, not the file
    captions = {it.path.name: it.caption for it in dataset.items}
    assert captions["a.png"] == "a red square, " + "x" * (CAPTION_BYTES - 15)
    assert captions["c.png"].startswith("blue, blue,") and len(captions["c.png"].encode()) <= CAPTION_BYTES
    assert main(["dataset", "inspect", str(tmp_path), "--no-doctor"]) == 0
    out = capsys.readouterr().out
    note = next(line for line in out.splitlines() if str(huge) in line)
    assert note.startswith("note: 2 caption(s) are over 64 KiB") and f"{tmp_path / 'metadata.jsonl'} line 1" in note, out

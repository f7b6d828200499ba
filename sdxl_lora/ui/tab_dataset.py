"""Dataset tab: pick a folder, see its images with their captions, edit a caption (written to the image's
sidecar file atomically), and the report of `sdxl-lora dataset inspect`: problems and bucket histogram."""
from __future__ import annotations

import os

import gradio as gr

from sdxl_lora.core.config import DataConfig, ConfigError, load_config
from sdxl_lora.core.fsutil import atomic_write_text

from .folders import Folders, PathRefused, image_folders
from .text import error_md

GALLERY_LIMIT = 500  # a browser shows a few hundred thumbnails well; the report still counts them all


def _scan(f: Folders, folder: str, ext: str, resolution, progress):
    import pandas as pd

    from sdxl_lora.sdxl.data import DataError, scan

    try:
        root = f.inside(folder or ".", "datasets")
        data = load_config(None, None, {"data.dirs": [str(root)], "data.caption_extension": ext.strip()}).data
        res = int(resolution or 1024)
        ds = scan(data, res, on_progress=lambda done, total: progress((done, total), desc="checking images"))
    except (PathRefused, ConfigError, DataError, ValueError) as e:
        return [], [], error_md(e), "", None, *_EDITOR_CLEARED
    # An image inside the folder may be a symlink to a file elsewhere: the page neither shows nor edits it.
    inside, linked_out = [], 0
    for it in ds.items:
        try:
            f.inside(it.path, "datasets")
            inside.append(it)
        except PathRefused:
            linked_out += 1
    items = [[str(it.path), it.caption if it.has_caption else ""] for it in inside[:GALLERY_LIMIT]]
    shown = "" if len(inside) <= GALLERY_LIMIT else f" (showing the first {GALLERY_LIMIT})"
    linked = (f" {linked_out} image(s) are symlinks to files outside the datasets folder and are not shown "
              "here (training still reads them); copy them in to see and edit them." if linked_out else "")
    status = (f"{len(ds.items)} usable images in `{os.path.relpath(root, f.datasets)}`{shown}; "
              f"{len(ds.problems)} problem(s). Click an image to edit its caption.{linked}")
    hist = pd.DataFrame([{"bucket": f"{w}x{h}", "images": n} for (w, h), n in ds.bucket_histogram().items()],
                        columns=["bucket", "images"]).astype({"bucket": "string", "images": "int64"})
    return items, _gallery(items), status, ds.report(), hist, *_EDITOR_CLEARED


# A scan shows another list of images: the editor forgets the image it showed (index, image, caption).
_EDITOR_CLEARED = (None, "", "")


def default_resolution() -> int:
    """What training uses by default: the config's data.resolution, else the default model's native one
    (128 for the demo base, 1024 for SDXL)."""
    from sdxl_lora.sdxl.model import unet_skeleton

    cfg = load_config()
    return cfg.data.resolution or unet_skeleton(cfg.model)[1]


def _gallery(items: list[list[str]]) -> list[tuple[str, str]]:
    return [(path, caption or "(no caption)") for path, caption in items]


def _select(items, evt: gr.SelectData):
    path, caption = items[evt.index]
    return evt.index, path, caption


def _save(f: Folders, items, index, shown: str, text: str, ext: str):
    """Write the caption beside the image the editor shows (`shown`), which must be the clicked one."""
    if index is None or index >= len(items) or not shown:
        return items, gr.skip(), "**Error:** click an image first"
    if items[index][0] != shown:
        return items, gr.skip(), (f"**Error:** the list of images changed since `{os.path.basename(shown)}` was "
                                  "clicked; click the image again, then Save")
    path = f.inside(shown, "datasets")
    ext = ext.strip()
    try:
        DataConfig(caption_extension=ext)
    except ValueError as e:
        return items, gr.skip(), error_md(f"caption extension {ext!r}: {e}")
    # Beside its image, in the image's own folder, and through the same folder check as every other path.
    sidecar = f.inside(os.path.splitext(path)[0] + ext, "datasets")
    if sidecar.parent != path.parent or not path.is_file():
        raise PathRefused(f"{sidecar} is not beside {path.name}; a caption is written next to its image only")
    caption = " ".join(text.split())
    atomic_write_text(sidecar, caption + "\n")
    items = [list(it) for it in items]
    items[index][1] = caption
    return items, _gallery(items), f"saved `{sidecar.name}`"


def build(f: Folders) -> None:
    folders = image_folders(f.datasets)
    with gr.Row():
        folder = gr.Dropdown(folders, value=folders[0] if folders else None, allow_custom_value=True,
                             label=f"Dataset folder (under {f.datasets})", elem_id="ds-folder", scale=3)
        ext = gr.Textbox(DataConfig.model_fields["caption_extension"].default, label="caption extension",
                         elem_id="ds-ext", scale=1)
        res = gr.Number(default_resolution(), precision=0, label="bucket resolution", elem_id="ds-resolution",
                        scale=1)
        scan_btn = gr.Button("Scan", variant="primary", elem_id="ds-scan", scale=1)
    status = gr.Markdown(elem_id="ds-status")
    items = gr.State([])
    index = gr.State(None)
    gallery = gr.Gallery(label="images and captions", columns=8, height=360, allow_preview=False,
                         elem_id="ds-gallery")
    with gr.Row():
        path = gr.Textbox(label="image", interactive=False, scale=2, elem_id="ds-image")
        caption = gr.Textbox(label="caption", lines=2, scale=4, elem_id="ds-caption")
        save = gr.Button("Save caption", scale=1, elem_id="ds-save")
    saved = gr.Markdown(elem_id="ds-saved")
    with gr.Row():
        hist = gr.BarPlot(x="bucket", y="images", title="images per bucket", y_lim=[0, None], y_axis_format="d",
                          elem_id="ds-hist", scale=1)
        report = gr.Textbox(label="report (dataset inspect)", lines=14, max_lines=30, elem_id="ds-report", scale=2)

    def do_scan(folder, ext, res, progress=gr.Progress()):
        return _scan(f, folder, ext, res, progress)

    def do_save(items, index, shown, text, ext):
        try:
            return _save(f, items, index, shown, text, ext)
        except PathRefused as e:
            return items, gr.skip(), error_md(e)

    scan_btn.click(do_scan, [folder, ext, res], [items, gallery, status, report, hist, index, path, caption])
    gallery.select(_select, items, [index, path, caption])
    save.click(do_save, [items, index, path, caption, ext], [items, gallery, saved])

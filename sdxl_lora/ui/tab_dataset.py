"""Dataset tab: pick a folder and scan it; its images in a table with their captions, edited in place (each
written to the image's sidecar file atomically) or in bulk; the report and the doctor's findings of
`sdxl-lora dataset inspect`; uploads into a dataset folder; captions made by a local model. The writes are
in ui/dataset_edit.py."""
from __future__ import annotations

import os

import gradio as gr

from sdxl_lora.core.config import ConfigError, load_config
from sdxl_lora.sdxl.config import DataConfig
from sdxl_lora.sdxl.tagger import CHARACTER_THRESHOLD, GENERAL_THRESHOLD

from . import dataset_edit as edit
from .folders import Folders, PathRefused, image_folders
from .text import error_md, md_text

TABLE_LIMIT = 500  # a browser shows a few hundred rows well; the report and the doctor still count them all
_TAGS_SHOWN = 30


def _scan(f: Folders, folder: str, ext: str, resolution, progress, trigger: str = ""):
    """(items, table rows, status, report, histogram, doctor's findings, tag table)."""
    import pandas as pd

    from sdxl_lora.sdxl.data import scan
    from sdxl_lora.sdxl.dataset import DataError
    from sdxl_lora.sdxl.doctor import examine, suggestion

    try:
        root = f.inside(folder or ".", "datasets")
        data = load_config(None, None, {"data.dirs": [str(root)], "data.caption_extension": ext.strip(),
                                        "data.trigger_word": (trigger or "").strip()}).data
        res = int(resolution or 1024)
        ds = scan(data, res, on_progress=lambda done, total: progress((done, total), desc="checking images"))
    except (PathRefused, ConfigError, DataError, ValueError) as e:
        return [], [], error_md(e), "", None, "", None
    # An image inside the folder may be a symlink to a file elsewhere: the page neither shows nor edits it.
    inside, linked_out = [], 0
    for it in ds.items:
        try:
            f.inside(it.path, "datasets")
            inside.append(it)
        except PathRefused:
            linked_out += 1
    items = [[str(it.path), it.caption if it.has_caption else ""] for it in inside[:TABLE_LIMIT]]
    shown = "" if len(inside) <= TABLE_LIMIT else f" (showing the first {TABLE_LIMIT})"
    linked = (f" {linked_out} image(s) are symlinks to files outside the datasets folder and are not shown "
              "here (training still reads them); copy them in to see and edit them." if linked_out else "")
    status = (f"{len(ds.items)} usable images in `{os.path.relpath(root, f.datasets)}`{shown}; "
              f"{len(ds.problems)} problem(s). Edit captions in the table, then Save captions.{linked}")
    hist = pd.DataFrame([{"bucket": f"{w}x{h}", "images": n} for (w, h), n in ds.bucket_histogram().items()],
                        columns=["bucket", "images"]).astype({"bucket": "string", "images": "int64"})
    findings = examine(ds, show=False)
    doctor = _doctor_md(f, findings, suggestion(ds, load_config().train.batch_size), data.trigger_word.strip())
    # As the doctor's report: a tag table only for tagged captions (about two tags or more a caption).
    tagged = findings.captioned and sum(findings.tags.values()) >= 2 * findings.captioned
    tags = pd.DataFrame([[t, n, f"{100 * n / findings.captioned:.0f}%"]
                         for t, n in (findings.tags.most_common(_TAGS_SHOWN) if tagged else [])],
                        columns=["tag", "captions", "share"])
    if findings.tags and not tagged:
        doctor += "\n\nThe captions are sentences, not comma-separated tags: no tag table."
    return items, edit.table(f, items), status, ds.report(), hist, doctor, tags


def _panes(f: Folders, folder: str, ext: str, resolution, progress, trigger: str) -> tuple:
    """The scan's status, report, histogram, doctor's findings and tag table, for a folder whose table stays as
    the user has it (after a Save or an Apply)."""
    return _scan(f, folder, ext, resolution, progress, trigger)[2:]


def _panes_kept() -> tuple:
    return tuple(gr.skip() for _ in range(5))  # one a pane of `_panes`


def save_captions(f: Folders, items, rows, ext: str, folder: str, resolution, trigger: str, progress):
    """Save captions: (items, table, message, then the panes of `_panes` as the folder is now); a refused save
    changes nothing on the page but its message."""
    out, err = _guarded(edit.save_table, f, items, rows, ext)
    if err:
        return items, gr.skip(), err, *_panes_kept()
    return out[0], edit.table(f, out[0]), md_text(out[1]), *_panes(f, folder, ext, resolution, progress, trigger)


def apply_bulk(f: Folders, items, rows, previewed, what: edit.BulkEdit, scope: str, ext: str, folder: str,
               resolution, trigger: str, progress):
    """Apply a bulk edit whose count was previewed: (items, table with its ticks kept, the preview cleared,
    message, then the panes of `_panes` as the folder is now)."""
    unchanged = (items, gr.skip(), None)
    if previewed != (what, scope, _ticked(rows)):
        return (*unchanged, "**Error:** Preview this edit first (the count of captions it changes), then Apply",
                *_panes_kept())
    out, err = _guarded(edit.bulk_apply, f, items, rows, what, scope, ext)
    if err:
        return *unchanged, err, *_panes_kept()
    return (out[0], edit.table(f, out[0], set(_ticked(rows))), None, md_text(out[1]),
            *_panes(f, folder, ext, resolution, progress, trigger))


def _doctor_md(f: Folders, found, suggested: list[str], trigger: str) -> str:
    """The doctor's findings (sdxl/doctor.py, as `dataset inspect` reports them) in the page's words."""
    from sdxl_lora.sdxl.doctor import lacking
    def names(group) -> str:
        return ", ".join(md_text(edit.file_name(f, str(it.path))) for it in group[:10]) + (" ..." if len(group) > 10
                                                                                          else "")

    lines = ["**The doctor** (as of the last Scan, Save captions or Apply; Scan again after changing files "
             "outside this page)"]
    for what, groups in (("identical files", found.duplicates), ("images that look the same", found.near)):
        if groups:
            lines.append(f"**{len(groups)} group(s) of {what}** (keep one of each unless they differ on purpose):")
            lines += [f"- {names(g)}" for g in groups]
    if not found.duplicates and not found.near:
        lines.append("No duplicates (identical or near-identical images).")
    missing = [it for group in found.no_trigger.values() for it in group]
    holding = sum(found.with_trigger.values())
    if not found.captioned:
        lines.append("No image has a caption yet: write them in the table, or caption them with a local model "
                     "(below); an image without one trains on the trigger word and \"What it is\" alone.")
    elif not trigger:
        lines.append("Type the trigger word and Scan to find the captions that lack it.")
    elif missing:
        said, advice = lacking(len(missing), holding, None, trigger)
        lines.append(f"**{md_text(said)}**: {md_text(advice)} (the bulk edit \"add the trigger word where missing\" "
                     f"adds it to the caption files): {names(missing)}")
    else:
        lines.append(f"Every caption holds the trigger word {md_text(repr(trigger))}.")
    if found.upscaled:
        lines.append(f"**{len(found.upscaled)} image(s) upscaled more than 2x** to cover their bucket (use larger "
                     f"images or a lower resolution): {names([it for it, _ in found.upscaled])}")
    lines += [f"- {md_text(s)}" for s in suggested]
    return "\n\n".join(lines)


def default_resolution() -> int:
    """What training uses by default: the config's data.resolution, else the default model's native one
    (128 for the demo base, 1024 for SDXL)."""
    from sdxl_lora.sdxl.model import unet_skeleton

    cfg = load_config()
    return cfg.data.resolution or unet_skeleton(cfg.model)[1]


def _guarded(fn, *args):
    """fn(*args), or the error it raised as a message (a refused path, a field with a bad value)."""
    try:
        return fn(*args), None
    except (PathRefused, ValueError, OSError) as e:
        return None, error_md(e)


def build(f: Folders, pickers) -> None:
    folders = image_folders(f.datasets)
    with gr.Row():
        folder = gr.Dropdown(folders, value=folders[0] if folders else None, allow_custom_value=True,
                             label=f"Dataset folder (under {f.datasets})", elem_id="ds-folder", scale=3)
        ext = gr.Textbox(DataConfig.model_fields["caption_extension"].default, label="caption extension",
                         elem_id="ds-ext", scale=1)
        trigger = gr.Textbox(label="trigger word", info="the word your captions should hold (the doctor checks it)",
                             elem_id="ds-trigger", scale=1)
        res = gr.Number(default_resolution(), precision=0, label="bucket resolution", elem_id="ds-resolution",
                        scale=1)
        scan_btn = gr.Button("Scan", variant="primary", elem_id="ds-scan", scale=1)
    status = gr.Markdown(elem_id="ds-status")
    items = gr.State([])
    previewed = gr.State(None)  # the bulk edit whose count was shown; Apply writes only that one
    grid = gr.Dataframe(headers=["tick", "image", "file", "caption"], datatype=["bool", "markdown", "str", "str"],
                        interactive=True, static_columns=[1, 2], wrap=True, max_height=520,
                        column_widths=["6%", "14%", "22%", "58%"], label="images and captions (edit a caption cell, "
                        "then Save captions)", elem_id="ds-grid")
    with gr.Row():
        save = gr.Button("Save captions", variant="primary", elem_id="ds-save", scale=1)
        saved = gr.Markdown(elem_id="ds-saved")
    with gr.Accordion("Bulk edit captions", open=True, elem_id="ds-bulk"):
        with gr.Row():
            op = gr.Dropdown(list(edit.OPERATIONS), value=edit.OPERATIONS[0], label="edit", elem_id="ds-bulk-op")
            text = gr.Textbox(label="text to add (prefix, suffix or the trigger word)", elem_id="ds-bulk-text")
            find = gr.Textbox(label="find", elem_id="ds-bulk-find")
            replace = gr.Textbox(label="replace with", elem_id="ds-bulk-replace")
            scope = gr.Radio(list(edit.SCOPES), value=edit.SCOPES[0], label="apply to", elem_id="ds-bulk-scope")
        with gr.Row():
            preview = gr.Button("Preview: how many change", elem_id="ds-bulk-preview")
            apply = gr.Button("Apply", variant="stop", elem_id="ds-bulk-apply")
        bulk_msg = gr.Markdown(elem_id="ds-bulk-msg")
    with gr.Row():
        with gr.Column(scale=2):
            doctor = gr.Markdown(label="doctor", elem_id="ds-doctor")
        tags = gr.Dataframe(headers=["tag", "captions", "share"], interactive=False, max_height=300,
                            label="tags (comma-separated), by how many captions hold each", elem_id="ds-tags", scale=1)
    with gr.Row():
        hist = gr.BarPlot(x="bucket", y="images", title="images per bucket", y_lim=[0, None], y_axis_format="d",
                          elem_id="ds-hist", scale=1)
        report = gr.Textbox(label="report (dataset inspect)", lines=14, max_lines=30, elem_id="ds-report", scale=2)
    with gr.Accordion("Upload images and captions", open=False, elem_id="ds-upload-acc"):
        # Into the folder picked above (a new name typed there makes a new folder): one place names the folder,
        # so an upload never goes where a second, stale copy of the name pointed.
        gr.Markdown("Into the dataset folder picked above; type a new name there to make a new folder.")
        up_overwrite = gr.Checkbox(False, label="overwrite files already there", elem_id="ds-up-overwrite")
        up_files = gr.File(file_count="multiple", type="filepath", label="images and their caption files",
                           elem_id="ds-up-files")
        up_go = gr.Button("Upload", elem_id="ds-up-go")
        up_msg = gr.Markdown(elem_id="ds-up-msg")
    with gr.Accordion("Caption with a local model", open=False, elem_id="ds-cap-acc"):
        models = edit.captioner_choices(f.models)
        with gr.Row():
            cap_model = gr.Dropdown(models, value=models[0] if models else None, label=f"captioning model (a folder "
                                    f"under {f.models})", elem_id="ds-cap-model", scale=2)
            cap_prefix = gr.Textbox(label="put before each caption (e.g. the trigger word)", elem_id="ds-cap-prefix",
                                    scale=2)
            cap_overwrite = gr.Checkbox(False, label="replace existing captions", elem_id="ds-cap-overwrite", scale=1)
        with gr.Row():  # a WD14-style tagger's own thresholds, as `sdxl-lora dataset tag` takes them
            cap_general = gr.Number(GENERAL_THRESHOLD, label=edit.GENERAL_LABEL, step=0.05,
                                    elem_id="ds-tag-general",
                                    info="a tagger writes each general tag it is at least this sure of (lower: more "
                                         "tags); a captioning model ignores it")
            cap_character = gr.Number(CHARACTER_THRESHOLD, label=edit.CHARACTER_LABEL, step=0.05,
                                      elem_id="ds-tag-character",
                                      info="the same for a character's name tag; a captioning model ignores it")
        cap_go = gr.Button("Caption the images without one", elem_id="ds-cap-go")
        cap_msg = gr.Markdown(elem_id="ds-cap-msg")

    pickers.add(folder, lambda: image_folders(f.datasets))
    pickers.add(cap_model, lambda: edit.captioner_choices(f.models))
    shown = gr.State(None)  # the folder the table shows: a Save or an Apply refreshes its panes
    panes = [status, report, hist, doctor, tags]
    scanned = [items, grid, *panes, shown]

    def do_scan(folder, ext, res, trigger, progress=gr.Progress()):
        return *_scan(f, folder, ext, res, progress, trigger), folder

    def do_save(items, rows, ext, shown, res, trigger, progress=gr.Progress()):
        return save_captions(f, items, rows, ext, shown, res, trigger, progress)

    def bulk(op, text, find, replace):
        return edit.BulkEdit(op, text, find, replace)

    def do_preview(items, rows, op, text, find, replace, scope):
        what = bulk(op, text, find, replace)
        out, err = _guarded(edit.bulk_preview, f, items, rows, what, scope)
        return (None, err) if err else ((what, scope, _ticked(rows)), md_text(out))

    def do_apply(items, rows, previewed, op, text, find, replace, scope, ext, shown, res, trigger,
                 progress=gr.Progress()):
        return apply_bulk(f, items, rows, previewed, bulk(op, text, find, replace), scope, ext, shown, res, trigger,
                          progress)

    def do_upload(folder, files, ext, overwrite):
        named = [(os.path.basename(p), p) for p in (files or [])]
        out, err = _guarded(edit.upload, f, folder, named, ext, overwrite)
        choices = image_folders(f.datasets)
        # The list is emptied once sent, so the next upload sends only what is picked then.
        return err or md_text(out), gr.update(choices=choices), (files if err else None)

    def do_caption(folder, model, ext, overwrite, prefix, general, character, progress=gr.Progress()):
        on = lambda done, total: progress((done, total), desc="captioning")  # noqa: E731
        out, err = _guarded(edit.caption, f, folder, model, ext, overwrite, prefix, on, general, character)
        return err or md_text(out)

    # The messages of what was done in the folder shown before go with it: another folder, or the same scanned
    # again, starts without them.
    messages = [saved, bulk_msg, up_msg, cap_msg]
    scan_btn.click(do_scan, [folder, ext, res, trigger], scanned).then(
        lambda: (None, *("" for _ in messages)), None, [previewed, *messages])
    folder.input(lambda: tuple("" for _ in messages), None, messages, show_progress="hidden")
    save.click(do_save, [items, grid, ext, shown, res, trigger], [items, grid, saved, *panes])
    preview.click(do_preview, [items, grid, op, text, find, replace, scope], [previewed, bulk_msg])
    apply.click(do_apply, [items, grid, previewed, op, text, find, replace, scope, ext, shown, res, trigger],
                [items, grid, previewed, bulk_msg, *panes])
    up_go.click(do_upload, [folder, up_files, ext, up_overwrite], [up_msg, folder, up_files])
    cap_go.click(do_caption, [folder, cap_model, ext, cap_overwrite, cap_prefix, cap_general, cap_character],
                 cap_msg).then(do_scan, [folder, ext, res, trigger], scanned)


def _ticked(rows) -> tuple[int, ...]:
    return tuple(i for i, r in enumerate(edit._rows(rows)) if bool(r[0]))

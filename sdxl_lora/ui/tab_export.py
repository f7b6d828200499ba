"""Export tab: a run's adapter (or an adapter file) written as kohya (ComfyUI/A1111/Forge), diffusers or PEFT,
with the metadata fields people fill in, optionally resized to a smaller rank, into the run's exports/ folder,
with the line per kind saying which tools load it right (sdxl/formats/loaders.py), and offered for download (as
`sdxl-lora export` and `sdxl-lora resize` do; sdxl_lora/sdxl/formats/export.py and resize.py do the work). Below it, a
LoRA extracted from a fine-tuned model of the models folder, as `sdxl-lora extract` does (sdxl/formats/extract.py),
written to models/loras/exports/; and adapters merged into a checkpoint of the models folder, as
`sdxl-lora merge` does (sdxl/formats/merge.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

import gradio as gr

from .folders import Folders, PathRefused, model_choices
from .text import error_md, md_text, writer_words
from .tab_generate import adapter_choices, adapter_path

FORMATS = ("kohya", "diffusers", "peft")
FIXED = "fixed rank"
RESIZE_METHODS = (FIXED, "sv_fro", "sv_cumulative", "sv_ratio")
MERGE_SLOTS = 3  # adapters merged at once from the page (the CLI takes any number)
MERGE_FORMS = ("single file", "diffusers folder")
# The overwrite checkboxes' labels, which the messages name.
OVERWRITE_EXPORT = "overwrite an existing export"
OVERWRITE_MODEL = "overwrite an existing model"
OVERWRITE_FILE = "overwrite an existing file"


def bad_stem(stem: str, what: str) -> str | None:
    """Why `stem` cannot name a file written into a folder of the page (None: it can)."""
    if not stem or "/" in stem or "\\" in stem or stem.startswith("."):
        return error_md(f"{what} {stem!r} names the file: give one, with no '/' or '\\' and no leading '.'")
    return None


def source_choices(f: Folders) -> list[str]:
    runs = [f"runs/{p.name}" for p in sorted(f.runs.iterdir())
            if p.is_dir() and not p.name.startswith(".") and (p / f"{p.name}.safetensors").is_file()]
    return runs + [c for c in adapter_choices(f) if c not in runs]


def _source(f: Folders, choice: str) -> tuple[Path, str | Path | None, Path]:
    """(adapter file, the model its layer names refer to, the folder exports go to)."""
    from sdxl_lora.core.config import load_config
    from sdxl_lora.sdxl.config import ModelConfig
    from sdxl_lora.sdxl.model import resolve_model_path

    p = adapter_path(f, choice)
    run = p if p.is_dir() else None
    if run is None and p.parent.name == "exports":
        run = p.parent.parent
    elif run is None and p.parent.parent == f.runs:
        run = p.parent
    model = None
    if run is not None and (run / "config.toml").is_file():
        mcfg = load_config(run / "config.toml").model
        # The tiny model resolves in the UI's models folder (materialised there if needed).
        model = resolve_model_path(ModelConfig(path=mcfg.path, cache_dir=str(f.models)))
    if p.is_dir():
        p = p / f"{p.name}.safetensors"
        if not p.is_file():
            raise FileNotFoundError(f"run {run.name} has no adapter yet ({p.name}): has it finished?")
    out_dir = (run / "exports") if run is not None else (f.models / "loras" / "exports")
    return p, model, out_dir


def tools_md(written: Path, fmt: str) -> str:
    """Which tools load a written kohya file right, wrongly or not at all: the lines `sdxl-lora inspect` prints
    (sdxl/formats/loaders.py), each a paragraph to put after an export's message; "" for another format."""
    from sdxl_lora.sdxl.formats.loaders import file_notes

    return "".join(f"\n\n{md_text(line)}" for line in (file_notes(written) if fmt == "kohya" else []))


def export(f: Folders, choice, fmt, title, author, description, trigger, license_, write_meta, names, true_alpha,
           overwrite, resize_rank=0, resize_method=FIXED, resize_param=None):
    """Write the chosen adapter in `fmt`; with resize_rank > 0 cut to that rank first (sdxl/formats/resize.py), by
    resize_method (FIXED, or a dynamic method with resize_param) -> (the file to download, a message)."""
    from sdxl_lora.sdxl.formats.export import AdapterError, export_adapter, layer_table, load_adapter
    from sdxl_lora.sdxl.formats.resize import provenance, resize_adapter

    if not choice:
        return None, "**Error:** pick a run or an adapter"
    if fmt not in FORMATS:
        return None, f"**Error:** format {fmt!r}: one of {', '.join(FORMATS)}"
    try:
        src, model, out_dir = _source(f, choice)
        table = layer_table(model)
        adapter = load_adapter(src, table)
        if adapter.unknown:
            return None, error_md(f"{src.name}: {adapter.problems[0]}")
        stem = (title or "").strip() or src.name.split(".")[0]
        if why := bad_stem(stem, "title"):
            return None, why
        meta: bool | dict = False
        if write_meta:
            fields = {"modelspec.title": stem, "ss_output_name": stem, "modelspec.author": author,
                      "modelspec.description": description, "modelspec.trigger_phrase": trigger,
                      "modelspec.license": license_}
            meta = {k: v.strip() for k, v in fields.items() if v and v.strip()}
        resized = None
        if resize_rank and int(resize_rank) > 0:
            method = None if resize_method in (None, FIXED) else resize_method
            param = resize_param if method else None
            resized = resize_adapter(adapter, int(resize_rank), method, param)
            if meta is not False:
                meta.update(provenance(src.name, int(resize_rank), method, param))
        suffix = {"kohya": ".safetensors", "diffusers": ".diffusers.safetensors", "peft": ".peft"}[fmt]
        out = f.inside(out_dir / f"{stem}{suffix}", "runs" if f.runs in out_dir.parents else "models")
        written = export_adapter(resized.adapter if resized else adapter, out, fmt, metadata=meta, names=names,
                                 unet_config=table.unet_config, uniform_alpha=not true_alpha,
                                 overwrite=bool(overwrite), reads=(src, model))
    except (AdapterError, PathRefused, FileExistsError, FileNotFoundError, ValueError) as e:
        return None, error_md(writer_words(e, "title", OVERWRITE_EXPORT))
    download = written
    if written.is_dir():  # a PEFT adapter is a folder: offer it zipped
        download = Path(shutil.make_archive(str(written), "zip", root_dir=written))
    said = f" Resized: {resized.summary()}." if resized else ""
    tools = tools_md(written, fmt)
    return str(download), (f"{fmt} adapter written: `{written}` ({len(adapter.layers)} layers, read from "
                           f"`{src.name}`, {adapter.format}).{said}{tools}")


def extract(f: Folders, base, tuned, rank, conv_rank, method, param, text_encoders, name, overwrite,
            progress=None):
    """The LoRA that moves `base` towards `tuned` (both from the models folder or built in), at `rank` (linears)
    and `conv_rank` (convolutions; 0: the same), by `method` (FIXED or a dynamic one with `param`), written as
    a kohya file to models/loras/exports/NAME.safetensors -> (the file to download, a message). The SVDs run
    on the GPU where there is one (a full SDXL's take minutes on a CPU)."""
    import torch

    from sdxl_lora.sdxl.formats.export import AdapterError, check_dest, export_adapter, layer_table
    from sdxl_lora.sdxl.formats.extract import extract_adapter

    if not base or not tuned:
        return None, "**Error:** pick the base model and the fine-tuned one"
    stem = (name or "").strip() or f"{Path(str(tuned)).name.split('.')[0]}-extracted"
    if why := bad_stem(stem, "name"):
        return None, why
    method = None if method in (None, FIXED) else method
    try:
        base_path, tuned_path = f.model(base), f.model(tuned)
        out = f.inside(f.models / "loras" / "exports" / f"{stem}.safetensors", "models")
        reads = (base_path, tuned_path)
        check_dest(out, bool(overwrite), reads, reader="the extraction")  # before minutes of reading and SVDs
        report = None if progress is None else (lambda i, n: progress((i, n), desc="layers"))
        done = extract_adapter(base_path, tuned_path, int(rank or 0), conv_rank=int(conv_rank) if conv_rank else None,
                               method=method, param=param if method else None, text_encoders=bool(text_encoders),
                               device="cuda" if torch.cuda.is_available() else "cpu", progress=report)
        done.adapter.metadata.update({"modelspec.title": stem, "ss_output_name": stem})
        written = export_adapter(done.adapter, out, "kohya", unet_config=layer_table(base_path).unet_config,
                                 overwrite=bool(overwrite), reads=reads)
    except (AdapterError, PathRefused, FileExistsError, FileNotFoundError, ValueError) as e:
        return None, error_md(writer_words(e, "file name", OVERWRITE_FILE))
    return str(written), f"LoRA extracted: `{written}`. {done.summary()}."


def merge(f: Folders, base, name, form, dtype, overwrite, *slots):
    """Bake up to MERGE_SLOTS adapters (slots: adapter choice, strength, ...; empty choices skipped) into `base`
    and write the checkpoint into the models folder, as `models/NAME.safetensors` (one original-layout file:
    ComfyUI, A1111/Forge) or the diffusers folder `models/NAME` -> a message. The result is a model the Train
    and Generate tabs offer."""
    from sdxl_lora.sdxl.formats.export import AdapterError
    from sdxl_lora.sdxl.formats.merge import merge_checkpoint

    pairs = [(slots[i], slots[i + 1]) for i in range(0, len(slots), 2) if slots[i]]
    if not base or not pairs:
        return "**Error:** pick the base model and at least one adapter"
    stem = (name or "").strip()
    if why := bad_stem(stem, "the new model's name"):
        return why
    if form not in MERGE_FORMS:
        return error_md(f"form {form!r}: one of {', '.join(MERGE_FORMS)}")
    try:
        loras = [(adapter_path(f, choice), float(1.0 if strength is None else strength)) for choice, strength in pairs]
        out = f.inside(f"{stem}.safetensors" if form == MERGE_FORMS[0] else stem, "models")
        written = merge_checkpoint(f.model(base), loras, out, dtype=dtype or "auto", overwrite=bool(overwrite))
    except (AdapterError, PathRefused, FileExistsError, FileNotFoundError, ValueError) as e:
        return error_md(writer_words(e, "new model's name", OVERWRITE_MODEL))
    said = ", ".join(f"{p.name} at {s:g}" for p, s in loras)
    return (f"Merged {said} into `{written}`: pick `{written.relative_to(f.models)}` as the model in the Train or "
            "Generate tab.")


def build(f: Folders, pickers):
    models = model_choices(f.models)
    with gr.Row():
        with gr.Column():
            source = gr.Dropdown([], allow_custom_value=True, label="run or adapter", elem_id="exp-source")
            refresh = gr.Button("Refresh list", size="sm", elem_id="exp-refresh")
            fmt = gr.Radio(list(FORMATS), value="kohya", label="format", elem_id="exp-format",
                           info="kohya: ComfyUI, AUTOMATIC1111/Forge, kohya; diffusers: load_lora_weights; "
                                "peft: a PEFT adapter folder (downloaded as .zip)")
            with gr.Group():
                title = gr.Textbox(label="title (also the file name; empty: the adapter's name)", elem_id="exp-title")
                author = gr.Textbox(label="author", elem_id="exp-author")
                description = gr.Textbox(label="description", lines=2, elem_id="exp-description")
                trigger = gr.Textbox(label="trigger phrase", elem_id="exp-trigger")
                license_ = gr.Textbox(label="license", elem_id="exp-license")
                write_meta = gr.Checkbox(True, label="write metadata (ss_* / modelspec.*)", elem_id="exp-meta")
        with gr.Column():
            with gr.Accordion("kohya options", open=False):
                names = gr.Radio(["sgm", "diffusers"], value="sgm", label="layer names", elem_id="exp-names",
                                 info="sgm: SDXL's original names, what A1111/ComfyUI expect")
                true_alpha = gr.Checkbox(False, label="keep each layer's training alpha", elem_id="exp-true-alpha")
            with gr.Accordion("resize (a smaller file)", open=False):
                resize_rank = gr.Number(0, precision=0, minimum=0, label="rank (0: as trained)",
                                        elem_id="exp-resize-rank",
                                        info="each layer's update cut by SVD to this rank, the closest one of it; "
                                             "LoHa/LoKr come out as LoRA (docs/export.md)")
                resize_method = gr.Dropdown(list(RESIZE_METHODS), value=FIXED, label="method",
                                            elem_id="exp-resize-method",
                                            info="or per layer the fewest ranks (at most the rank above) that "
                                                 "keep a share of the update: sv_fro (of its norm), sv_cumulative "
                                                 "(of its singular values' sum), sv_ratio (within a factor of the "
                                                 "largest)")
                resize_param = gr.Number(0.9, label="share (sv_fro, sv_cumulative) or factor (sv_ratio)",
                                         elem_id="exp-resize-param")
            overwrite = gr.Checkbox(False, label=OVERWRITE_EXPORT, elem_id="exp-overwrite")
            go = gr.Button("Export", variant="primary", elem_id="exp-go")
            # Under the button: where the person looks after pressing it.
            msg = gr.Markdown(elem_id="exp-msg")
            file = gr.File(label="download", interactive=False, elem_id="exp-file")
    with gr.Accordion("Merge adapters into a checkpoint", open=False), gr.Row():
        with gr.Column():
            m_base = gr.Dropdown(models, value=models[0], allow_custom_value=True, label="base model",
                                 elem_id="mrg-base")
            m_slots = []
            for i in range(MERGE_SLOTS):
                with gr.Row():
                    m_slots.append(gr.Dropdown([], allow_custom_value=True, label=f"adapter {i + 1}",
                                               elem_id=f"mrg-adapter-{i}"))
                    m_slots.append(gr.Number(1.0, label="strength", elem_id=f"mrg-strength-{i}"))
        with gr.Column():
            m_name = gr.Textbox(label="new model's name", elem_id="mrg-name")
            m_form = gr.Radio(list(MERGE_FORMS), value=MERGE_FORMS[0], label="written as", elem_id="mrg-form",
                              info="single file: models/NAME.safetensors (ComfyUI, A1111/Forge); diffusers folder: "
                                   "models/NAME")
            m_dtype = gr.Radio(["auto", "fp16", "bf16", "fp32"], value="auto", label="dtype", elem_id="mrg-dtype",
                               info="auto: the base's own")
            m_overwrite = gr.Checkbox(False, label=OVERWRITE_MODEL, elem_id="mrg-overwrite")
            m_go = gr.Button("Merge", variant="primary", elem_id="mrg-go")
            m_msg = gr.Markdown(elem_id="mrg-msg")
    with gr.Accordion("Extract a LoRA from a fine-tuned model", open=False), gr.Row():
        with gr.Column():
            x_base = gr.Dropdown(models, value=models[0], allow_custom_value=True, label="base model",
                                 elem_id="ext-base", info="the model it was fine-tuned from (models folder)")
            x_tuned = gr.Dropdown(models, allow_custom_value=True, label="fine-tuned (or merged) model",
                                  elem_id="ext-tuned", info="the same architecture as the base")
            with gr.Row():
                x_rank = gr.Number(32, precision=0, minimum=1, label="rank", elem_id="ext-rank")
                x_conv = gr.Number(0, precision=0, minimum=0, label="convolutions' rank (0: the same)",
                                   elem_id="ext-conv-rank")
            x_method = gr.Dropdown(list(RESIZE_METHODS), value=FIXED, label="method", elem_id="ext-method",
                                   info="as for resize: a fixed rank, or per layer the fewest ranks (at most the "
                                        "rank above) that keep a share of the difference")
            x_param = gr.Number(0.9, label="share (sv_fro, sv_cumulative) or factor (sv_ratio)", elem_id="ext-param")
        with gr.Column():
            x_te = gr.Checkbox(True, label="the text encoders' layers too", elem_id="ext-te")
            x_name = gr.Textbox(label="file name (empty: the tuned model's name + '-extracted')", elem_id="ext-name")
            x_overwrite = gr.Checkbox(False, label=OVERWRITE_FILE, elem_id="ext-overwrite")
            x_go = gr.Button("Extract", variant="primary", elem_id="ext-go")
            x_msg = gr.Markdown(elem_id="ext-msg")
            x_file = gr.File(label="download", interactive=False, elem_id="ext-file")

    merge_picks = m_slots[0::2]

    def do_refresh():
        models, adapters = model_choices(f.models), adapter_choices(f)
        return (gr.update(choices=source_choices(f)), *[gr.update(choices=models)] * 3,
                *[gr.update(choices=adapters)] * len(merge_picks))

    def do_extract(*a, progress=gr.Progress()):
        return extract(f, *a, progress=progress)

    go.click(lambda *a: export(f, *a),
             [source, fmt, title, author, description, trigger, license_, write_meta, names, true_alpha, overwrite,
              resize_rank, resize_method, resize_param],
             [file, msg])
    refreshed = [source, x_base, x_tuned, m_base, *merge_picks]
    refresh.click(do_refresh, None, refreshed)
    pickers.add(source, lambda: source_choices(f))
    for d in (x_base, x_tuned, m_base):
        pickers.add(d, lambda: model_choices(f.models))
    for d in merge_picks:
        pickers.add(d, lambda: adapter_choices(f))
    m_go.click(lambda *a: merge(f, *a), [m_base, m_name, m_form, m_dtype, m_overwrite, *m_slots], m_msg)
    x_go.click(do_extract, [x_base, x_tuned, x_rank, x_conv, x_method, x_param, x_te, x_name, x_overwrite],
               [x_file, x_msg])

"""A New run form's config as a file and as a command: save the form as a TOML config (the file `sdxl-lora train
CONFIG` reads, kept in runs/.ui/saved/ and offered for download), load one into the form (a saved one, or a .toml
uploaded from this computer: any run's config.toml too), and the `sdxl-lora train` command line that trains what
the form holds. The file and the command make the same config as Start (tests/ui/test_ui_config.py)."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from sdxl_lora.core.config import Config, load_config
from sdxl_lora.core.fsutil import atomic_write_text

from .form import DECIDED_WHEN_UNSET, _toml_literal, default_prompts, model_default_prompts

SAVED = "saved"  # runs/.ui/saved/: the configs saved from the page


def saved_dir(f) -> Path:
    return f.ui / SAVED


def saved_choices(f) -> list[str]:
    """The configs saved from the page, by file name."""
    folder = saved_dir(f)
    return sorted(p.name for p in folder.glob("*.toml")) if folder.is_dir() else []


def _stem(form, values: list, typed: str | None) -> str:
    stem = (typed or "").strip().removesuffix(".toml") or form.name_value(values).strip() or "config"
    if "/" in stem or "\\" in stem or stem.startswith("."):
        raise ValueError(f"config name {stem!r}: a file name, with no '/' or '\\' and no leading '.'")
    return stem


def form_file_config(form, values: list, stem: str) -> Config:
    """The form's config as a file outside a run holds it: its preview prompts saved beside it (STEM.prompts.txt),
    where the form has some."""
    prompts = values[3]
    prompts_file = None
    if prompts and prompts.strip() and not model_default_prompts(prompts):
        prompts_file = saved_dir(form.f) / f"{stem}.prompts.txt"
        atomic_write_text(prompts_file, prompts.strip() + "\n")
    return form.config(values, None, prompts_file)


def save(form, values: list, typed: str | None) -> tuple[Path, str]:
    """Write the form as runs/.ui/saved/STEM.toml (replacing the page's own earlier save of that name): (the file,
    the command that trains it)."""
    stem = _stem(form, values, typed)
    cfg = form_file_config(form, values, stem)
    path = saved_dir(form.f) / f"{stem}.toml"
    atomic_write_text(path, cfg.to_toml(leave_unset=DECIDED_WHEN_UNSET))
    train = "sdxl-lora train" if form.task == "sdxl" else "sdxl-lora llm train"
    return path, f"{train} {shlex.quote(str(path))}"


def load(form, path: str | Path, name: str | None = None) -> tuple[list, str, list[str]]:
    """A config file's values for the form (`form.inputs` order, the per-dataset table's rows last on the SDXL
    form), the run name it names, and what the form has no place for (left out)."""
    from . import dataset_table
    from .duplicate import config_values

    cfg = load_config(path)
    shown = name or Path(path).name
    if cfg.task != form.task:
        tab = "Train tab" if cfg.task == "sdxl" else f"{cfg.task.upper()} tab"
        raise ValueError(f"{shown} is an {cfg.task.upper()} config (task = {cfg.task!r}); load it in the {tab}")
    run_name = cfg.output.name or ""
    values = config_values(form, cfg, run_name, default_prompts())
    if form.task != "sdxl":
        return values, run_name, []
    values[1], rows, left_out = dataset_table.from_config(form.f, cfg, values[1])
    return [*values, rows], run_name, left_out


def _dotted(cfg: Config) -> dict[str, Any]:
    out = {}
    for section, value in cfg.model_dump().items():
        if isinstance(value, dict):
            out.update({f"{section}.{k}": v for k, v in value.items()})
        else:
            out[section] = value
    return out


def _without_none(value):
    """A value as TOML can write it: a table's unset (None) entries left out, as a config file leaves them."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_without_none(v) for v in value]
    return value


def command(form, values: list) -> str:
    """The command line that trains what the form holds: `sdxl-lora train` (or `llm train`) with the base model
    and one --set for each field that differs from what that command gives the model on its own (the schema's
    defaults and the model's recommended settings)."""
    stem = _stem(form, values, None)
    cfg = form_file_config(form, values, stem)
    fixed = {"task": cfg.task} if cfg.task != "sdxl" else {}
    base = _dotted(load_config(None, None, {**fixed, "model.path": cfg.model.path}))
    own = _dotted(cfg)
    lines = ["sdxl-lora train" if cfg.task == "sdxl" else "sdxl-lora llm train"]
    unsaid = []
    for key in ["model.path", *(k for k in own if k not in ("model.path", "task"))]:
        value = own[key]
        if key != "model.path" and value == base.get(key):
            continue
        if value is None:  # a field the form empties where the model's settings fill it: no --set says "none"
            unsaid.append(key)
            continue
        lines.append(f"--set {shlex.quote(f'{key}={_toml_literal(_without_none(value))}')}")
    line = " \\\n  ".join(lines)
    if unsaid:
        line += "\n# empty on the form, which --set cannot say; the saved config keeps it: " + ", ".join(unsaid)
    return line


def build(form, pickers=None) -> None:
    """The form's config-file controls, folded under its Start button: load a saved or uploaded config into the
    form, save the form as one (and download it), show the command line."""
    import gradio as gr

    from sdxl_lora.core.config import ConfigError

    from .folders import PathRefused
    from .labels import error_words
    from .text import error_md, md_text

    f, p = form.f, form.prefix
    with gr.Accordion("Config file: load, save, command line", open=False, elem_id=f"{p}acc-config"):
        with gr.Row():
            saved = gr.Dropdown(saved_choices(f), value=None, label="saved configs (runs/.ui/saved)",
                                elem_id=f"{p}cfg-saved", scale=3)
            load_btn = gr.Button("Load into the form", elem_id=f"{p}cfg-load", scale=1)
            upload = gr.UploadButton("Load a .toml from this computer", file_types=[".toml"], file_count="single",
                                     elem_id=f"{p}cfg-upload", scale=1)
        with gr.Row():
            name = gr.Textbox(label="save as (empty: the run name)", elem_id=f"{p}cfg-name", scale=3)
            save_btn = gr.Button("Save the form as a config", elem_id=f"{p}cfg-save", scale=1)
            cmd_btn = gr.Button("Show the command", elem_id=f"{p}cfg-command", scale=1)
        msg = gr.Markdown(elem_id=f"{p}cfg-msg")
        file = gr.File(label="download", interactive=False, elem_id=f"{p}cfg-file")
        code = gr.Code(language="shell", label="the same run from a terminal", interactive=False,
                       elem_id=f"{p}cfg-code")
    if pickers is not None:
        pickers.add(saved, lambda: saved_choices(f))
    failed = (ConfigError, PathRefused, FileNotFoundError, OSError, ValueError)

    def do_save(typed, *values):
        try:
            path, train = save(form, list(values), typed)
        except failed as e:
            return gr.skip(), error_md(error_words(e, form.task)), gr.skip()
        said = f"saved `{path}`; train it from a terminal with `{train}`, or load it here later"
        return str(path), said, gr.update(choices=saved_choices(f), value=path.name)

    def filled(path, shown: str):
        skip = [gr.skip() for _ in form.inputs]
        try:
            values, run_name, left_out = load(form, path, shown)
        except failed as e:
            return [error_md(error_words(e, form.task)), *skip]
        note = f"; not in the form, so not loaded: {md_text('; '.join(left_out))}" if left_out else ""
        named = f" (run name {md_text(run_name)})" if run_name else ""
        return [f"loaded **{md_text(shown)}** into the form{named}; change what you like and press Start{note}",
                *values]

    def do_load(choice):
        if not choice:
            return [error_md("saved configs: pick one"), *(gr.skip() for _ in form.inputs)]
        try:
            path = f.inside(saved_dir(f) / choice, "runs")
        except PathRefused as e:
            return [error_md(e), *(gr.skip() for _ in form.inputs)]
        return filled(path, choice)

    def do_upload(path):
        return filled(path, Path(path).name if path else "")

    def do_command(*values):
        try:
            return command(form, list(values)), ""
        except failed as e:
            return gr.skip(), error_md(error_words(e, form.task))

    save_btn.click(do_save, [name, *form.inputs], [file, msg, saved])
    form.after_fill(load_btn.click(do_load, saved, [msg, *form.inputs]))
    form.after_fill(upload.upload(do_upload, upload, [msg, *form.inputs]))
    cmd_btn.click(do_command, form.inputs, [code, msg])

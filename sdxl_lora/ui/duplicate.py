"""Duplicate as new run: a run's saved config put back into the New run form of its task (the Train tab's for an
SDXL run, the LLM tab's for a causal-LM run) under a new name, to change a setting or two and start again.
Nothing is written until Start; the run itself is never touched."""
from __future__ import annotations

import os
from pathlib import Path

from sdxl_lora.core.config import Config, load_config

from .folders import Folders, PathRefused, is_builtin
from .form import to_widget_value


def _value(cfg: Config, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _relative(f: Folders, path: str, kind: str) -> str:
    """A path as the form's pickers list it (relative to its folder) where it lies inside that folder."""
    try:
        return os.path.relpath(f.inside(path, kind), getattr(f, kind))
    except PathRefused:
        return path  # the form refuses it at Start, naming the folder


def _prompts_text(f: Folders, cfg: Config, default: str) -> str:
    path = cfg.preview.prompts
    if path is None:
        return default
    if not path:
        return ""
    for kind in ("runs", "datasets"):
        try:
            return Path(f.inside(path, kind)).read_text(encoding="utf-8").strip()
        except (PathRefused, OSError):
            continue
    return default


def new_name(taken, name: str) -> str:
    """`name-2`, `name-3`, ...: the first that no run and no queued run has. `taken(candidate)` raises
    FileExistsError for a taken name (Jobs.unique_name)."""
    n = 2
    while True:
        candidate = f"{name}-{n}"
        try:
            return taken(candidate)
        except FileExistsError:
            n += 1


def saved_config(jobs, name: str) -> Config:
    """Run `name`'s config: its config.toml, or the queue's copy for a run that has not started."""
    run = jobs.run_dir(name)
    cfg_path = run / "config.toml"
    if not cfg_path.is_file():
        cfg_path = jobs.f.ui / "configs" / f"{run.name}.toml"  # a queued run that has not started
    if not cfg_path.is_file():
        raise FileNotFoundError(f"run {name!r} has no config.toml to copy")
    return load_config(cfg_path)


def form_for(forms: dict, jobs, name: str):
    """Of `forms` (task -> form), the one that makes runs of run `name`'s task."""
    task = saved_config(jobs, name).task
    if task not in forms:
        raise ValueError(f"run {name!r} is an {task.upper()} run (task = {task!r} in its config.toml) and this page "
                         f"has no {task.upper()} tab: train a copy from the CLI with that config.toml")
    return forms[task]


def form_values(form, jobs, name: str, default_prompts: str) -> tuple[list, str]:
    """The form's values (in `form.inputs` order) for a copy of run `name`, and the copy's name."""
    cfg = saved_config(jobs, name)
    if cfg.task != form.task:
        raise ValueError(f"run {name!r} is an {cfg.task.upper()} run; this form makes {form.task.upper()} runs")
    copy = new_name(jobs.unique_name, name)
    return config_values(form, cfg, copy, default_prompts), copy


def config_values(form, cfg: Config, name: str, default_prompts: str) -> list:
    """The form's values (in `form.inputs` order, without the per-dataset table) that make `cfg` again, under run
    name `name`: paths as the pickers list them where they lie in the UI's folders."""
    f = form.f
    model = cfg.model.path if is_builtin(cfg.model.path) else _relative(f, cfg.model.path, "models")
    dirs = [_relative(f, d, "datasets") for d in _value(cfg, form.data_key)]
    tokenizer = _relative(f, cfg.model.tokenizer, "models") if getattr(cfg.model, "tokenizer", None) else ""
    prompts = _prompts_text(f, cfg, default_prompts) if form.task == "sdxl" else ""
    widgets = []
    for spec in form.widgets_specs():
        value = name if spec.key == "output.name" else _value(cfg, spec.key)
        # A preset box's "none" is its empty choice (no card preset): None would leave the box blank.
        widgets.append("" if spec.key in ("card", "goal") and value is None else to_widget_value(spec, value))
    return [model, dirs, tokenizer, prompts, *widgets]

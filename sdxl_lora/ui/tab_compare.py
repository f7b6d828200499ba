"""Compare tab: a run's saved checkpoints side by side at a few strengths (rows checkpoints, columns strengths),
fixed seeds, the losses logged at each checkpoint beside them, and the chosen one exported at the chosen
strength. The work is sdxl_lora/sdxl/compare.py's; renders are cached in the run's compare/ folder."""
from __future__ import annotations

import math

import gradio as gr

from .folders import Folders, PathRefused
from .tab_generate import Pipelines
from .tab_export import OVERWRITE_EXPORT, tools_md
from .text import error_md, md_text, writer_words

DEFAULT_PROMPT = "a red circle on a white background"
FORMATS = ("kohya", "diffusers")
SUFFIX = {"kohya": ".safetensors", "diffusers": ".diffusers.safetensors"}


def compare_runs(f: Folders) -> list[str]:
    """Runs with something to compare: a saved state or a final adapter (newest first)."""
    out = []
    for d in f.runs.iterdir():
        if d.is_dir() and not d.name.startswith(".") and (d / "config.toml").is_file() and (
                (d / f"{d.name}.safetensors").is_file() or any((d / "checkpoints").glob("step-*"))):
            out.append(d)
    return [d.name for d in sorted(out, key=lambda d: (d / "config.toml").stat().st_mtime, reverse=True)]


class RunView:
    """A run's config, checkpoints and losses, and the model its layer names refer to."""

    def __init__(self, f: Folders, name: str):
        from sdxl_lora.core.config import load_config
        from sdxl_lora.core.runs import read_events
        from sdxl_lora.sdxl.compare import checkpoint_losses, run_checkpoints
        from sdxl_lora.sdxl.config import ModelConfig
        from sdxl_lora.sdxl.model import resolve_model_path

        if not name:
            raise ValueError("run: pick a run")
        self.dir = f.run(name)
        if not (self.dir / "config.toml").is_file():
            raise FileNotFoundError(f"run {name!r} has no config.toml: is it a run folder?")
        self.cfg = load_config(self.dir / "config.toml")
        self.model = self.cfg.model.path
        path = f.model(self.model)
        self.model_dir = resolve_model_path(ModelConfig(path=path, cache_dir=str(f.models)))
        events = read_events(self.dir / "events.jsonl")
        self.checkpoints = run_checkpoints(self.dir, events)
        if not self.checkpoints:
            raise FileNotFoundError(f"run {name!r} has no saved checkpoint or adapter yet; checkpoints are saved "
                                    "every 'Save the training state every N steps' steps")
        self.losses = checkpoint_losses(events, [c.step for c in self.checkpoints])

    def table(self) -> list[list]:
        def show(v):
            return "" if v is None or math.isnan(v) else f"{v:.4f}"

        return [[c.label, show(self.losses[c.step].get("eval")), show(self.losses[c.step].get("validation")),
                 show(self.losses[c.step].get("train"))] for c in self.checkpoints]

    def checkpoint(self, label: str):
        for c in self.checkpoints:
            if c.label == label:
                return c
        raise ValueError(f"checkpoint {label!r}: not a checkpoint of run {self.dir.name} "
                         f"({', '.join(c.label for c in self.checkpoints)})")

    def layer_table(self):
        from sdxl_lora.sdxl.formats.export import layer_table

        return layer_table(self.model_dir)


def _first_prompt(f: Folders, view: RunView) -> str | None:
    """The first of the run's own preview prompts with its options, where the page may read its file."""
    from sdxl_lora.sdxl.preview import read_prompts

    path = view.cfg.preview.prompts
    if not path:
        return None
    try:
        prompts = read_prompts(f.inside(path, "runs"))
    except (PathRefused, OSError, ValueError):
        return None
    return prompts[0].line() if prompts else None  # with its options: the image its previews drew


def pick_run(f: Folders, name: str):
    """On picking a run: its checkpoints with their losses, the export picker's choices, a default name."""
    try:
        view = RunView(f, name)
    except (ValueError, PathRefused, FileNotFoundError) as e:
        return [], gr.update(choices=[], value=None), gr.skip(), error_md(e)
    labels = [c.label for c in view.checkpoints]
    prompt = _first_prompt(f, view)
    return (view.table(), gr.update(choices=labels, value=labels[-1]),
            gr.update(value=prompt) if prompt else gr.skip(),
            f"{len(labels)} checkpoint(s) of **{md_text(view.dir.name)}**; press Render to compare them")


def render_grids(f: Folders, pipes: Pipelines, name, prompts_text, strengths_text, progress=None):
    """The XY grids (one per prompt) and a line saying how many cells came from the cache."""
    from sdxl_lora.sdxl.compare import Settings, compare_grids, parse_prompts, parse_strengths
    from sdxl_lora.sdxl.model import native_resolution

    view = RunView(f, name)
    prompts = parse_prompts(prompts_text)
    strengths = parse_strengths(strengths_text)
    with pipes.lock:
        pipe = pipes.get(view.model)
        settings = Settings.of_run(view.cfg, native_resolution(pipe))
        grids = compare_grids(pipe, view.dir, view.checkpoints, prompts, strengths, settings, str(view.model_dir),
                              view.layer_table(), view.losses, progress=progress)
    cached, rendered = sum(g.cached for g in grids), sum(g.rendered for g in grids)
    gallery = [(str(g.path), g.prompt) for g in grids]
    msg = (f"{len(view.checkpoints)} checkpoint(s) x {len(strengths)} strength(s) x {len(prompts)} prompt(s): "
           f"{cached} image(s) from the cache, {rendered} rendered")
    return view.table(), gallery, msg


def default_name(name: str, label: str | None, strength) -> str:
    step = label.split()[1] if label and label.startswith("step ") else "final"
    try:
        pct = round(float(strength) * 100)
    except (TypeError, ValueError):
        pct = 100
    return f"{name}-step{step}-x{pct}"


def export(f: Folders, name, label, strength, fmt, title, overwrite):
    from sdxl_lora.sdxl.compare import export_checkpoint
    from sdxl_lora.sdxl.formats.export import AdapterError

    try:
        view = RunView(f, name)
        ck = view.checkpoint(label)
        if strength is None or not math.isfinite(float(strength)) or not -2 <= float(strength) <= 2:
            raise ValueError(f"strength {strength!r}: a number from -2 to 2")
        if fmt not in FORMATS:
            raise ValueError(f"format {fmt!r}: one of {', '.join(FORMATS)}")
        stem = (title or "").strip() or default_name(view.dir.name, label, strength)
        if "/" in stem or "\\" in stem or stem.startswith("."):
            raise ValueError(f"file name {stem!r}: no '/' or '\\' and no leading '.'")
        out = f.inside(view.dir / "exports" / f"{stem}{SUFFIX[fmt]}", "runs")
        written = export_checkpoint(view.dir, ck, float(strength), fmt, out, view.layer_table(), title=stem,
                                    overwrite=bool(overwrite))
    except (AdapterError, PathRefused, FileExistsError, FileNotFoundError, ValueError) as e:
        return None, error_md(writer_words(e, "file name", OVERWRITE_EXPORT))
    return str(written), (f"{fmt} adapter written: `{written}` ({ck.label} at strength {float(strength):g})"
                          f"{tools_md(written, fmt)}")


def build(f: Folders, pipes: Pipelines, pickers):
    with gr.Row():
        with gr.Column(scale=2):
            run = gr.Dropdown([], allow_custom_value=True, label="run", elem_id="cmp-run")
            refresh = gr.Button("Refresh list", size="sm", elem_id="cmp-refresh")
            prompts = gr.Textbox(DEFAULT_PROMPT, lines=2, label="prompts", elem_id="cmp-prompts",
                                 info="one a line, with kohya's options: --n negative, --w width, --h height, "
                                      "--s steps, --l guidance, --d seed (unset: the run's preview settings)")
            strengths = gr.Textbox(", ".join(f"{s:g}" for s in (0.5, 0.75, 1.0)), label="strengths",
                                   elem_id="cmp-strengths", info="the grid's columns, separated by commas")
            go = gr.Button("Render", variant="primary", elem_id="cmp-go")
            table = gr.Dataframe(headers=["checkpoint", "eval loss", "validation loss", "training loss"],
                                 interactive=False, label="checkpoints and their losses", elem_id="cmp-table")
            with gr.Group():
                gr.Markdown("**Export the one you like**")
                pick = gr.Dropdown([], label="checkpoint", elem_id="cmp-pick")
                strength = gr.Number(1.0, label="strength", minimum=-2, maximum=2, elem_id="cmp-strength")
                fmt = gr.Radio(list(FORMATS), value="kohya", label="format", elem_id="cmp-format",
                               info="kohya: ComfyUI, AUTOMATIC1111/Forge, kohya; diffusers: load_lora_weights")
                title = gr.Textbox(label="file name (empty: run, step and strength)", elem_id="cmp-title")
                overwrite = gr.Checkbox(False, label=OVERWRITE_EXPORT, elem_id="cmp-overwrite")
                export_btn = gr.Button("Export", elem_id="cmp-export")
                export_msg = gr.Markdown(elem_id="cmp-export-msg")
                file = gr.File(label="download", interactive=False, elem_id="cmp-file")
        with gr.Column(scale=3):
            msg = gr.Markdown(elem_id="cmp-msg")
            gallery = gr.Gallery(label="rows: checkpoints · columns: strengths", columns=1, height=720,
                                 object_fit="contain", elem_id="cmp-grid")

    def do_render(name, prompts_text, strengths_text, progress=gr.Progress()):
        try:
            return render_grids(f, pipes, name, prompts_text, strengths_text,
                                progress=lambda frac, desc: progress(frac, desc=desc))
        except (ValueError, PathRefused, FileNotFoundError) as e:
            return gr.skip(), gr.skip(), error_md(e)

    def do_refresh():
        return gr.update(choices=compare_runs(f))

    run.input(lambda name: pick_run(f, name), run, [table, pick, prompts, msg])
    go.click(do_render, [run, prompts, strengths], [table, gallery, msg])
    export_btn.click(lambda *a: export(f, *a), [run, pick, strength, fmt, title, overwrite], [file, export_msg])
    refresh.click(do_refresh, None, run)
    pickers.add(run, lambda: compare_runs(f))

"""Train tab: the schema-generated form, the injector's plan (and memory estimate), Start (queued; each run
trains in its own process), and the runs: live progress, loss and lr charts, previews, log, Stop, Resume.

The live view polls each run's events.jsonl once a second (a gr.Timer); nothing waits on training."""
from __future__ import annotations

import html
import math
import os
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from sdxl_lora.core.config import Config, ConfigError, SAMPLE_DATA, config_class, load_config, preset_value
from sdxl_lora.llm.config import TINY_LLM
from sdxl_lora.sdxl.config import DEMO_NAME, kind_recommendations
from sdxl_lora.core.fsutil import atomic_write_text
from sdxl_lora.core.runs import read_events

from . import config_file, dataset_table
from .folders import Folders, PathRefused, image_folders, jsonl_files, llm_model_choices, model_choices
from .summary import CARD_FIELDS, GOAL_FIELDS, card_choices, card_fill, goal_fill, run_summary
from .text import error_md, md_text
from .form import PATH_FIELDS, default_prompts, model_default_prompts, FieldSpec, build_config, follow_kind, schema_fields, to_widget_value
from .duplicate import form_for, form_values
from .jobs import Jobs, RunStatus, run_status
from .labels import CHOICE_WORDS, DATASET_COLUMNS, GROUPS, LABELS, error_words, label_for


# ----------------------------------------------------------------------------------------- the form

PRESET_FIELDS = ("card", "goal")

def _widget(spec: FieldSpec, elem_prefix: str = "f-", task: str = "sdxl"):
    from typing import get_args

    words = label_for(spec.key, task)
    label, info, value = words.text, words.help or None, to_widget_value(spec, spec.default)
    elem_id = elem_prefix + spec.key.replace(".", "-").replace("_", "-")
    if spec.kind == "choice":
        return gr.Dropdown(list(get_args(spec.base)), value=value, label=label, info=info, elem_id=elem_id)
    if spec.kind == "bool":
        return gr.Checkbox(value=value, label=label, info=info, elem_id=elem_id)
    if spec.kind == "picks":
        (allowed,) = get_args(spec.base)
        choices = [(CHOICE_WORDS.get(v, v), v) for v in get_args(allowed)]  # the tool's name, the config's value
        return gr.CheckboxGroup(choices, value=value, label=label, info=info, elem_id=elem_id)
    if spec.kind in ("int", "float") and spec.optional:
        # An empty number box reads as 0 in the page; a text box can say "none" by being empty.
        return gr.Textbox("" if value is None else str(value), label=label, info=info, elem_id=elem_id,
                          placeholder="none")
    if spec.kind in ("int", "float"):
        return gr.Number(value=value, label=label, info=info, precision=0 if spec.kind == "int" else None,
                         elem_id=elem_id)
    if spec.kind == "lines":
        return gr.Textbox(value=value, label=label, info=info, elem_id=elem_id, lines=4, max_lines=12)
    return gr.Textbox(value=value, label=label, info=info, elem_id=elem_id)


def _slug(group: str) -> str:
    return group.lower().replace(" ", "-")


def _default_data(f: Folders, defaults: list[str], choices: list[str], keep: int) -> list[str]:
    """The schema's default data (data.dirs, llm.data) where the datasets folder holds it, else the first
    `keep` choices."""
    found = []
    for d in defaults:
        try:
            rel = os.path.relpath(f.inside(d, "datasets"), f.datasets)
        except PathRefused:
            continue
        if rel in choices:
            found.append(rel)
    return found or choices[:keep]


class Form:
    """The widgets of the form and the config they make, for a task ("sdxl" or "llm")."""

    def __init__(self, f: Folders, task: str = "sdxl", prefix: str = "f-"):
        self.f, self.task, self.prefix = f, task, prefix
        self.data_key = "data.dirs" if task == "sdxl" else "llm.data"
        # The task is the tab's; the other task's own sections are not shown.
        other = {"sdxl": ("llm.",), "llm": ("data.", "preview.")}.get(task, ())
        # Only the fields that do something for the task (core/config.py: field_tasks).
        self.specs = [s for s in schema_fields(task=task) if s.key not in PATH_FIELDS and s.key != "task"
                      and s.key != self.data_key and not s.key.startswith(other) and task in s.tasks]
        self.widgets: dict[str, gr.components.Component] = {}
        self.table = None  # the per-dataset settings' rows (SDXL): the last of the inputs
        self.table_edits: list = []  # the events of a person's edit of a per-dataset box
        self.followers: list[tuple] = []  # (fn, outputs, concurrency id): what `follow` keeps up to date

    def render(self) -> None:
        """The fields by group (labels.GROUPS): each group's common fields on top under its heading, then one
        folded "More: group" section per group with the rest."""
        f, p, task = self.f, self.prefix, self.task
        if task == "sdxl":
            models, data = model_choices(f.models), image_folders(f.datasets)
            data_value = _default_data(f, config_class("sdxl")().data.dirs, data, 1)
        else:
            models, data = llm_model_choices(f.models), jsonl_files(f.datasets)
            data_value = _default_data(f, config_class("llm")().llm.data, data, 2)
        by_key = {s.key: s for s in self.specs}
        # The fields the page sets itself (picked from its folders) and the schema's, in label order.
        shown = ["model.path", self.data_key, *(["model.tokenizer", "preview.prompts"] if task == "sdxl" else []),
                 *by_key]
        order = {k: i for i, k in enumerate(LABELS)}
        shown.sort(key=lambda k: order.get(k, len(order)))

        def make(key: str) -> None:
            words = label_for(key, task)
            if key in PRESET_FIELDS:
                from typing import get_args

                choices = [(f"no {key} preset", "")] + [(n, n) for n in get_args(by_key[key].base)]
                self.widgets[key] = gr.Dropdown(choices, value="", label=words.text, info=words.help,
                                                elem_id=f"{p}{key}")
            elif key == "model.path":
                self.model = gr.Dropdown(models, value=models[0], allow_custom_value=True, elem_id=f"{p}model-path",
                                         label=words.text, info=words.help)
            elif key == self.data_key:
                self.data_help = words.help
                self.dirs = gr.Dropdown(data, value=data_value, multiselect=True, allow_custom_value=True,
                                        label=words.text, elem_id=f"{p}data",
                                        info=words.help if data else self.no_data())
                if task == "sdxl":
                    self.render_table(data_value)
            elif key == "model.tokenizer":
                self.tokenizer = gr.Textbox("", label=words.text, elem_id=f"{p}model-tokenizer", info=words.help)
            elif key == "preview.prompts":
                # The demo base's prompts (what preview.prompts unset gives it) are shown to edit.
                self.prompts = gr.Textbox(default_prompts(), lines=3, label=words.text, info=words.help,
                                          elem_id=f"{p}prompts")
            else:
                self.widgets[key] = _widget(by_key[key], p, task)

        # The presets first: they fill the fields below (ui/summary.py: card_fill, goal_fill).
        if any(k in by_key for k in PRESET_FIELDS):
            with gr.Row(elem_id=f"{p}presets"):
                for key in PRESET_FIELDS:
                    if key in by_key:
                        make(key)
        shown = [k for k in shown if k not in PRESET_FIELDS]
        for group in GROUPS:
            common = [k for k in shown if label_for(k, task).group == group and label_for(k, task).common]
            if common:
                with gr.Group(elem_id=f"{p}group-{_slug(group)}"):
                    gr.Markdown(f"**{group}**", elem_classes="group-heading")
                    for key in common:
                        make(key)
        for group in GROUPS:
            rest = [k for k in shown if label_for(k, task).group == group and not label_for(k, task).common]
            if rest:
                with gr.Accordion(f"More: {group}", open=False, elem_id=f"{p}acc-{_slug(group)}"):
                    for key in rest:
                        make(key)
        if task != "sdxl":
            self.tokenizer = gr.Textbox("", visible=False)
            self.prompts = gr.Textbox("", visible=False)

    def render_table(self, dirs: list[str]) -> None:
        """The per-dataset settings, folded under the folder picker: what each picked folder sets, and boxes with
        one folder's settings (picked above them) to change. The rows themselves (`table`, one per picked folder,
        following the picker) are the page's state: a box per setting keeps its label whole at any width, and takes
        what is typed as any text box does."""
        p = self.prefix
        words = label_for("data.datasets", self.task)
        rows = dataset_table.follow(dirs, [])
        with gr.Accordion(words.text, open=False, elem_id=f"{p}acc-datasets"):
            gr.Markdown(words.help)
            self.table = gr.State(rows)
            self.table_view = gr.Markdown(dataset_table.describe(rows), elem_id=f"{p}datasets")
            self.ds_folder = gr.Dropdown(list(dirs), value=dirs[0] if dirs else None, label="folder",
                                         info="the picked folder whose settings the boxes below show",
                                         elem_id=f"{p}ds-folder")
            self.ds_cells = []
            values = dataset_table.cells(rows, dirs[0] if dirs else None)
            per_row = 3
            for start in range(0, len(dataset_table.COLUMNS), per_row):
                with gr.Row():
                    for (field, kind), value in zip(dataset_table.COLUMNS[start:start + per_row],
                                                    values[start:start + per_row]):
                        label, eid = DATASET_COLUMNS[field], f"{p}ds-{field.replace('_', '-')}"
                        self.ds_cells.append(gr.Checkbox(value, label=label, elem_id=eid) if kind == "bool" else
                                             gr.Textbox(value, label=label, placeholder="the run's", elem_id=eid))

        def shown(folder, rows):
            return dataset_table.cells(rows, folder)

        def set_cell(index: int, tick: bool):
            def handler(rows, folder, value):
                rows = dataset_table.with_cell(rows, folder, index, value)
                # A tick box shows what was written (a folder's values shown a moment after its click would undo
                # the tick on screen); a text box is left alone, as the person may type on meanwhile.
                return rows, dataset_table.describe(rows), (value if tick else gr.skip())
            return handler

        # One at a time, in the order asked: each edit reads the rows the one before it wrote, and a folder's
        # values are shown before an edit of them is written.
        cid = f"{p}ds-cells"
        self.ds_folder.input(shown, [self.ds_folder, self.table], self.ds_cells, show_progress="hidden",
                             concurrency_id=cid)
        for i, c in enumerate(self.ds_cells):
            tick = isinstance(c, gr.Checkbox)
            events = [c.input] if tick else [c.input, c.blur]
            self.table_edits.append(gr.on(events, set_cell(i, tick), [self.table, self.ds_folder, c],
                                          [self.table, self.table_view, c], trigger_mode="always_last",
                                          show_progress="hidden", concurrency_id=cid))

    def editor(self, dirs, rows, folder):
        """The per-dataset boxes for the picked folders `dirs` and their `rows`: the folder picker (kept on
        `folder` while it is picked), the list of what each sets, the boxes' values."""
        dirs = list(dirs or [])
        folder = folder if folder in dirs else (dirs[0] if dirs else None)
        return (gr.update(choices=dirs, value=folder), dataset_table.describe(rows),
                *dataset_table.cells(rows, folder))

    @property
    def editor_outputs(self) -> list:
        return [self.ds_folder, self.table_view, *self.ds_cells] if self.table is not None else []

    def add_pickers(self, pickers) -> None:
        """The model and data pickers' choices read from the folders again when opened (ui/pickers.py)."""
        f = self.f
        if self.task == "sdxl":
            pickers.add(self.model, lambda: model_choices(f.models))
            pickers.add(self.dirs, lambda: image_folders(f.datasets), self.no_data(), self.data_help)
        else:
            pickers.add(self.model, lambda: llm_model_choices(f.models))
            pickers.add(self.dirs, lambda: jsonl_files(f.datasets), self.no_data(), self.data_help)

    def no_data(self) -> str:
        """The data picker's help while the datasets folder holds nothing it lists: where to put it."""
        what = ("folders of images with their captions" if self.task == "sdxl" else
                ".jsonl files of instructions or chats (one example a line)")
        return (f"Nothing to pick: the datasets folder {self.f.datasets} holds no {what}. Put them there (the Dataset "
                "tab uploads images), or start the UI with --datasets naming the folder that holds them.")

    @property
    def inputs(self) -> list:
        return [self.model, self.dirs, self.tokenizer, self.prompts, *self.widgets.values(),
                *([self.table] if self.table is not None else [])]

    def user_edits(self, widgets: list | None = None) -> list:
        """The events a person's edit of `widgets` (every input by default) fires, and a fill by the page does not.
        gradio's `change` fires for each field a handler sets too, so a listener on it would run once per field
        when the page fills the whole form; `input` is a person's. A Textbox fires `input` for a typed key only
        (not a deletion, a paste or a cut), so its `blur` counts too: such an edit is heard when the person leaves
        the box. A multiselect's typed value fires no `input` either: the tab follows the folder picker by
        `change`."""
        events = []
        for c in self.inputs if widgets is None else widgets:
            if isinstance(c, gr.State):  # the per-dataset rows: their boxes' edits (table_edits) change them
                continue
            events += [c.input, c.blur] if isinstance(c, gr.Textbox) else [c.input]
        return events

    def follow(self, fn, outputs, widgets: list | None = None, on: list = ()) -> str:
        """Keep `outputs` following the form: `fn(*inputs)` on a person's edit of `widgets` (`user_edits`), on the
        events `on` (the page's load), and once after each fill by the page (`after_fill`), in the background.
        Its runs take turns (one concurrency id, returned for other events that write `outputs`), so the line
        shown is from the last values asked for; a burst of edits computes once for the last of them."""
        cid = f"{self.prefix}{fn.__name__}"
        last: dict = {}

        def again(*values):
            # gradio fires a dropdown's `input` two or three times for one pick, and a box's `blur` without an
            # edit: the values of the run before give its output again, not computed twice.
            key = repr(values)
            if last.get("key") != key:
                last.update(key=key, out=fn(*values))
            return last["out"]

        again.__name__ = fn.__name__
        gr.on([*on, *self.user_edits(widgets)], again, self.inputs, outputs, trigger_mode="always_last",
              show_progress="hidden", concurrency_id=cid)
        if widgets is None or any(w is self.table for w in widgets):
            for edit in self.table_edits:  # after a per-dataset box's edit has changed the rows
                edit.then(again, self.inputs, outputs, show_progress="hidden", concurrency_id=cid)
        self.followers.append((again, outputs, cid))
        return cid

    def after_fill(self, event) -> None:
        """Each follower once after `event` (a handler that sets fields of the form: Duplicate, a preset, the
        adapter kind's recommendations) ends, instead of once per field it set."""
        for fn, outputs, cid in self.followers:
            event.then(fn, self.inputs, outputs, show_progress="hidden", concurrency_id=cid)
        if self.table is not None:  # the per-dataset boxes show the rows the fill put in
            event.then(self.editor, [self.dirs, self.table, self.ds_folder], self.editor_outputs,
                       show_progress="hidden")

    def config(self, values: list, name: str | None, prompts_file: Path | None) -> Config:
        """The run's config from the form's values (`inputs` order; without the per-dataset table's, every folder
        takes the run's settings): paths resolved inside the UI's folders, runs in its runs folder, the model
        cache in its models folder."""
        model, dirs, tokenizer, _prompts, *rest = values
        rest, table = rest[:len(self.widgets)], rest[len(self.widgets):]
        if not dirs:
            raise ConfigError(f"{label_for(self.data_key, self.task).text}: pick at least one under the datasets "
                              f"folder {self.f.datasets}")
        embedded = DEMO_NAME if self.task == "sdxl" else TINY_LLM
        paths = [str(self.f.inside(d, "datasets")) for d in dirs]
        datasets = dataset_table.tables(self.f, dirs, table[0]) if table and self.task == "sdxl" else []
        fixed = {
            "model.path": model if model == embedded else str(self.f.inside(model, "models")),
            "model.cache_dir": str(self.f.models),
            **({"data.datasets": datasets} if datasets else {self.data_key: paths}),
            "output.runs_dir": str(self.f.runs),
        }
        if self.task == "sdxl" and not model_default_prompts(_prompts):
            fixed["preview.prompts"] = str(prompts_file) if prompts_file else ""
        # else left unset: the model's own previews (the demo base's prompts, shown in the box; a few of the
        # dataset's captions for any other model)
        if "task" in Config.model_fields:
            fixed["task"] = self.task
        if tokenizer and tokenizer.strip():
            fixed["model.tokenizer"] = str(self.f.inside(tokenizer, "models"))
        if name is not None:
            fixed["output.name"] = name
        return build_config(list(self.widgets_specs()), rest, fixed)

    def widgets_specs(self):
        by_key = {s.key: s for s in self.specs}
        return (by_key[k] for k in self.widgets)

    def name_value(self, values: list) -> str:
        keys = list(self.widgets)
        return (values[4 + keys.index("output.name")] or "") if "output.name" in keys else ""


# ------------------------------------------------------------------------------------------ the plan

def plan_view(cfg: Config):
    """The injector's plan for this config as table rows, and a summary line (with the memory estimate)."""
    import pandas as pd

    from sdxl_lora.sdxl.plan import plan_config

    planned = plan_config(cfg)
    plan, resolution, native = planned.plan, planned.resolution, planned.native
    rows = pd.DataFrame([{**r, "level": "" if r["level"] is None else r["level"],
                          "MB": round(r["params"] * 4 / 2**20, 3)} for r in plan.groups()])
    n = plan.trainable_params
    summary = (f"**{len(plan.targets)} modules, {n:,} trainable parameters, {n * 4 / 2**20:.2f} MB (fp32)**; "
               f"preset {cfg.adapter.preset}, base rank {plan.base_rank} at resolution {resolution} "
               f"(native {native})")
    est = planned.memory
    # Not the summary line's peak: that one is the whole process's in its largest phase (this step, the CUDA
    # context, the encoders and VAE, the previews); two figures on one screen say which is which.
    summary += (f"\n\nEstimated peak of one training step (the UNet, adapter, optimizer and activations; bf16 unless "
                f"set): **{est.total / 2**30:.2f} GiB**. The line above Start gives the whole run's peak, which adds the "
                f"CUDA context, the text encoders and VAE, and the previews.\n\n```\n{est.format()}\n```")
    return rows, summary


# ------------------------------------------------------------------------------------------ the runs

def _progress_html(st) -> str:
    total = st.total or 0
    pct = 100.0 * st.step / total if total else 0.0
    bits = [f"<b>{html.escape(st.name)}</b>", html.escape(st.state)]
    if st.alive and st.phase:  # between steps: what it does now, where the step count stands still
        bits.append(f'<span class="run-phase">{html.escape(st.phase)}</span>')
    if total:
        bits.append(f"step {st.step}/{total}")
    figures = []
    if not math.isnan(st.loss):
        figures.append(f"loss {st.loss:.4f}")
    if st.images_per_s:
        figures.append(f"{st.images_per_s:.2f} img/s")
    if st.tokens_per_s:
        figures.append(f"{st.tokens_per_s:,.0f} tokens/s")
    if figures and st.logged_step and st.logged_step < st.step - 1:
        # Between log points ("Log every N steps") the run's loss is a step late (read without holding the run
        # up), or from the last log point where the run could not read it: older figures say their step.
        figures[-1] += f" (at step {st.logged_step})"
    bits += figures
    if st.alive and st.eta_s is not None:
        bits.append(f"eta {st.eta_s:.0f} s")  # the previews and evaluations still due included (jobs.py)
    if st.gpu_mem_gib is not None:
        bits.append(f"GPU memory {st.gpu_mem_gib:.1f} GiB (peak {st.gpu_peak_gib:.1f})")
    msg = f"<div>{html.escape(st.message)}</div>" if st.message else ""
    return (f'<div id="run-progress" data-state="{html.escape(st.state)}">'
            f'<progress max="100" value="{pct:.1f}" style="width:100%;height:1.2em"></progress>'
            f'<div id="run-progress-text">{" · ".join(bits)}</div>{msg}</div>')


def _charts(events: list[dict]):
    import pandas as pd

    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    train = [(e["step"], e["loss"]) for e in events if e.get("event") == "step" and number(e.get("loss"))]
    loss = [{"step": st, "loss": v, "series": "train"} for st, v in train]
    smooth, avg = [], None
    for st, v in train:  # an exponential moving average: the trend through the noise of single batches
        avg = v if avg is None else SMOOTHING * avg + (1 - SMOOTHING) * v
        smooth.append({"step": st, "loss": avg, "series": "train (smoothed)"})
    loss += smooth if len(train) > 2 else []
    loss += [{"step": e["step"], "loss": e["loss"], "series": e["event"]} for e in events
             if e.get("event") in ("eval", "validation") and number(e.get("loss"))]
    lr = [{"step": e["step"], "lr": e["lr"]} for e in events if e.get("event") == "step" and number(e.get("lr"))]
    # Typed columns, also when empty: an untyped (object) column makes the chart's axis categorical.
    return (pd.DataFrame(loss, columns=["step", "loss", "series"]).astype({"step": "int64", "loss": "float64",
                                                                         "series": "string"}),
            pd.DataFrame(lr, columns=["step", "lr"]).astype({"step": "int64", "lr": "float64"}))


SMOOTHING = 0.8


def _previews(events: list[dict]) -> list[tuple[str, str]]:
    out = []
    for e in events:
        if e.get("event") == "samples":
            for p in e.get("paths", []):
                if p.endswith("-grid.png") and Path(p).is_file():
                    out.append((p, f"step {e.get('step', '?')}"))
    return out[::-1]


def _answers(events: list[dict]) -> str:
    """An LLM run's preview answers (samples/answers-stepN.json), each prompt with its answer at the first and the
    latest step that answered it, for the run view (Markdown; "" for a run without any)."""
    import json

    sets = []
    for e in events:
        if e.get("event") == "samples":
            for p in e.get("paths", []):
                if Path(p).name.startswith("answers-step") and Path(p).with_suffix(".json").is_file():
                    sets.append((e.get("step", 0), Path(p).with_suffix(".json")))
    if not sets:
        return ""
    shown = [sets[0]] + ([sets[-1]] if len(sets) > 1 else [])
    read = []
    for step, path in shown:
        try:
            read.append((step, json.loads(path.read_text(encoding="utf-8"))))
        except (OSError, ValueError):
            continue
    lines = ["**Preview answers**"]
    for i, entry in enumerate(read[0][1] if read else []):
        lines.append(f"**{md_text(entry.get('prompt', ''))}**")
        for step, answers in read:
            answer = answers[i].get("answer", "") if i < len(answers) else ""
            said = md_text(answer.strip()).replace("\n", "<br>") if answer.strip() else "*(an empty answer)*"
            lines.append(f"> step {step}: {said}")
    return "\n\n".join(lines)


def _loss_cell(st) -> str:
    """The Runs table's loss: a recent step's, with its step where it is older than the one before the step now."""
    if math.isnan(st.loss):
        return ""
    old = st.logged_step and st.logged_step < st.step - 1
    return f"{st.loss:.4f}" + (f" (at step {st.logged_step})" if old else "")


def runs_view(jobs: Jobs, selected: str | None, seen_sig, follow: str | None = None) -> tuple:
    """The Runs panel: the table, the run picker, the selected run's progress line, charts, previews and log, and
    the signature of what was drawn (skipped where it has not changed since `seen_sig`). `follow`: the run the page
    was asked to show (Start, Resume), shown whatever the picker sent: a refresh that began before Start answered
    would otherwise put the previous run back in the picker. A person's pick clears it."""
    runs = jobs.runs()
    names = [s.name for s in runs]
    if follow:
        selected = follow
        if follow not in names:  # between its queue entry and its process: about to start
            runs.insert(0, RunStatus(name=follow, dir=jobs.f.runs / follow, state="starting"))
            names.insert(0, follow)
    table = [[s.name, s.state, f"{s.step}/{s.total}" if s.total else "",
              _loss_cell(s)] for s in runs]
    if not selected or selected not in names:
        selected = names[0] if names else None
    st = next((s for s in runs if s.name == selected), None)
    if st is None:
        return table, gr.update(choices=names, value=selected), "", gr.skip(), gr.skip(), gr.skip(), "", None, ""
    ev_path = st.dir / "events.jsonl"
    sig = (selected, ev_path.stat().st_mtime_ns if ev_path.exists() else 0, st.state, tuple(names))
    if sig == seen_sig:
        return (table, gr.skip(), _progress_html(st), gr.skip(), gr.skip(), gr.skip(), gr.skip(), seen_sig, gr.skip())
    events = read_events(ev_path)
    st = run_status(st.dir, events) if st.state not in ("queued", "starting") or events else st
    loss_df, lr_df = _charts(events)
    return (table, gr.update(choices=names, value=selected), _progress_html(st), loss_df, lr_df,
            _previews(events), jobs.log_tail(selected), sig, _answers(events))


def form_config(form: Form, values: list, name: str | None) -> Config:
    """The form's config; for a run (a name), its preview prompts saved under runs/.ui/prompts/."""
    prompts = values[3]
    prompts_file = None
    if model_default_prompts(prompts):
        pass  # the model's own previews: nothing to write (Form.config leaves preview.prompts unset)
    elif name is not None and prompts and prompts.strip():
        prompts_file = form.f.ui / "prompts" / f"{name}.txt"
        atomic_write_text(prompts_file, prompts.strip() + "\n")
    elif name is None and prompts and prompts.strip():
        prompts_file = SAMPLE_DATA / "prompts.txt"  # the plan does not read it; any file will do
    return form.config(values, name, prompts_file)


def duplicate_values(form: Form, jobs: Jobs, name: str) -> tuple[list, str, list[str]]:
    """The form's values (`form.inputs` order) for a copy of run `name`, its per-dataset settings in the table, the
    copy's name, and what the table has no column for (left out of the copy)."""
    values, copy = form_values(form, jobs, name, default_prompts())
    if form.task != "sdxl":
        return values, copy, []
    values[1], rows, left_out = dataset_table.from_config(form.f, load_config(jobs.config_path(name)), values[1])
    return [*values, rows], copy, left_out


def start_run(form: Form, jobs: Jobs, values: list):
    """Start (or queue) a run of the form's config: (message, the runs dropdown's update, the run the Runs panel
    follows: `runs_view`'s follow)."""
    try:
        name = jobs.unique_name(form.name_value(values))
        cfg = form_config(form, values, name)
    except (ConfigError, PathRefused, FileExistsError, ValueError) as e:
        return error_md(error_words(e, form.task)), gr.skip(), gr.skip()
    jobs.enqueue_train(cfg)
    started = jobs.tick()
    busy = jobs.busy()
    where = "started" if started == name else f"queued (after {busy})" if busy else "queued"
    return f"run **{name}** {where}", gr.update(value=name), name


def build(f: Folders, jobs: Jobs, demo: gr.Blocks | None = None, pickers=None):
    form = Form(f)
    with gr.Row():
        with gr.Column(scale=5):
            gr.Markdown("### New run")
            form.render()
            if pickers is not None:
                form.add_pickers(pickers)
            # What the run will train and need, kept up to date as the form changes (ui/summary.py).
            summary_line = gr.Markdown(elem_id="train-summary")
            with gr.Row():
                plan_btn = gr.Button("Show plan", elem_id="train-plan")
                start_btn = gr.Button("Start", variant="primary", elem_id="train-start")
            start_msg = gr.Markdown(elem_id="train-start-msg")
            config_file.build(form, pickers)
            plan_summary = gr.Markdown(elem_id="train-plan-summary")
            plan_table = gr.Dataframe(headers=["part", "level", "block", "kind", "proj", "rank", "alpha", "modules",
                                               "params", "MB"], label="plan (slots, ranks, parameters)",
                                      interactive=False, max_height=600, wrap=True, elem_id="train-plan-table")
        with gr.Column(scale=6):
            gr.Markdown("### Runs")
            runs_table = gr.Dataframe(headers=["run", "state", "step", "loss"], interactive=False, max_height=220,
                                      elem_id="runs-table")
            with gr.Row():
                run_pick = gr.Dropdown([], label="run", allow_custom_value=True, elem_id="run-pick", scale=3)
                stop_btn = gr.Button("Stop", elem_id="run-stop", scale=1)
                resume_btn = gr.Button("Resume", elem_id="run-resume", scale=1)
                duplicate_btn = gr.Button("Duplicate as new run", elem_id="run-duplicate", scale=1)
            with gr.Row():
                # While it trains: previews or a saved state at the step it is at, without stopping it.
                sample_btn = gr.Button("Sample now", size="sm", elem_id="run-sample-now")
                save_btn = gr.Button("Save now", size="sm", elem_id="run-save-now")
            action_msg = gr.Markdown(elem_id="run-action-msg")
            progress = gr.HTML(elem_id="run-progress-box")
            with gr.Row():
                loss_plot = gr.LinePlot(x="step", y="loss", color="series", title="loss", height=320,
                                        x_axis_format="d", elem_id="run-loss", scale=3)
                lr_plot = gr.LinePlot(x="step", y="lr", title="learning rate", height=320, x_axis_format="d",
                                      y_axis_format=".1e", elem_id="run-lr", scale=2)
            previews = gr.Gallery(label="previews (newest first)", columns=3, height=260, object_fit="contain",
                                  elem_id="run-previews")
            answers = gr.Markdown(elem_id="run-answers")  # an LLM run's preview answers
            with gr.Accordion("log", open=False):
                log_box = gr.Textbox(lines=12, max_lines=12, show_label=False, elem_id="run-log")
    seen = gr.State(None)
    follow = gr.State(None)  # the run Start or Resume asked the panel to show (runs_view)
    timer = gr.Timer(1.0)

    def make_config(values, name):
        return form_config(form, values, name)

    def show_plan(*values):
        try:
            rows, summary = plan_view(make_config(list(values), None))
        except (ConfigError, PathRefused, FileNotFoundError, ValueError) as e:
            return gr.skip(), error_md(error_words(e, form.task))
        return rows, summary

    def summarize(*values):
        try:
            return md_text(run_summary(make_config(list(values), None)))
        except (ConfigError, PathRefused, FileNotFoundError, ValueError) as e:
            return error_md(error_words(e, form.task))

    def start(*values):
        return start_run(form, jobs, list(values))

    by_key = {s.key: s for s in form.specs}
    card_keys = [k for k in CARD_FIELDS if k in form.widgets]
    goal_keys = [k for k in GOAL_FIELDS if k in form.widgets]

    def shown(key: str, value):
        spec = by_key[key]
        if spec.optional and spec.kind in ("int", "float"):
            return "" if value is None else str(value)
        return to_widget_value(spec, value)

    def fill(fill_fn, keys):
        def handler(name, *values):
            try:
                filled = fill_fn(make_config(list(values), None), name or "")
            except (ConfigError, PathRefused, FileNotFoundError, ValueError):
                return [gr.skip()] * len(keys)  # the summary line says why
            return [shown(k, filled[k]) for k in keys]
        return handler

    def card_labels(*values):
        try:
            return gr.update(choices=card_choices(make_config(list(values), None)))
        except (ConfigError, PathRefused, FileNotFoundError, ValueError):
            return gr.skip()

    def stop(selected):
        try:
            return f"{jobs.stop(selected)}"
        except (ValueError, PathRefused) as e:
            return error_md(e)

    def ask(what: str):
        def handler(selected):
            try:
                return jobs.ask(selected, what)
            except (ValueError, PathRefused, FileNotFoundError) as e:
                return error_md(e)
        return handler

    def resume(selected):
        try:
            jobs.enqueue_resume(selected)
        except (ValueError, PathRefused, FileNotFoundError) as e:
            return error_md(e), gr.skip()
        started = jobs.tick()
        return (f"{selected}: resuming" if started == selected else f"{selected}: queued to resume"), selected

    load = [demo.load] if demo is not None else []
    # Not blocking: the line follows the form. The fields whose handlers fill others (the presets, the adapter
    # kind) update it after their fill, and the folder picker with the per-dataset table (below).
    own = [form.dirs, *(form.widgets[k] for k in ("card", "goal", "adapter.kind") if k in form.widgets)]
    summary_id = form.follow(summarize, summary_line, [c for c in form.inputs if all(c is not o for o in own)],
                             on=load)
    plan_btn.click(show_plan, form.inputs, [plan_table, plan_summary])
    plan_btn.click(summarize, form.inputs, summary_line, show_progress="hidden", concurrency_id=summary_id)
    start_btn.click(start, form.inputs, [start_msg, run_pick, follow])

    def follow_folders(*values):
        # The rows follow the picked folders (a person's pick, or a folder typed in, which fires no `input`), and
        # the line with them. A table that already holds the picked folders' rows was set with the picker
        # (Duplicate), whose follow-up computes the line: nothing to do.
        dirs, table, folder = values[1], values[-2], values[-1]
        if dataset_table.holds(dirs, table):
            return gr.skip(), gr.skip(), *(gr.skip() for _ in form.editor_outputs)
        rows = dataset_table.follow(dirs, table)
        return rows, summarize(*values[:-2], rows), *form.editor(dirs, rows, folder)

    if form.table is not None:
        form.dirs.change(follow_folders, [*form.inputs, form.ds_folder],
                         [form.table, summary_line, *form.editor_outputs], trigger_mode="always_last",
                         show_progress="hidden", concurrency_id=summary_id)
    if "card" in form.widgets:
        card, goal = form.widgets["card"], form.widgets["goal"]
        # Each card's memory and time for the form's model, adapter, batch and resolution.
        sizing = [form.widgets[k] for k in ("data.resolution", "train.batch_size", "train.grad_accum",
                                            "adapter.rank", "adapter.preset") if k in form.widgets]
        form.follow(card_labels, card, [form.model, *sizing], on=load)
        form.after_fill(card.input(fill(card_fill, card_keys), [card, *form.inputs],
                                   [form.widgets[k] for k in card_keys]))
        form.after_fill(goal.input(fill(goal_fill, goal_keys), [goal, *form.inputs],
                                   [form.widgets[k] for k in goal_keys]))
    if "adapter.kind" in form.widgets:
        # A model may recommend settings per adapter kind (LoHa's learning rate on the demo base): picking a
        # kind fills them, where the field still holds a recommended value.
        followers = [k for k in form.widgets if k != "adapter.kind"]

        def on_kind(kind, *values):
            try:
                cfg = make_config(list(values), None)
                recs = kind_recommendations(cfg.model.path)
            except (ConfigError, PathRefused, FileNotFoundError, ValueError):
                return [gr.skip()] * len(followers)
            tree = cfg.model_dump()
            filled = follow_kind(recs, kind, {k: preset_value(tree, k) for k in recs.get(kind, {})})
            return [shown(k, filled[k]) if k in filled else gr.skip() for k in followers]

        # always_last: a kind picked while the last pick's values are still being filled is applied after it
        # (gradio's default drops a trigger while its listener's event is pending).
        form.after_fill(form.widgets["adapter.kind"].input(
            on_kind, [form.widgets["adapter.kind"], *form.inputs], [form.widgets[k] for k in followers],
            trigger_mode="always_last"))
    outputs = [runs_table, run_pick, progress, loss_plot, lr_plot, previews, log_box, seen, answers]
    timer.tick(lambda sel, sig, run: runs_view(jobs, sel, sig, run), [run_pick, seen, follow], outputs,
               show_progress="hidden")
    # A person's pick: that run, and the panel no longer follows the one Start showed.
    run_pick.input(lambda sel: (*runs_view(jobs, sel, None), None), run_pick, [*outputs, follow])
    stop_btn.click(stop, run_pick, action_msg)
    sample_btn.click(ask("sample"), run_pick, action_msg)
    save_btn.click(ask("save"), run_pick, action_msg)
    resume_btn.click(resume, run_pick, [action_msg, follow])
    return Runs(FormTab(form, "train", start_msg), run_pick, duplicate_btn, action_msg, follow)


@dataclass
class FormTab:
    """A tab with a New run form: the tab's id in the page's gr.Tabs, and the message line under the form."""
    form: Form
    tab: str
    message: gr.Markdown


@dataclass
class Runs:
    """What the page wires across tabs: the Train tab's form, the runs picker, Duplicate and its message line, and
    the run the Runs panel follows (a Start on another tab sets it)."""
    form_tab: FormTab
    pick: gr.Dropdown
    duplicate: gr.Button
    message: gr.Markdown
    follow: gr.State


def duplicated(jobs: Jobs, form_tabs: list[FormTab], selected: str) -> list:
    """Duplicate as new run on run `selected`: its config into the form of its task (one of `form_tabs`), that tab
    shown, the message beside the runs and under that form; the outputs in `wire_duplicate`'s order."""
    rest = 1 + len(form_tabs) + sum(len(t.form.inputs) for t in form_tabs)
    try:
        target = form_for({t.form.task: t for t in form_tabs}, jobs, selected)
        values, copy, left_out = duplicate_values(target.form, jobs, selected)
    except (ValueError, PathRefused, FileNotFoundError) as e:
        return [error_md(e), *(gr.skip() for _ in range(rest))]
    where = "New run form" if target.form.task == "sdxl" else f"{target.form.task.upper()} tab's form"
    note = f"; not in the form, so not copied: {md_text('; '.join(left_out))}" if left_out else ""
    msg = f"the {where} holds a copy of **{md_text(selected)}** as **{md_text(copy)}**; change what you like and " \
          f"press Start{note}"
    out = [msg, gr.Tabs(selected=target.tab), *(msg if t is target else gr.skip() for t in form_tabs)]
    for t in form_tabs:
        out += values if t is target else [gr.skip() for _ in t.form.inputs]
    return out


def wire_duplicate(runs: Runs, jobs: Jobs, tabs: gr.Tabs, form_tabs: list[FormTab]) -> None:
    outputs = [runs.message, tabs, *(t.message for t in form_tabs), *(c for t in form_tabs for c in t.form.inputs)]
    filled = runs.duplicate.click(lambda selected: duplicated(jobs, form_tabs, selected), runs.pick, outputs)
    for t in form_tabs:
        t.form.after_fill(filled)

"""The Train tab's Runs panel and the page's pickers, without a browser: after Start the panel shows the new run
whatever run the picker sent (a refresh begun before Start answered), until the person picks another; a folder or
model made after the page was built is in the pickers' choices when they are read again."""
from __future__ import annotations

import shutil
from pathlib import Path

import gradio as gr

from sdxl_lora.core.runs import Run
from sdxl_lora.ui.folders import Folders
from sdxl_lora.ui.jobs import Jobs

REPO = Path(__file__).resolve().parents[2]


def _folders(tmp_path) -> Folders:
    d = tmp_path / "datasets" / "shapes"
    d.mkdir(parents=True)
    shutil.copy(sorted((REPO / "sample_data" / "images").glob("*.png"))[0], d)
    return Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path / "runs")


def test_after_start_the_runs_panel_shows_the_new_run_until_another_is_picked(tmp_path):
    from sdxl_lora.ui.form import to_widget_value
    from sdxl_lora.ui.tab_train import Form, runs_view, start_run

    f = _folders(tmp_path)
    old = Run(f.runs / "old")
    old.dir.mkdir()
    (old.dir / "config.toml").write_text("")
    old.event("start", step=0, total_steps=4)
    old.event("done", step=4, state="finished")
    fake = tmp_path / "python"  # the queue's interpreter: the new run's process lives a while, trains nothing
    fake.write_text("#!/bin/sh\nsleep 5\n")
    fake.chmod(0o755)
    jobs = Jobs(f, python=str(fake))
    with gr.Blocks():
        form = Form(f)
        form.render()
    values = ["tiny-sdxl-demo", ["shapes"], "", "",
              *("new" if s.key == "output.name" else to_widget_value(s, s.default) for s in form.widgets_specs()), []]
    msg, pick, follow = start_run(form, jobs, values)
    assert msg == "run **new** started" and follow == "new"
    # A refresh that read the picker before Start answered still sends "old": the panel shows the new run.
    _, picker, progress, *_ = runs_view(jobs, "old", None, follow)
    assert picker["value"] == "new" and "<b>new</b>" in progress and "old" in picker["choices"]
    # The person picks the old run: it is shown (the page clears follow on a pick).
    _, picker, progress, *_ = runs_view(jobs, "old", None, None)
    assert picker["value"] == "old" and "<b>old</b>" in progress


def test_pickers_offer_what_appeared_after_the_page_was_built(tmp_path):
    from sdxl_lora.ui.pickers import Pickers
    from sdxl_lora.ui.tab_train import Form

    f = _folders(tmp_path)
    pickers = Pickers()
    with gr.Blocks():
        form = Form(f)
        form.render()
        form.add_pickers(pickers)
    assert form.dirs.choices == [("shapes", "shapes")]
    new = f.datasets / "uploaded"
    new.mkdir()
    shutil.copy(next((f.datasets / "shapes").glob("*.png")), new)
    (f.models / "mine.safetensors").write_bytes(b"")
    again, outputs = pickers.refresh()
    updates = dict(zip((id(o) for o in outputs), again()))
    assert "uploaded" in updates[id(form.dirs)]["choices"]
    assert "mine.safetensors" in updates[id(form.model)]["choices"]

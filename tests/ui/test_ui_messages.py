"""The page's messages in its own words, without a browser: a wrong value on the Train or LLM form is named by the
label the person sees and says what it must be (no schema key, no pydantic phrase), and a writer's refusal names
the page's boxes instead of the CLI's flag."""
from __future__ import annotations

import re
from pathlib import Path

import gradio as gr
import pytest

from sdxl_lora.ui.folders import Folders
from sdxl_lora.ui.jobs import Jobs
from sdxl_lora.ui.tab_train import Form, start_run

REPO = Path(__file__).resolve().parents[2]
# What the page must not show: a config key (train.steps, data.dirs), pydantic's wording, a CLI flag.
SCHEMA = re.compile(r"\b(model|data|adapter|train|preview|output|llm)\.[a-z_]+|Input should|--[a-z]")


@pytest.fixture
def folders(tmp_path) -> Folders:
    return Folders.create(REPO / "sample_data", tmp_path / "models", tmp_path / "runs")


def _form(f: Folders, task: str) -> Form:
    with gr.Blocks():
        form = Form(f, task=task, prefix="f-" if task == "sdxl" else "llm-")
        form.render()
    return form


def _values(form: Form, data: list[str], **changed) -> list:
    """The form's values as the page sends them at its defaults, with `changed` (dotted keys as a_b__c) typed in."""
    from sdxl_lora.ui.form import to_widget_value

    typed = {k.replace("__", "."): v for k, v in changed.items()}
    widgets = [typed.get(s.key, to_widget_value(s, s.default)) for s in form.widgets_specs()]
    return ["tiny-sdxl-demo" if form.task == "sdxl" else "tiny-llm", data, "", "", *widgets,
            *([[]] if form.table is not None else [])]


def _start(form: Form, values: list) -> str:
    msg, *_ = start_run(form, Jobs(form.f), values)
    assert msg.startswith("**Error:**"), msg
    return msg


def test_a_wrong_value_on_the_form_is_named_by_its_label_with_what_it_must_be(folders):
    form = _form(folders, "sdxl")
    for changed, said in (({"train__steps": -5}, "'Training steps' must be at least 1, not -5"),
                          ({"train__lr": "fast"}, "'Learning rate' must be a number, not 'fast'"),
                          ({"train__steps": 2.5}, "'Training steps' must be a whole number, not 2.5"),
                          ({"adapter__overrides": '{"*attn2*" = -1}'},
                           "'Per-layer ranks' entry '\\*attn2\\*' must be at least 0, not -1")):
        msg = _start(form, _values(form, ["images"], **changed))
        assert said in msg and not SCHEMA.search(msg), msg
    msg = _start(form, _values(form, []))
    assert "Image folders: pick at least one" in msg and not SCHEMA.search(msg), msg
    assert not (folders.runs / ".ui" / "queue").exists() or not list((folders.runs / ".ui" / "queue").iterdir())


def test_the_llm_form_names_its_own_labels(folders):
    form = _form(folders, "llm")
    msg = _start(form, _values(form, []))
    assert "Training files: pick at least one" in msg and not SCHEMA.search(msg), msg
    msg = _start(form, _values(form, ["instructions.jsonl"], train__batch_size=0))
    assert "'Batch size' must be at least 1, not 0" in msg and not SCHEMA.search(msg), msg
    from sdxl_lora.ui.labels import label_for

    assert "image" not in label_for("train.lr", "llm").help  # an LLM learns from text


def test_messages_from_the_config_and_the_writers_say_the_pages_words(tmp_path):
    from sdxl_lora.core.fsutil import check_destination
    from sdxl_lora.ui.labels import page_words
    from sdxl_lora.ui.text import writer_words

    assert page_words("lora_matmul='concat' needs the fused projections: set train.fuse_qkv=true, or "
                      "train.lora_matmul='peft'") == ("lora_matmul='concat' needs the fused projections: tick 'Fuse "
                                                      "attention projections', or 'Adapter matmul' = peft")
    out = tmp_path / "a.safetensors"
    out.write_bytes(b"x")
    with pytest.raises(FileExistsError) as e:
        check_destination(out, False)
    said = writer_words(e.value, "title", "overwrite an existing export")
    assert said.endswith("already exists; type another title, or tick 'overwrite an existing export'"), said
    assert "--overwrite" not in said and "overwrite=True" not in said


def test_the_doctor_tells_a_prior_set_from_missing_trigger_words_and_claims_nothing_of_no_captions(tmp_path):
    import shutil

    from sdxl_lora.ui import tab_dataset

    f = Folders.create(REPO / "sample_data", tmp_path / "models", tmp_path / "runs")
    quiet = lambda *a, **k: None  # noqa: E731
    held = sum("sks" in p.read_text() for p in (REPO / "sample_data" / "images").glob("*.txt"))
    doctor = tab_dataset._scan(f, "images", ".txt", 64, quiet, "sks")[5]
    # The bundled set's untagged shapes are its prior set: the doctor names that way on, not only "add the word".
    assert f"caption(s) lack the trigger word 'sks', which {held} hold" in doctor
    assert "a prior set" in doctor and "leave their captions" in doctor
    bare = tmp_path / "datasets" / "bare"
    bare.mkdir(parents=True)
    for img in sorted((REPO / "sample_data" / "images").glob("*.png"))[:2]:
        shutil.copy(img, bare)
    f = Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path / "runs")
    doctor = tab_dataset._scan(f, "bare", ".txt", 64, quiet, "sks")[5]
    assert "No image has a caption yet" in doctor and "Every caption holds" not in doctor


def test_the_llm_tab_takes_prompts_one_a_line_shows_answers_and_says_where_its_files_go(tmp_path):
    import json as _json

    from sdxl_lora.core.runs import Run
    from sdxl_lora.llm.preview import write_answers
    from sdxl_lora.ui.tab_train import _answers

    (tmp_path / "datasets" / "images").mkdir(parents=True)  # image folders only: no .jsonl for the LLM form
    f = Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path / "runs")
    form = _form(f, "llm")
    assert "no .jsonl files" in form.dirs.info and "--datasets" in form.dirs.info
    prompts = form.widgets["llm.preview_prompts"]
    assert "\n" in prompts.value and not prompts.value.startswith("[")  # one question a line, not a TOML list
    cfg = form.config(["tiny-llm", ["x.jsonl"], "", "", *(w.value for w in form.widgets.values())], "n", None)
    assert cfg.llm.preview_prompts == prompts.value.splitlines()
    # The run view shows each question with its answers before and after; an empty answer says so.
    run = Run(tmp_path / "runs" / "llm")
    run.samples_dir.mkdir(parents=True)
    paths = [write_answers(run.samples_dir, s, ["Name a colour.", "Count to three."], a)
             for s, a in ((0, ["blue", ""]), (40, ["red", "one two\nthree"]))]
    events = [{"event": "samples", "step": s, "paths": [str(p)]} for s, p in zip((0, 40), paths)]
    shown = _answers(events)
    assert "**Name a colour.**" in shown and "> step 0: blue" in shown and "> step 40: red" in shown
    assert "> step 0: *(an empty answer)*" in shown and "one two<br>three" in shown
    assert _answers([{"event": "samples", "step": 0, "paths": ["x-grid.png"]}]) == ""
    assert _json.loads(paths[0].with_suffix(".json").read_text())[1]["answer"] == ""

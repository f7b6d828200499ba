"""The Train form's per-dataset settings, without a browser: the config the form makes from its folder picker and
its table (one row per picked folder), what Duplicate puts back in them, and the summary line's count."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from PIL import Image

from sdxl_lora.core.config import ConfigError, load_config
from sdxl_lora.ui import dataset_table
from sdxl_lora.ui.folders import Folders
from sdxl_lora.ui.jobs import Jobs
from sdxl_lora.ui.tab_train import Form, duplicate_values, start_run


@pytest.fixture
def form(tmp_path) -> Form:
    for d in ("ohwx", "man_class"):
        (tmp_path / "datasets" / d).mkdir(parents=True)
        Image.new("RGB", (64, 64), "white").save(tmp_path / "datasets" / d / "0.png")
    return Form(Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path / "runs"))


def _values(dirs: list[str], rows=None) -> list:
    """The form's values as the page sends them: the model, the picked folders, no tokenizer, no prompts (the
    fields of an unrendered form are none), and the table (absent: the page before it had one)."""
    return ["tiny-sdxl-demo", dirs, "", "", *([rows] if rows is not None else [])]


def test_one_folder_left_as_it_is_trains_on_data_dirs_as_before(form):
    rows = dataset_table.follow(["ohwx"], [])  # the table as the page starts it
    cfg = form.config(_values(["ohwx"], rows), "n", None)
    assert cfg == form.config(_values(["ohwx"]), "n", None)
    assert cfg.data.dirs == [str(form.f.datasets / "ohwx")] and cfg.data.datasets == []


def test_rows_follow_the_folder_picker_and_keep_what_was_typed(form):
    rows = dataset_table.follow(["ohwx"], [])
    rows[0][1] = "3"
    rows = dataset_table.follow(["man_class", "ohwx"], rows)
    assert rows == [dataset_table.blank("man_class"), ["ohwx", "3", *dataset_table.blank("")[2:]]]
    assert dataset_table.follow(["man_class"], rows) == [dataset_table.blank("man_class")]
    # A row as an older page sent it (fewer columns) reads as the rest left empty.
    assert dataset_table.follow(["ohwx"], [["ohwx", "3"]]) == [["ohwx", "3", *dataset_table.blank("")[2:]]]


def _row(folder: str, **cells) -> list:
    """A table row setting `cells` (by DatasetConfig field), the rest empty."""
    row = dataset_table.blank(folder)
    for field, value in cells.items():
        row[1 + dataset_table.FIELDS.index(field)] = value
    return row


def test_repeats_and_a_regularization_set_make_one_table_per_folder_with_only_what_differs(form, tmp_path):
    from sdxl_lora.sdxl.data import dataset_specs

    rows = [_row("ohwx", repeats="3", tag_dropout="0.2", keep_tokens="1"),
            _row("man_class", is_regularization=True, caption_dropout="0.1", caption_extension=".class")]
    cfg = form.config(_values(["ohwx", "man_class"], rows), "n", None)
    tables = [d.model_dump(exclude_defaults=True) for d in cfg.data.datasets]
    assert tables == [{"path": str(form.f.datasets / "ohwx"), "repeats": 3, "keep_tokens": 1, "tag_dropout": 0.2},
                      {"path": str(form.f.datasets / "man_class"), "is_regularization": True,
                       "caption_extension": ".class", "caption_dropout": 0.1}]
    assert all(Path(d.path).parent == form.f.datasets for d in cfg.data.datasets)
    # What the queue runs holds the same tables, and training reads them as the rows said.
    jobs = Jobs(form.f)
    jobs.busy = lambda: "another-run"
    jobs.enqueue_train(cfg)
    queued = load_config(jobs.config_path("n"))
    assert queued.data.datasets == cfg.data.datasets
    specs = dataset_specs(queued.data, 64)
    assert [(s.name, s.repeats, s.is_reg) for s in specs] == [("ohwx", 3, False), ("man_class", None, True)]


@pytest.mark.parametrize("row, said", [
    (_row("ohwx", repeats="0"), "folder 'ohwx', repeats = 0: must be at least 1"),
    (_row("ohwx", resolution="big"), "folder 'ohwx', resolution = 'big': not a number"),
    (_row("ohwx", repeats="1.5"), "folder 'ohwx', repeats = '1.5': must be a whole number"),
    (_row("ohwx", caption_dropout="2"), "folder 'ohwx', empty-caption share = 2.0: must be between 0 and 1"),
    (_row("ohwx", tag_dropout="-1"), "folder 'ohwx', tag dropout = -1.0: must be between 0 and 1"),
    (_row("ohwx", keep_tokens="-1"), "folder 'ohwx', kept leading tags = -1: must be at least 0"),
    (_row("man_class", is_regularization=True, trigger_word="sks"),
     "folder 'man_class', trigger word = 'sks': a regularization set never gets the trigger word"),
])
def test_a_bad_cell_is_refused_naming_its_folder_and_column(form, row, said):
    other = dataset_table.blank("man_class" if row[0] == "ohwx" else "ohwx")
    with pytest.raises(ConfigError, match=re.escape(f"Per-dataset settings, {said}")):
        form.config(_values(["ohwx", "man_class"], [row, other]), "n", None)


def test_start_shows_the_error_and_queues_nothing(form):
    jobs = Jobs(form.f)
    msg, *_ = start_run(form, jobs, _values(["man_class"], [_row("man_class", is_regularization=True)]))
    assert msg.startswith("**Error:** Per-dataset settings: every folder is ticked as regularization")
    assert jobs.queued() == []


def test_duplicate_puts_a_runs_datasets_back_in_the_table(form):
    # A run started from a config with [[data.datasets]] tables (one the table has no column for).
    jobs = Jobs(form.f)
    jobs.busy = lambda: "another-run"
    ds = form.f.datasets
    cfg = load_config(None, None, {"output.name": "cli-run", "output.runs_dir": str(form.f.runs), "data.datasets": [
        {"path": str(ds / "ohwx"), "repeats": 3, "trigger_word": "ohwx", "resolution": 768},
        {"path": str(ds / "man_class"), "is_regularization": True, "caption_extension": ".class",
         "shuffle_tags": True}]})
    jobs.enqueue_train(cfg)
    values, copy, left_out = duplicate_values(form, jobs, "cli-run")
    assert copy == "cli-run-2" and values[1] == ["ohwx", "man_class"]
    assert values[-1] == [_row("ohwx", repeats="3", trigger_word="ohwx", resolution="768"),
                          _row("man_class", is_regularization=True, caption_extension=".class")]
    assert left_out == ["man_class: shuffle_tags"]
    again = form.config(values, copy, None).data.datasets
    assert [d.model_dump(exclude_defaults=True) for d in again] == [
        {"path": str(ds / "ohwx"), "repeats": 3, "trigger_word": "ohwx", "resolution": 768},
        {"path": str(ds / "man_class"), "is_regularization": True, "caption_extension": ".class"}]


def test_the_summary_line_counts_several_datasets_and_the_regularization_ones(form):
    from sdxl_lora.ui.summary import run_summary

    rows = [_row("ohwx", repeats="3"), _row("man_class", is_regularization=True)]
    assert run_summary(form.config(_values(["ohwx", "man_class"], rows), None, None)).endswith(
        "; 2 datasets (1 regularization)")
    assert "datasets" not in run_summary(form.config(_values(["ohwx"]), None, None))

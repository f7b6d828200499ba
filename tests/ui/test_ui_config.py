"""The New run form's config file and command line, without a browser: the form saved as a TOML config loads back
into the same form, the file trains what Start would, and the command shown makes the same config through the
CLI's own parser; a config of the other task is refused naming the tab to load it in."""
from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import gradio as gr
import pytest

from sdxl_lora.ui import config_file, dataset_table
from sdxl_lora.ui.folders import Folders
from sdxl_lora.ui.form import to_widget_value
from sdxl_lora.ui.tab_train import Form

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def folders(tmp_path) -> Folders:
    for name in ("ohwx", "class"):
        d = tmp_path / "datasets" / name
        d.mkdir(parents=True)
        shutil.copy(sorted((REPO / "sample_data" / "images").glob("*.png"))[0], d)
    shutil.copytree(REPO / "sample_data" / "llm", tmp_path / "datasets" / "llm")
    return Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path / "runs")


def _form(f: Folders, task: str = "sdxl") -> Form:
    with gr.Blocks():
        form = Form(f, task=task, prefix="f-" if task == "sdxl" else "llm-")
        form.render()
    return form


def _values(form: Form, data: list[str], rows=None, prompts: str = "", **typed) -> list:
    changed = {"card": "", "goal": "", **{k.replace("__", "."): v for k, v in typed.items()}}  # as the page has them
    widgets = [changed.get(s.key, to_widget_value(s, s.default)) for s in form.widgets_specs()]
    model = "tiny-sdxl-demo" if form.task == "sdxl" else "tiny-llm"
    return [model, data, "", prompts, *widgets, *([rows] if form.task == "sdxl" else [])]


def _cli_config(line: str):
    """The config the shown command line makes, through the CLI's own parser."""
    from sdxl_lora import cli
    from sdxl_lora.commands.common import config_from_args
    from sdxl_lora.commands.llm import llm_config_from_args

    argv = shlex.split(line.split("\n#")[0].replace("\\\n", " "))
    assert argv[0] == "sdxl-lora"
    args = cli.build_parser().parse_args(argv[1:])
    return llm_config_from_args(args) if argv[1] == "llm" else config_from_args(args)


def test_the_form_saved_loads_back_the_same_and_its_command_makes_the_same_config(folders):
    form = _form(folders)
    rows = [dataset_table.blank("ohwx"), dataset_table.blank("class")]
    rows[0][1], rows[1][3] = "3", True  # repeats 3; the class folder is regularization
    values = _values(form, ["ohwx", "class"], rows, "a red star --d 1\na blue circle", train__steps=40,
                     adapter__rank=4, train__lr=0.001, data__resolution=64, output__name="mine")
    path, train = config_file.save(form, values, None)
    assert path == folders.ui / "saved" / "mine.toml" and train == f"sdxl-lora train {path}"
    want = config_file.form_file_config(form, values, "mine")
    loaded, name, left_out = config_file.load(form, path)
    assert name == "mine" and left_out == []
    assert loaded == values  # every field as it was, the table's rows and the prompts included
    from sdxl_lora.core.config import load_config

    assert load_config(path).model_dump() == want.model_dump()  # the file trains what the form holds
    line = config_file.command(form, values)
    assert "--set train.steps=40" in line and "--set adapter.rank=4" in line
    assert _cli_config(line).model_dump() == want.model_dump()
    # A form left at its defaults: the command names the model and the page's folders, and still agrees.
    plain = _values(form, ["ohwx"], [dataset_table.blank("ohwx")])
    line = config_file.command(form, plain)
    assert "train.steps" not in line
    assert _cli_config(line).model_dump() == config_file.form_file_config(form, plain, "config").model_dump()


def test_the_llm_form_saves_loads_and_shows_its_own_command_and_refuses_an_sdxl_config(folders):
    form = _form(folders, "llm")
    values = _values(form, ["llm/alpaca.jsonl"], train__steps=7, output__name="chat")
    path, train = config_file.save(form, values, "my-llm")
    assert train.startswith("sdxl-lora llm train ") and path.name == "my-llm.toml"
    loaded, name, _ = config_file.load(form, path)
    assert loaded == values and name == "chat"
    line = config_file.command(form, values)
    assert line.startswith("sdxl-lora llm train")
    assert _cli_config(line).model_dump() == config_file.form_file_config(form, values, "chat").model_dump()
    sdxl = _form(folders)
    sdxl_path, _ = config_file.save(sdxl, _values(sdxl, ["ohwx"], [dataset_table.blank("ohwx")]), "pic")
    with pytest.raises(ValueError, match="pic.toml is an SDXL config .* load it in the Train tab"):
        config_file.load(form, sdxl_path)
    assert config_file.saved_choices(folders) == ["my-llm.toml", "pic.toml"]


def test_the_prompts_box_as_first_shown_means_the_models_own_previews(folders):
    # The box starts with the demo base's prompts; left so, a run of another model previews a few of its captions
    # (preview.prompts unset) instead of the demo's shapes. Edited or emptied, it is the person's.
    from sdxl_lora.ui.form import default_prompts
    from sdxl_lora.ui.tab_train import form_config

    form = _form(folders)
    shown = default_prompts()
    for model in ("tiny-sdxl-demo", "mine.safetensors"):
        values = _values(form, ["ohwx"], [dataset_table.blank("ohwx")], shown)
        values[0] = model
        assert form_config(form, values, "n").preview.prompts is None
    edited = _values(form, ["ohwx"], [dataset_table.blank("ohwx")], "a blue circle")
    assert Path(form_config(form, edited, "n2").preview.prompts).read_text() == "a blue circle\n"
    assert form_config(form, _values(form, ["ohwx"], [dataset_table.blank("ohwx")], ""), "n3").preview.prompts == ""


def test_the_dashboards_are_tick_boxes_that_round_trip_through_a_saved_config(folders):
    # train.trackers is some of a fixed set: a tick box for each value the schema allows, none ticked by default; what
    # is ticked is in the saved file, loads back ticked, and the command line makes the same.
    from typing import get_args

    from sdxl_lora.core.config import Config, load_config

    form = _form(folders)
    box = form.widgets["train.trackers"]
    allowed = get_args(get_args(Config.model_fields["train"].annotation.model_fields["trackers"].annotation)[0])
    assert isinstance(box, gr.CheckboxGroup) and box.label == "Dashboards"
    assert [value for _, value in box.choices] == list(allowed) == ["tensorboard", "wandb"] and box.value == []
    assert [word for word, _ in box.choices] == ["TensorBoard", "Weights & Biases (offline)"]  # the tools' names
    values = _values(form, ["ohwx"], [dataset_table.blank("ohwx")], train__trackers=["wandb", "tensorboard"],
                     output__name="dash")
    path, _ = config_file.save(form, values, None)
    assert load_config(path).train.trackers == ["wandb", "tensorboard"]
    loaded, _, _ = config_file.load(form, path)
    assert loaded[4 + list(form.widgets).index("train.trackers")] == ["wandb", "tensorboard"]
    line = config_file.command(form, values)
    assert _cli_config(line).train.trackers == ["wandb", "tensorboard"]
    plain = _values(form, ["ohwx"], [dataset_table.blank("ohwx")], output__name="none")
    assert config_file.form_file_config(form, plain, "none").train.trackers == []

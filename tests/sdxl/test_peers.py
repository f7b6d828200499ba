"""What users of kohya, OneTrainer and SimpleTuner reach for (issue 72): training in epochs counted as kohya
counts them, schedule-free AdamW and CAME resuming bit for bit, W&B and TensorBoard trackers, and the WD14
tagger on a tiny ONNX model of the published interface (CPU, tiny model)."""
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from sdxl_lora.core.config import SAMPLE_DATA
from sdxl_lora.core.runs import read_events

QUIET = ["--set", "preview.prompts=''", "--set", "train.log_every=1", "--set", "train.save_every_minutes=0"]


def adapter(run_dir: Path) -> dict:
    return load_file(run_dir / f"{run_dir.name}.safetensors")


def assert_same(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def steps_of(run_dir: Path) -> list[int]:
    return [e["step"] for e in read_events(run_dir / "events.jsonl") if e["event"] == "step"]


@pytest.fixture(scope="module")
def repeated(tmp_path_factory) -> Path:
    """Three sample images in a kohya folder of two repeats: six samples an epoch."""
    root = tmp_path_factory.mktemp("data")
    folder = root / "2_star"
    folder.mkdir()
    for p in sorted((SAMPLE_DATA / "images").glob("*.png"))[:3]:
        shutil.copy(p, folder / p.name)
        shutil.copy(p.with_suffix(".txt"), folder / p.with_suffix(".txt").name)
    return folder


def test_epochs_train_as_many_steps_as_kohya_counts_and_the_same_adapter_as_those_steps(
        tmp_path, cli, cache_args, repeated):
    # 3 images x 2 repeats = 6 samples; batches of 2 give 3 batches an epoch; grad_accum 2 makes that 2 steps
    # (kohya: ceil(3 / 2)); 2 epochs are 4 steps, a state saved and previews due at each epoch's end.
    common = ["--data", str(repeated), "--batch-size", "2", "--set", "train.grad_accum=2", *QUIET, *cache_args]
    p = cli("train", "--out", str(tmp_path), "--name", "epochs", "--epochs", "2",
            "--set", "train.save_every_epochs=1", "--set", "train.save_every=1", *common)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "2 steps an epoch (3 batches of 2, grad_accum 2): 4 steps" in p.stderr
    run = tmp_path / "epochs"
    assert steps_of(run) == [1, 2, 3, 4]
    saved = [e["step"] for e in read_events(run / "events.jsonl") if e["event"] == "checkpoint"]
    assert saved == [2]  # every epoch, not every step (save_every); the last step's state is the adapter itself
    p = cli("train", "--out", str(tmp_path), "--name", "steps", "--steps", "4", *common)
    assert p.returncode == 0, p.stderr[-3000:]
    assert steps_of(tmp_path / "steps") == [1, 2, 3, 4]
    assert_same(adapter(run), adapter(tmp_path / "steps"))


@pytest.mark.parametrize("optimizer", ["adamw_schedulefree", "came"])
def test_schedule_free_and_came_train_the_default_job_and_resume_to_the_same_adapter(
        tmp_path, cli, cache_args, optimizer):
    # A check-in every step: schedule-free's switch to its average and back runs around each one and each save.
    common = ["--set", f"train.optimizer='{optimizer}'", "--set", "train.save_every=2", "--set", "preview.every=1",
              *QUIET, *cache_args]
    p = cli("train", "--out", str(tmp_path), "--name", "ref", "--steps", "6", *common)
    assert p.returncode == 0, p.stderr[-3000:]
    ref = tmp_path / "ref"
    losses = [e["loss"] for e in read_events(ref / "events.jsonl") if e["event"] == "step"]
    assert len(losses) == 6 and all(loss == loss for loss in losses)
    # Ctrl-C in step 4 (its state saved after it), then the resume to the end.
    p = cli("train", "--out", str(tmp_path), "--name", "part", "--steps", "6", *common, kill="step:4@SIGINT")
    assert p.returncode == 130, p.stderr[-3000:]
    part = tmp_path / "part"
    p = cli("train", "--resume", str(part))
    assert p.returncode == 0, p.stderr[-3000:]
    assert [e["step"] for e in read_events(part / "events.jsonl") if e["event"] == "resume"] == [4]
    assert_same(adapter(part), adapter(ref))


def test_schedule_free_states_hold_its_average(tmp_path, cli, cache_args):
    """A state's weights are schedule-free's average x (eval mode: what `sdxl-lora export` of a state writes),
    the training point y only while training; the resume test above shows the switch back is exact."""
    from sdxl_lora.core import checkpoint

    p = cli("train", "--out", str(tmp_path), "--name", "sf", "--steps", "2", "--set",
            "train.optimizer='adamw_schedulefree'", "--set", "train.save_every=1", *QUIET, *cache_args)
    assert p.returncode == 0, p.stderr[-3000:]
    _, opt, _ = checkpoint.load_state(tmp_path / "sf" / "checkpoints" / "step-00000001")
    assert {g["train_mode"] for g in opt["param_groups"]} == {False}


def test_a_run_whose_optimizer_is_not_installed_stops_with_one_line_naming_the_extra(tmp_path, cli, cache_args,
                                                                                     monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "schedulefree" else real(n, *a))
    p = cli("train", "--out", str(tmp_path), "--steps", "1", "--set", "train.optimizer='adamw_schedulefree'", *QUIET,
            *cache_args)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == (
        "error: train.optimizer='adamw_schedulefree' needs the schedulefree package, which is not installed: "
        "pip install 'sdxl_lora[schedulefree]', or choose optimizer='adamw'")


def test_a_missing_optimizer_package_names_its_extra(monkeypatch):
    import importlib.util

    import torch

    from sdxl_lora.core.config import load_config
    from sdxl_lora.core.optim import build_optimizer

    real = importlib.util.find_spec
    for name, module, extra in (("adamw_schedulefree", "schedulefree", "schedulefree"),
                                ("came", "pytorch_optimizer", "came")):
        monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a, m=module: None if n == m else real(n, *a))
        with pytest.raises(ImportError, match=rf"pip install 'sdxl_lora\[{extra}\]'"):
            build_optimizer(load_config(extra={"train.optimizer": name}),
                            [{"params": [torch.nn.Parameter(torch.randn(4))]}])


def wandb_records(run_dir: Path) -> list:
    """The records of the W&B run in run_dir (its offline .wandb file: LevelDB's log format of protobuf
    records, the layout wandb's own reader used)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb2

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data, pos, block, part, out = path.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        part, pos = part + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 0 and n == 0:
            break
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb2.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


def test_the_wandb_and_tensorboard_trackers_get_the_losses_previews_and_config_offline(
        tmp_path, cli, cache_args, monkeypatch):
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default: no network, no account
    monkeypatch.setenv("WANDB_SILENT", "true")
    p = cli("train", "--out", str(tmp_path), "--name", "tracked", "--steps", "3", "--set",
            "train.trackers=['wandb', 'tensorboard']", "--set", "preview.before=false", "--set", "train.log_every=1",
            "--set", "train.save_every_minutes=0", *cache_args)
    assert p.returncode == 0, p.stderr[-3000:]
    run = tmp_path / "tracked"
    steps = [e for e in read_events(run / "events.jsonl") if e["event"] == "step"]
    evals = [e for e in read_events(run / "events.jsonl") if e["event"] == "eval"]
    history: dict[str, dict[int, object]] = {}
    config = {}
    for r in wandb_records(run):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            for key, value in row.items():
                history.setdefault(key, {})[row["_step"]] = value
        elif kind == "config":
            config.update({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "run":
            config.update({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.run.config.update})
    assert history["loss/train"] == pytest.approx({e["step"]: e["loss"] for e in steps}, rel=1e-6)
    assert set(history["lr"]) == set(history["images_per_s"]) == {1, 2, 3}
    assert history["loss/eval"] == pytest.approx({e["step"]: e["loss"] for e in evals}, rel=1e-6)  # before, after
    assert sorted(history["loss/eval"]) == [0, 3]
    # The final previews' grid, an image file beside the run's records.
    assert history["samples/grid/_type"] == {3: "images/separated"}
    (media,) = history["samples/grid/filenames"][3]
    assert next((run / "wandb").glob("offline-run-*/files")).joinpath(media).stat().st_size > 0
    assert config["train.steps"] == 3 and config["train.trackers"] == json.dumps(["wandb", "tensorboard"])
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [s.value for s in acc.Scalars("loss/train")] == pytest.approx([e["loss"] for e in steps], rel=1e-6)
    assert "samples/grid" in acc.Tags()["images"]


def test_a_missing_tracker_package_names_its_extra(monkeypatch, tmp_path):
    import importlib.util

    from sdxl_lora.core import tracking

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    with pytest.raises(ImportError, match=r"pip install 'sdxl_lora\[wandb\]'"):
        tracking.Trackers(["wandb"], tmp_path, {})


# ---------------------------------------------------------------- the WD14 tagger

TAGS = [("general", 9), ("sensitive", 9), ("red_hair", 0), ("blue_sky", 0), ("long_hair", 0), ("^_^", 0),
        ("hatsune_miku", 4)]


@pytest.fixture(scope="module")
def tagger(tmp_path_factory) -> Path:
    """A WD14-shaped tagger: model.onnx (a batch of 32x32 BGR images in 0-255, NHWC -> one sigmoid per tag) and
    selected_tags.csv. Each tag's logit is a weight times the image's mean of one channel plus a bias: red hair
    from red, blue sky from blue, the character from green; long hair and ^_^ always, at 0.73 and 0.95."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.zeros((3, len(TAGS)), np.float32)  # rows: B, G, R
    b = np.array([2.0, -2.0, -6.0, -6.0, 1.0, 3.0, -6.0], np.float32)
    w[2, 2] = w[0, 3] = w[1, 6] = 0.05  # 255 -> logit 6.75 (0.999); 128 -> 0.4 (0.60)
    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["input_1:0"], ["mean"], axes=[1, 2], keepdims=0),
         helper.make_node("MatMul", ["mean", "w"], ["logits"]),
         helper.make_node("Add", ["logits", "b"], ["biased"]),
         helper.make_node("Sigmoid", ["biased"], ["predictions_sigmoid"])],
        "tiny_wd14",
        [helper.make_tensor_value_info("input_1:0", TensorProto.FLOAT, ["batch", 32, 32, 3])],
        [helper.make_tensor_value_info("predictions_sigmoid", TensorProto.FLOAT, ["batch", len(TAGS)])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    folder = tmp_path_factory.mktemp("wd14")
    onnx.save(model, folder / "model.onnx")
    (folder / "selected_tags.csv").write_text(
        "tag_id,name,category,count\n" + "".join(f"{i},{n},{c},100\n" for i, (n, c) in enumerate(TAGS)))
    return folder


def images(folder: Path) -> Path:
    from PIL import Image

    folder.mkdir()
    for name, rgb in (("red", (255, 0, 0)), ("green", (0, 255, 0)), ("dim", (0, 128, 0)), ("kept", (255, 0, 0))):
        Image.new("RGB", (40, 40), rgb).save(folder / f"{name}.png")
    (folder / "kept.txt").write_text("my own caption\n")
    return folder


def test_the_tagger_writes_tag_captions_trigger_first_and_keeps_existing_ones(tmp_path, cli, tagger):
    data = images(tmp_path / "data")
    p = cli("dataset", "tag", str(data), "--tagger", str(tagger), "--trigger", "sks")
    assert p.returncode == 0, p.stderr[-3000:]
    caption = {f.stem: f.read_text() for f in data.glob("*.txt")}
    # The character first, then general tags by confidence; underscores are spaces except in the emoticon; the
    # half-sure character (0.60 < 0.85) left out; no rating unless asked.
    assert caption == {"red": "sks, red hair, ^_^, long hair\n", "green": "sks, hatsune miku, ^_^, long hair\n",
                       "dim": "sks, ^_^, long hair\n", "kept": "my own caption\n"}
    assert "captions written: 3; kept (already there): 1" in p.stdout
    assert "tags written: 8 (4 distinct, 2.7 a caption); most common: ^_^ (3), long hair (3)" in p.stdout

    p = cli("dataset", "tag", str(data), "--tagger", str(tagger), "--overwrite", "--ratings", "--keep-underscores",
            "--general-threshold", "0.9", "--character-threshold", "0.5")
    assert p.returncode == 0, p.stderr[-3000:]
    caption = {f.stem: f.read_text() for f in data.glob("*.txt")}
    assert caption == {"red": "general, red_hair, ^_^\n", "green": "general, hatsune_miku, ^_^\n",
                       "dim": "general, hatsune_miku, ^_^\n", "kept": "general, red_hair, ^_^\n"}


def test_the_tagger_says_what_is_missing(tmp_path, cli, tagger, monkeypatch):
    import importlib.util

    data = images(tmp_path / "data")
    p = cli("dataset", "tag", str(data), "--tagger", str(tmp_path))
    assert p.returncode == 2 and "needs a folder holding model.onnx and selected_tags.csv" in p.stderr
    p = cli("dataset", "tag", str(data), "--tagger", str(tagger), "--general-threshold", "35")
    assert p.returncode == 2 and "--general-threshold 35.0: a probability in (0, 1]" in p.stderr
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "onnxruntime" else real(n, *a))
    p = cli("dataset", "tag", str(data), "--tagger", str(tagger))
    assert p.returncode == 2
    assert p.stderr.strip() == "error: the tagger needs onnxruntime, which is not installed: pip install 'sdxl_lora[tagger]'"


def test_the_dataset_tab_offers_a_tagger_under_the_models_folder_and_tags_with_it(tmp_path, tagger):
    from sdxl_lora.ui import dataset_edit as edit
    from sdxl_lora.ui.folders import Folders

    (tmp_path / "datasets").mkdir()
    images(tmp_path / "datasets" / "d")
    f = Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path / "runs")
    shutil.copytree(tagger, f.models / "taggers" / "wd14")
    assert edit.captioner_choices(f.models) == ["taggers/wd14"]
    seen = []
    msg = edit.caption(f, "d", "taggers/wd14", ".txt", False, "sks", lambda done, total: seen.append((done, total)))
    assert msg.startswith("captions written: 3; kept (already there): 1") and "tags written: 8" in msg
    assert seen[-1] == (3, 3)
    assert (tmp_path / "datasets" / "d" / "red.txt").read_text() == "sks, red hair, ^_^, long hair\n"
    assert (tmp_path / "datasets" / "d" / "kept.txt").read_text() == "my own caption\n"


def test_the_train_form_takes_epochs_the_new_optimizers_and_trackers():
    """The form's fields come from the schema: each new field is there, and what is typed into it is the
    config's value (a list of trackers as the form's TOML-literal box takes lists)."""
    from sdxl_lora.ui.form import build_config, schema_fields, to_widget_value

    specs = schema_fields()
    typed = {"train.epochs": 3, "train.save_every_epochs": 1, "preview.every_epochs": 2, "train.optimizer": "came",
             "train.trackers": '["wandb", "tensorboard"]'}
    assert set(typed) <= {s.key for s in specs}
    values = [typed.get(s.key, to_widget_value(s, s.default)) for s in specs]
    cfg = build_config(specs, values, {})
    assert (cfg.train.epochs, cfg.train.save_every_epochs, cfg.preview.every_epochs) == (3, 1, 2)
    assert cfg.train.optimizer == "came" and cfg.train.trackers == ["wandb", "tensorboard"]
    defaults = build_config(specs, [to_widget_value(s, s.default) for s in specs], {})
    assert (defaults.train.epochs, defaults.train.optimizer, defaults.train.trackers) == (None, "adamw", [])

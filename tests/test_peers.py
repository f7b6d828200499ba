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
    assert "2 steps an epoch (3 batches of 2 images, grad_accum 2): 4 steps" in p.stderr
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
    assert history["loss/eval"] == pytest.approx({3: evals[-1]["loss"]}, rel=1e-6)
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

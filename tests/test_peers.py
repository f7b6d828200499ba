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

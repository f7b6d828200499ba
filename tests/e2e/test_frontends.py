"""The front ends over sdxl_lora.training: the UI's run worker trains a queued job without the CLI and
keeps its train.pid / train.exit contract, bad input is a message and exit code 2 wherever it comes from,
and `python -m sdxl_lora.ui` takes the same options as `sdxl-lora ui`."""
from __future__ import annotations

import argparse
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sdxl_lora import training
from sdxl_lora.core.config import load_config
from sdxl_lora.core.runs import read_events

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
# The worker as ui/jobs.py starts it, reporting at the end whether anything imported the CLI.
WORKER = ("import sys; from sdxl_lora.ui import worker; rc = worker.main(sys.argv[1:]); "
          "print('cli imported:', 'sdxl_lora.cli' in sys.modules); sys.exit(rc)")
TINY_RUN = {"train.steps": 2, "data.resolution": 64, "train.device": "cpu", "preview.prompts": "",
            "preview.before": False, "train.save_every": 1}


def queued_config(tmp_path: Path, name: str, **fields) -> tuple[Path, Path]:
    """A config as the UI queues it (runs/.ui/configs/NAME.toml) and the run folder it trains into."""
    runs = tmp_path / "runs"
    cfg = load_config(None, None, {**TINY_RUN, "output.name": name, "output.runs_dir": str(runs), **fields})
    path = runs / ".ui" / "configs" / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cfg.to_toml())
    return path, runs / name


def worker(run_dir: Path, *entry: str, wait: bool = True):
    """`python -m sdxl_lora.ui.worker RUN_DIR -- ENTRY...`, started in the runs folder as ui/jobs.py does."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(run_dir), "--", *entry], cwd=run_dir.parent,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def worker_here(cli, monkeypatch, run_dir: Path, *entry: str) -> subprocess.CompletedProcess:
    """The worker's main() in this process (conftest.py: cli), started in the runs folder: its exit code and
    its log (ui/jobs.py sends the worker's stdout and stderr there). For what the worker decides, not what
    its process does (a signal, its pid, the modules it imports)."""
    from sdxl_lora.ui import worker as w

    run_dir.parent.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(run_dir.parent)
    return cli(str(run_dir), "--", *entry, main=w.main)


def test_the_worker_trains_a_queued_config_stops_on_sigint_and_resumes_without_the_cli(tmp_path):
    config, run_dir = queued_config(tmp_path, "w", **{"train.steps": 12, "train.save_every": 0})
    proc = worker(run_dir, "train", str(config), wait=False)
    deadline = time.monotonic() + 300
    while not any(e["event"] == "step" for e in read_events(run_dir / "events.jsonl")):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert int((run_dir / "train.pid").read_text()) == proc.pid
    proc.send_signal(signal.SIGINT)  # what the UI's Stop button sends
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert (run_dir / "train.exit").read_text().strip() == "130"
    assert "stopped by SIGINT" in out and "resume with: sdxl-lora train --resume" in out
    assert "cli imported: False" in out

    p = worker(run_dir, "train", "--resume", str(run_dir))
    assert p.returncode == 0, p.stderr[-3000:]
    assert (run_dir / "train.exit").read_text().strip() == "0"
    assert (run_dir / "w.safetensors").is_file()
    # The run's log gets the CLI's summary lines.
    assert "run folder : " in p.stdout and "adapter    : " in p.stdout and "eval loss  : " in p.stdout
    assert "cli imported: False" in p.stdout


def test_bad_input_in_the_worker_is_exit_code_2_with_the_message_in_its_log(tmp_path, cli, monkeypatch):
    (tmp_path / "empty").mkdir()
    config, run_dir = queued_config(tmp_path, "bad", **{"data.dirs": [str(tmp_path / "empty")]})
    p = worker_here(cli, monkeypatch, run_dir, "train", str(config))
    assert p.returncode == 2
    assert "error: no images found in" in p.stderr and "Traceback" not in p.stderr
    assert (run_dir / "train.exit").read_text().strip() == "2"


def test_the_worker_never_writes_into_another_runs_folder(tmp_path, cli, monkeypatch):
    config, run_dir = queued_config(tmp_path, "taken")
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text("# somebody else's run\n")
    p = worker_here(cli, monkeypatch, run_dir, "train", str(config))
    assert p.returncode == 2 and "already holds a run" in p.stderr
    assert sorted(x.name for x in run_dir.iterdir()) == ["config.toml"]

    # A queue entry whose config trains elsewhere is refused before any folder is made.
    other = tmp_path / "runs" / "other"
    p = worker_here(cli, monkeypatch, other, "train", str(config))
    assert p.returncode == 2 and "not this worker's run folder" in p.stderr
    assert not other.exists()


def test_failures_map_to_the_exit_codes_the_front_ends_promise():
    from sdxl_lora.core.config import ConfigError

    assert training.failure(ConfigError("bad field")) == training.Failure(2, "error: bad field")
    assert training.failure(FileExistsError("run exists")).code == 2
    full = training.failure(OSError(errno.ENOSPC, "No space left on device", "/runs/a/checkpoints"))
    assert full.code == 1 and "/runs/a/checkpoints" in full.message and "--resume" in full.message
    assert training.failure(KeyboardInterrupt()).code == 130
    assert training.failure(OSError(errno.EIO, "I/O error")) is None  # not one a user can act on: a traceback
    assert training.failure(RuntimeError("a bug")) is None


def test_python_m_ui_takes_the_options_of_sdxl_lora_ui():
    from sdxl_lora.cli import build_parser
    from sdxl_lora.ui.app import add_arguments

    p = subprocess.run([sys.executable, "-m", "sdxl_lora.ui", "--help"], env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    for flag in ("--host", "--port", "--auth", "--share", "--datasets", "--models", "--runs"):
        assert flag in p.stdout
    own = vars(add_arguments(argparse.ArgumentParser()).parse_args([]))
    cli = vars(build_parser().parse_args(["ui"]))
    assert {k: cli[k] for k in own} == own
    assert own["host"] == "127.0.0.1" and not own["share"]


@pytest.mark.parametrize("argv", [["x"], ["x", "--", "generate"], ["x", "--", "train", "--resume"],
                                  ["x", "--", "train", "a.toml", "--steps", "3"]])
def test_the_worker_takes_only_queue_entries(argv, capsys):
    from sdxl_lora.ui import worker as w

    assert w.main(argv) == 2
    assert "usage:" in capsys.readouterr().err


def test_the_caption_editor_writes_beside_the_image_only(tmp_path):
    # The Dataset tab's Save captions: the caption extension comes from the page; whatever it says, the file
    # written is the image's own sidecar, and nothing is written (or made) elsewhere.
    from PIL import Image

    from sdxl_lora.ui.dataset_edit import save_table, table
    from sdxl_lora.ui.folders import Folders
    from sdxl_lora.ui.tab_dataset import _guarded

    datasets = tmp_path / "datasets" / "set"
    datasets.mkdir(parents=True)
    image = datasets / "00_red_star.png"
    Image.new("RGB", (8, 8)).save(image)
    f = Folders.create(tmp_path / "datasets", tmp_path / "models", tmp_path / "runs")
    items = [[str(image), ""]]
    rows = table(f, items)
    rows[0][3] = "sks,  a red   star"
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for ext in ("./../../../WRITTEN_OUTSIDE", ".txt/../../x", "/etc/passwd", "..txt", ".t x", "txt"):
        _, message = _guarded(save_table, f, items, rows, ext)
        assert "Error" in message, (ext, message)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written, nothing made
    _, message = save_table(f, items, rows, ".caption")
    assert (datasets / "00_red_star.caption").read_text() == "sks, a red star\n" and "saved" in message


def test_a_command_refused_for_bad_input_leaves_no_run_folder(tmp_path, capsys, monkeypatch):
    from sdxl_lora import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "model.ckpt").write_bytes(b"not read")
    runs = tmp_path / "runs"
    assert cli.main(["train", "--data", "empty", "--out", str(runs), "--name", "no-images"]) == 2
    assert "no images found in" in capsys.readouterr().err
    assert cli.main(["train", "--model", "model.ckpt", "--out", str(runs), "--name", "pickle"]) == 2
    assert "pickle checkpoints" in capsys.readouterr().err
    assert not (runs / "no-images").exists() and not (runs / "pickle").exists()


def test_resume_latest_skips_finished_runs(tmp_path):
    from sdxl_lora.core.runs import Run

    runs = tmp_path / "runs"
    for name, last in (("stopped", "interrupted"), ("finished", "done")):  # the finished one written last
        run = Run(runs / name)
        (run.dir / "checkpoints").mkdir(parents=True)
        (run.dir / "config.toml").write_text("")
        run.event("start", step=0, total_steps=4)
        run.event(last, step=4 if last == "done" else 2)
        time.sleep(0.02)
    assert training.find_run("latest", runs) == runs / "stopped"
    (runs / "stopped" / "events.jsonl").unlink()
    Run(runs / "stopped").event("done", step=4)
    with pytest.raises(FileNotFoundError, match="no unfinished run"):
        training.find_run("latest", runs)


def test_paths_outside_the_working_folder_print_as_given(tmp_path, monkeypatch):
    from sdxl_lora.core.fsutil import relpath

    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert relpath(tmp_path / "elsewhere" / "run") == str(tmp_path / "elsewhere" / "run")  # not ../elsewhere/run
    assert relpath(tmp_path / "here" / "runs" / "a") == "runs/a"


def test_generate_refuses_an_existing_image_before_it_loads_the_model(tmp_path, capsys, monkeypatch):
    from sdxl_lora import cli
    from sdxl_lora.sdxl import model

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(model, "load_pipeline", no_loading)
    (tmp_path / "seed1.png").write_bytes(b"mine")
    assert cli.main(["generate", "--prompt", "a red circle", "--out", str(tmp_path), "--seed", "0", "--num", "2"]) == 2
    assert f"{tmp_path / 'seed1.png'} already exists" in capsys.readouterr().err
    assert (tmp_path / "seed1.png").read_bytes() == b"mine" and not (tmp_path / "seed0.png").exists()


def test_llm_generate_labels_each_answer_with_its_prompt(capsys):
    from sdxl_lora import cli

    assert cli.main(["llm", "generate", "Name a colour.", "Count to three.", "--model", "tiny-llm",
                     "--max-new-tokens", "3", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.index("prompt: Name a colour.") < out.index("answer: ") < out.index("prompt: Count to three.")


def test_dataset_inspect_buckets_at_the_models_resolution_by_default(capsys):
    from sdxl_lora import cli

    assert cli.main(["dataset", "inspect", str(REPO / "sample_data" / "images")]) == 0
    out = capsys.readouterr().out
    assert "resolution 128" in out and "upscaled" not in out  # the demo base's 128 px, as training uses


def test_true_alpha_export_gives_each_layer_its_training_alpha_from_a_run_or_its_main_file(tmp_path, capsys):
    import json
    import shutil

    from safetensors import safe_open

    from sdxl_lora import cli

    runs, data = tmp_path / "runs", tmp_path / "data"
    data.mkdir()
    for img in sorted((REPO / "sample_data" / "images").glob("0[01]_*")):  # two images: a short set-up
        shutil.copy(img, data / img.name)
    assert cli.main(["train", "--out", str(runs), "--name", "r", "--steps", "1", "--data", str(data), "--set",
                     "train.device=cpu", "--set", "data.resolution=64", "--set", "preview.prompts=", "--set",
                     "preview.before=false", "--set", "preview.after=false", "--batch-size", "1"]) == 0
    run = runs / "r"

    def alphas(path):
        with safe_open(str(path), "pt") as fh:
            args = json.loads(fh.metadata().get("ss_network_args", "{}"))
            return {float(fh.get_tensor(k)) for k in fh.keys() if k.endswith(".alpha")}, args

    folded, args = alphas(run / "r.safetensors")
    assert len(folded) == 1 and "training_alphas_folded" in args  # the demo's ResNet override: mixed alphas
    for i, source in enumerate((run, run / "r.safetensors")):
        out = tmp_path / f"true{i}.safetensors"
        assert cli.main(["export", str(source), "--format", "kohya", "--true-alpha", "--out", str(out)]) == 0
        kept, args = alphas(out)
        assert kept == set(args["mixed_alphas"]) and len(kept) > 1 and "training_alphas_folded" not in args
    alone = tmp_path / "alone" / "r.safetensors"  # the main file without its run: refused, never silently folded
    alone.parent.mkdir()
    shutil.copy(run / "r.safetensors", alone)
    capsys.readouterr()
    assert cli.main(["export", str(alone), "--format", "kohya", "--true-alpha", "--out", str(tmp_path / "x.safetensors")]) == 2
    assert "r.diffusers.safetensors" in capsys.readouterr().err and not (tmp_path / "x.safetensors").exists()

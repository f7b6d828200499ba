"""A run is never lost: SIGKILL at any point, a corrupt newest state, Ctrl-C — each resumes to the
same adapter, bit for bit, as an uninterrupted run with the same seed (CPU, tiny model)."""
import errno
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from sdxl_lora.core import checkpoint
from sdxl_lora.core.runs import read_events

STEPS = 12
COMMON = ["--steps", str(STEPS), "--set", "train.save_every=3", "--set", "preview.prompts=''",
          "--set", "train.log_every=1", "--set", "train.save_every_minutes=0"]


# One thread per training process: bit-exact comparisons need the same thread count in every run,
# and several processes spinning two OpenMP threads each on two cores slow to a crawl.
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def train(out, *args, kill):
    """`sdxl-lora train --out OUT ARGS` in its own process, which SIGKILL ends at the fault point `kill`
    (core/checkpoint.py: test_fault)."""
    return subprocess.run([sys.executable, "-m", "sdxl_lora.cli", "train", "--out", str(out), *args],
                          capture_output=True, text=True, env={**ENV, "SDXL_LORA_TEST_KILL": kill}, timeout=600)


def train_here(cli, out, *args):
    """`sdxl-lora train --out OUT ARGS` to its end, in this process (conftest.py: cli): only a run that is
    killed needs a process of its own."""
    proc = cli("train", "--out", str(out), *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def adapter(run_dir):
    return load_file(run_dir / f"{run_dir.name}.safetensors")


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory, as_process, cache_args):
    from sdxl_lora.cli import main

    out = tmp_path_factory.mktemp("ref")
    with as_process():  # one torch thread, as the training processes: the adapters compare bit for bit
        assert main(["train", "--out", str(out), "--name", "ref", *COMMON, *cache_args]) == 0
    return adapter(out / "ref")


def test_sigkill_during_a_save_and_during_a_step_then_resume_gives_the_same_adapter(tmp_path, reference, cli,
                                                                                    cache_args):
    run = tmp_path / "k"
    p = train(tmp_path, "--name", "k", *COMMON, *cache_args, kill="save:6")
    assert p.returncode == -signal.SIGKILL
    states = run / "checkpoints"
    assert (states / ".tmp-step-00000006").exists()  # the torn save
    assert checkpoint.newest_valid(states).name == "step-00000003"

    p = train(tmp_path, "--resume", str(run), kill="step:10")
    assert p.returncode == -signal.SIGKILL
    assert checkpoint.newest_valid(states).name == "step-00000009"
    assert not (run / "k.safetensors").exists()

    train_here(cli, tmp_path, "--resume", str(run))
    resumes = [e["step"] for e in read_events(run / "events.jsonl") if e["event"] == "resume"]
    assert resumes == [3, 9]
    assert_same(adapter(run), reference)


def test_truncated_newest_state_falls_back_to_the_previous_one(tmp_path, reference, cli, cache_args):
    run = tmp_path / "t"
    p = train(tmp_path, "--name", "t", *COMMON, *cache_args, kill="step:11")
    assert p.returncode == -signal.SIGKILL
    newest = run / "checkpoints" / "step-00000009" / "adapter.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])
    p = train_here(cli, tmp_path, "--resume", str(run))
    assert "skipping checkpoint step-00000009" in p.stderr
    assert "does not match its checksum" in p.stderr
    assert [e["step"] for e in read_events(run / "events.jsonl") if e["event"] == "resume"] == [6]
    assert_same(adapter(run), reference)


def test_ctrl_c_saves_the_state_and_resume_continues_from_the_next_step(tmp_path, reference, cli, cache_args):
    run = tmp_path / "c"
    env = dict(ENV)
    proc = subprocess.Popen([sys.executable, "-m", "sdxl_lora.cli", "train", "--out", str(tmp_path), "--name", "c",
                             *COMMON, *cache_args, "--set", "train.save_every=0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    events = run / "events.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline:
        if events.exists() and any(e["event"] == "step" for e in read_events(events)):
            break
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    stopped = [e for e in read_events(events) if e["event"] == "interrupted"]
    assert len(stopped) == 1 and stopped[0]["signal"] == "SIGINT"
    n = stopped[0]["step"]
    assert 1 <= n < STEPS
    assert "resume with: sdxl-lora train --resume" in out
    assert checkpoint.newest_valid(run / "checkpoints").name == f"step-{n:08d}"

    train_here(cli, tmp_path, "--resume", str(run))
    ev = read_events(events)
    assert [e["step"] for e in ev if e["event"] == "resume"] == [n]
    steps_after = [e["step"] for e in ev if e["event"] == "step" and ev.index(e) > ev.index(stopped[0])]
    assert steps_after[0] == n + 1 and steps_after[-1] == STEPS
    assert_same(adapter(run), reference)


def test_resume_without_a_state_says_so(tmp_path, cli, cache_args):
    train_here(cli, tmp_path, "--name", "s", "--steps", "2", "--set", "preview.prompts=''",
               "--set", "train.save_every=0", *cache_args)
    # Finished without a saved state: training it further has nothing to start from.
    p = cli("train", "--out", str(tmp_path), "--resume", str(tmp_path / "s"), "--steps", "4")
    assert p.returncode == 2
    assert "no complete training state" in p.stderr


def test_a_run_folder_written_before_settings_were_removed_resumes(tmp_path, cli, cache_args):
    # A run's config.toml names every field of its day: the levers removed since are ignored with a warning each
    # (lora_matmul='concat' trains as 'merged'), and the run resumes from its state.
    train_here(cli, tmp_path, "--name", "old", "--steps", "2", "--set", "preview.prompts=''",
               "--set", "train.save_every=1", *cache_args)
    config = tmp_path / "old" / "config.toml"
    text = config.read_text()
    assert "\n[train]\n" in text and 'lora_matmul = "merged"' in text
    config.write_text(text.replace("\n[train]\n", "\n[train]\nreuse_conv_search = true\nbackground_compile = true\n"
                                   "graphs_while_compiling = true\n").replace('lora_matmul = "merged"',
                                                                             'lora_matmul = "concat"'))
    p = train_here(cli, tmp_path, "--resume", str(tmp_path / "old"), "--steps", "3")
    for name in ("reuse_conv_search", "background_compile", "graphs_while_compiling"):
        assert f"train.{name} is gone and ignored" in p.stderr
    assert "train.lora_matmul='concat' is gone" in p.stderr
    events = read_events(tmp_path / "old" / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "resume"] == [1] and events[-1]["event"] == "done"


def test_starts_released_together_never_share_a_run_folder(tmp_path):
    # Several starts of one run name at the same moment: exactly one gets the folder, the others are told
    # it exists; the winner's config.toml is whole.
    import threading

    from sdxl_lora.core.config import load_config
    from sdxl_lora.core.runs import RunExistsError, create_run

    cfg = load_config(extra={"output.runs_dir": str(tmp_path), "output.name": "same"})
    for attempt in range(20):
        cfg.output.name = f"same-{attempt}"
        gate, won, lost = threading.Barrier(8), [], []

        def start():
            gate.wait()
            try:
                won.append(create_run(cfg))
            except RunExistsError:
                lost.append(1)

        threads = [threading.Thread(target=start) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and len(lost) == 7, (attempt, len(won), len(lost))
        assert load_config(won[0].dir / "config.toml").output.name == f"same-{attempt}"
        assert sorted(p.name for p in won[0].dir.iterdir()) == ["config.toml", "samples"]


def test_a_start_killed_before_its_config_was_written_leaves_the_name_usable(tmp_path):
    from sdxl_lora.core.config import load_config
    from sdxl_lora.core.runs import RunExistsError, create_run

    cfg = load_config(extra={"output.runs_dir": str(tmp_path), "output.name": "r"})
    (tmp_path / "r" / "samples").mkdir(parents=True)
    torn = tmp_path / "r" / ".config.toml.abc.tmp"
    torn.write_text("[train]\nsteps = ")  # never linked into place
    os.utime(torn, (time.time() - 3600,) * 2)  # an hour ago
    run = create_run(cfg)
    assert (run.dir / "config.toml").is_file() and not list(run.dir.glob(".config.toml.*"))
    with pytest.raises(RunExistsError, match="already exists"):
        create_run(cfg)


def test_resume_with_another_plan_or_dataset_is_refused_naming_what_changed(tmp_path, capsys, cache_args):
    # The run's identity (base, adapter plan, images) is kept with each state: a resume whose config gives
    # another one stops before loading anything, with the differences and the ways on; steps may change.
    import shutil

    from sdxl_lora.cli import main
    from sdxl_lora.core.config import SAMPLE_DATA

    assert main(["train", "--out", str(tmp_path), "--name", "r", "--steps", "2", "--set", "preview.prompts=''",
                 "--set", "train.save_every=1", *cache_args]) == 0
    run = tmp_path / "r"
    capsys.readouterr()
    # A finished run resumes only to train further.
    assert main(["train", "--resume", str(run)]) == 2
    assert "the run has finished (2 steps" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "--steps", "3", "--set", "adapter.rank=4"]) == 2
    err = capsys.readouterr().err
    assert "another model, adapter plan or dataset" in err and "adapter:" in err and "config.toml" in err, err
    other = tmp_path / "other"
    shutil.copytree(SAMPLE_DATA / "images", other)
    (other / sorted(p.name for p in other.glob("*.png"))[0]).unlink()
    assert main(["train", "--resume", str(run), "--steps", "3", "--set", f"data.dirs=['{other}']"]) == 2
    assert "images:" in capsys.readouterr().err
    # What may change does: a longer run resumes and finishes, its adapter replaced by the longer run's.
    assert main(["train", "--resume", str(run), "--steps", "3"]) == 0
    assert [e["step"] for e in read_events(run / "events.jsonl") if e["event"] == "done"][-1] == 3


def test_a_full_disk_during_a_save_is_a_message_and_leaves_the_saved_states_as_they_were(tmp_path, monkeypatch):
    # torch.save reports a full disk as "basic_ios::clear": the save turns it into ENOSPC, removes what it
    # half-wrote, and the state saved before stays the newest complete one.
    from sdxl_lora.core import fsutil

    root = tmp_path / "checkpoints"
    adapter = {"w": torch.ones(3)}
    # The optimizer and trainer states as the loop writes them (newest_valid reads them back).
    optimizer = {"state": {}, "param_groups": []}
    trainer = {"step": 1, "epoch": 0, "position": 1, "schedule": {}, "rng": {}}
    checkpoint.save_state(root, 1, adapter, optimizer, trainer, keep=3)
    real_save = torch.save

    def full(obj, f, *a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", full)
    monkeypatch.setattr(fsutil.shutil, "disk_usage", lambda p: shutil_usage(0))
    with pytest.raises(OSError) as err:
        checkpoint.save_state(root, 2, adapter, optimizer, {**trainer, "step": 2}, keep=3)
    assert err.value.errno == errno.ENOSPC
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001"]  # no .tmp-step-* left behind
    assert checkpoint.newest_valid(root).name == "step-00000001"


def shutil_usage(free):
    import shutil

    return shutil._ntuple_diskusage(100 * 2**30, 100 * 2**30 - free, free)


def test_a_full_disk_at_the_final_export_exits_1_naming_the_file(tmp_path, monkeypatch, capsys, cache_args):
    from sdxl_lora.cli import main
    from sdxl_lora.sdxl import export

    def full(*a, **k):
        raise RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                           '"No space left on device" })')

    monkeypatch.setattr(export, "save_file", full)
    rc = main(["train", "--out", str(tmp_path), "--name", "x", "--steps", "2", "--set", "preview.prompts=''",
               "--set", "train.save_every=1", *cache_args])
    err = capsys.readouterr().err
    assert rc == 1 and "could not write" in err and "No space left" in err and "Traceback" not in err, err
    assert checkpoint.newest_valid(tmp_path / "x" / "checkpoints") is not None  # the run resumes from here
    assert not list((tmp_path / "x").glob(".*.tmp"))

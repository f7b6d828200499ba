"""A run is never lost: SIGKILL at any point, a corrupt newest state, Ctrl-C — each resumes to the
same adapter, bit for bit, as an uninterrupted run with the same seed (CPU, tiny model)."""
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

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
def reference_run(tmp_path_factory, as_process, cache_args):
    """The run folder of an uninterrupted run of COMMON."""
    from sdxl_lora.cli import main

    out = tmp_path_factory.mktemp("ref")
    with as_process():  # one torch thread, as the training processes: the adapters compare bit for bit
        assert main(["train", "--out", str(out), "--name", "ref", *COMMON, *cache_args]) == 0
    return out / "ref"


@pytest.fixture(scope="module")
def reference(reference_run):
    return adapter(reference_run)


def test_sigkill_during_a_save_and_during_a_step_then_resume_gives_the_same_adapter(tmp_path, reference, cli,
                                                                                    cache_args):
    run = tmp_path / "k"
    p = train(tmp_path, "--name", "k", *COMMON, *cache_args, kill="save:6")
    assert p.returncode == -signal.SIGKILL
    states = run / "checkpoints"
    assert (states / ".tmp-step-00000006").exists()  # the torn save
    assert checkpoint.newest_valid(states).name == "step-00000003"

    # The resume's start clears the torn save, before any save of its own (killed before step 6's).
    p = train(tmp_path, "--resume", str(run), kill="step:5")
    assert p.returncode == -signal.SIGKILL
    assert not list(states.glob(".tmp-*")) and checkpoint.newest_valid(states).name == "step-00000003"

    p = train(tmp_path, "--resume", str(run), kill="step:10")
    assert p.returncode == -signal.SIGKILL
    assert checkpoint.newest_valid(states).name == "step-00000009"
    assert not (run / "k.safetensors").exists()

    train_here(cli, tmp_path, "--resume", str(run))
    resumes = [e["step"] for e in read_events(run / "events.jsonl") if e["event"] == "resume"]
    assert resumes == [3, 3, 9]
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


def _killed_at_the_claim(runs, name: str) -> None:
    """A start of run `name` under `runs` SIGKILLed between writing its config and linking it into place."""
    code = ("import os, signal\n"
            "os.link = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
            "from sdxl_lora.core.config import load_config\n"
            "from sdxl_lora.core.runs import create_run\n"
            f"create_run(load_config(extra={{'output.runs_dir': {str(runs)!r}, 'output.name': {name!r}}}))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]


def test_a_start_killed_at_its_claim_leaves_the_name_usable_and_the_next_claim_clears_its_file(tmp_path):
    from sdxl_lora.core.config import load_config
    from sdxl_lora.core.runs import RunExistsError, create_run

    _killed_at_the_claim(tmp_path, "r")
    assert len(list((tmp_path / "r").glob(".config.toml.*"))) == 1
    _killed_at_the_claim(tmp_path, "q")  # the next claim in the runs folder clears what killed starts left
    assert not list((tmp_path / "r").iterdir()) and len(list((tmp_path / "q").glob(".config.toml.*"))) == 1
    run = create_run(load_config(extra={"output.runs_dir": str(tmp_path), "output.name": "r"}))
    assert (run.dir / "config.toml").is_file() and not list(run.dir.glob(".config.toml.*"))
    assert not list((tmp_path / "q").iterdir())
    with pytest.raises(RunExistsError, match="already exists"):
        create_run(load_config(extra={"output.runs_dir": str(tmp_path), "output.name": "r"}))


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


# ---- a full disk: on a real small filesystem where the test may mount one


class _Tmpfs:
    """A tmpfs of `size` bytes mounted at `path`: a disk that really fills (CI runs the tests as root)."""

    def __init__(self, path: Path, size: int):
        self.path = path
        _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))

    def resize(self, size: int) -> None:
        _mount("-o", f"remount,size={size}", str(self.path))

    def close(self) -> None:
        if subprocess.run(["umount", str(self.path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(self.path)], check=True)


def _mount(*args: str) -> None:
    p = subprocess.run(["mount", *args], capture_output=True, text=True)
    if p.returncode:
        raise PermissionError(f"mount {' '.join(args)}: {p.stderr.strip()}")


class _FakeDisk:
    """`path` as a disk of `size` bytes for the writers of a state save and an export, where the test may not
    mount (a container without the capability). A write past the size leaves the part that fits and fails as
    its writer fails on a full disk: torch.save without naming the cause, safetensors with "No space left on
    device". The free space is what the files under `path` leave, so the save's clean-up frees what it
    removes, as on a real disk: the order of measuring and cleaning up matters here as it does there."""

    def __init__(self, path: Path, size: int, monkeypatch):
        from safetensors import SafetensorError

        from sdxl_lora.sdxl.formats import export

        self.path, self.size = path, size
        real_usage = shutil.disk_usage

        def usage(p):
            if not self._inside(p):
                return real_usage(p)
            free = max(0, self.size - self._used())
            return shutil._ntuple_diskusage(self.size, self.size - free, free)

        def filling(write, error):
            def call(obj, f, *a, **k):
                write(obj, f, *a, **k)
                over = self._used() - self.size
                if self._inside(f) and over > 0:
                    os.truncate(f, max(0, os.path.getsize(f) - over))
                    raise error
            return call

        monkeypatch.setattr(shutil, "disk_usage", usage)
        monkeypatch.setattr(torch, "save", filling(torch.save, RuntimeError(
            "[enforce fail at inline_container.cc:672] . unexpected pos 4096 vs 0")))
        full = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        for module in (checkpoint, export):
            monkeypatch.setattr(module, "save_file", filling(module.save_file, full))

    def _inside(self, p) -> bool:
        return isinstance(p, (str, os.PathLike)) and Path(os.path.abspath(p)).is_relative_to(self.path)

    def _used(self) -> int:
        return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())

    def resize(self, size: int) -> None:
        self.size = size

    def close(self) -> None:
        pass


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """small_disk(size): a folder (.path) on a filesystem of `size` bytes, .resize(size) to make room. A tmpfs
    where the test may mount one; else _FakeDisk, with a warning saying why."""
    disks = []

    def make(size: int):
        path = tmp_path / f"disk{len(disks)}"
        path.mkdir()
        try:
            if os.environ.get("SDXL_LORA_TEST_NO_MOUNT"):
                raise PermissionError("SDXL_LORA_TEST_NO_MOUNT is set")
            disk = _Tmpfs(path, size)
        except (PermissionError, FileNotFoundError) as e:  # no privilege, or no mount program
            warnings.warn(f"a full disk is simulated at the writers: no tmpfs can be mounted here ({e})")
            disk = _FakeDisk(path, size, monkeypatch)
        disks.append(disk)
        return disk
    yield make
    for disk in disks:
        disk.close()


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


SLACK = 512 * 1024  # the run folder's own small files: config, log, events


def _one_paragraph(err: str) -> str:
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if "error:" in ln]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    return lines[0]


def test_a_full_disk_during_a_state_save_is_one_paragraph_and_the_resume_gives_the_same_adapter(
        small_disk, reference_run, reference, cli, cache_args):
    # Room for the first state and half of the second: its adapter file (a third of a state, megabytes) is
    # written, its optimizer state is not. The clean-up frees that adapter file, so the disk no longer looks
    # full once it has run; torch's own error never says why it failed.
    state = _size(reference_run / "checkpoints" / "step-00000009")
    disk = small_disk(state + state // 2 + SLACK)
    run = disk.path / "f"
    p = cli("train", "--out", str(disk.path), "--name", "f", *COMMON, *cache_args)
    assert p.returncode == 1, p.stderr[-3000:]
    msg = _one_paragraph(p.stderr)
    assert f"could not write {run / 'checkpoints' / 'step-00000006'}: No space left on device" in msg, msg
    assert "--resume" in msg, msg
    assert sorted(x.name for x in (run / "checkpoints").iterdir()) == ["step-00000003"]  # nothing half-written
    assert checkpoint.newest_valid(run / "checkpoints").name == "step-00000003"
    # Once there is space the run continues from there, to the adapter of a run that never stopped.
    disk.resize(8 * state)
    train_here(cli, disk.path, "--resume", str(run))
    assert [e["step"] for e in read_events(run / "events.jsonl") if e["event"] == "resume"] == [3]
    assert_same(adapter(run), reference)


def test_a_full_disk_at_the_final_export_is_one_paragraph_naming_the_file_and_leaves_no_part_of_it(
        small_disk, reference_run, cli, cache_args):
    # Room for the state of step 1 and the kohya file, and half of the diffusers file beside it.
    state = _size(reference_run / "checkpoints" / "step-00000009")
    exported = (reference_run / "ref.safetensors").stat().st_size
    disk = small_disk(state + exported + exported // 2 + SLACK)
    run = disk.path / "x"
    p = cli("train", "--out", str(disk.path), "--name", "x", "--steps", "2", "--set", "preview.prompts=''",
            "--set", "train.save_every=1", *cache_args)
    assert p.returncode == 1, p.stderr[-3000:]
    msg = _one_paragraph(p.stderr)
    assert f"could not write {run / 'x.diffusers.safetensors'}: No space left on device" in msg, msg
    assert not (run / "x.diffusers.safetensors").exists() and not list(disk.path.rglob(".*tmp*"))
    assert checkpoint.newest_valid(run / "checkpoints").name == "step-00000001"  # the run resumes from here
    disk.resize(8 * state)
    train_here(cli, disk.path, "--resume", str(run))
    assert (run / "x.safetensors").is_file() and (run / "x.diffusers.safetensors").is_file()

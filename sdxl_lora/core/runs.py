"""A run's folder under runs/: creation (never over an existing run unless asked) and its events file.

Layout of runs/<name>/:
  config.toml      the resolved config
  events.jsonl     one JSON object per line: {"event": ..., "time": ..., ...}; the UI reads it
  train.log        the log
  samples/         preview images, step in the file name
  checkpoints/     training states
  <name>.safetensors and exports
  train.pid        the id of the process training it, while it trains (whoever started it: CLI, UI, launch)
  progress.json    the latest step and eta, replaced each step (between the log points of events.jsonl)
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import Config
from .fsutil import clear_interrupted, fsync_dir, process_alive, subfolders, temp_prefix


PID_FILE = "train.pid"
PROGRESS_FILE = "progress.json"
PHASE_FILE = "phase.json"
# Requests to a training run, each an empty file in its folder that the trainer takes between steps: previews at
# the step it is at, and its training state saved there (the UI's Sample now and Save now; `touch` works too).
REQUESTS = {"sample": "sample-now", "save": "save-now"}


class RunExistsError(FileExistsError):
    pass


@dataclass
class Run:
    dir: Path

    @property
    def name(self) -> str:
        return self.dir.name

    @property
    def events_path(self) -> Path:
        return self.dir / "events.jsonl"

    @property
    def samples_dir(self) -> Path:
        return self.dir / "samples"

    @property
    def checkpoints_dir(self) -> Path:
        return self.dir / "checkpoints"

    @property
    def log_path(self) -> Path:
        return self.dir / "train.log"

    def event(self, kind: str, **fields: Any) -> None:
        """Append one event line. Each line is written with one write() and flushed, so a reader
        never sees half a line except after a crash mid-write (readers skip a broken last line)."""
        record = {"event": kind, "time": round(time.time(), 3), **fields}
        line = json.dumps(record, default=str) + "\n"
        with open(self.events_path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()

    def events(self) -> list[dict]:
        return read_events(self.events_path)

    def progress(self, step: int, total_steps: int, eta_s: float, **figures) -> None:
        """The latest step, for a watcher between log points (events.jsonl gets a line every
        train.log_every steps), with what the loop could read without waiting (`figures`: a recent step's loss
        and its step, images_per_s so far). Replaced whole each step (a rename, no fsync: a lost update is
        rewritten by the next step), so a reader sees one complete record."""
        tmp = self.dir / f".{PROGRESS_FILE}.tmp"
        tmp.write_text(json.dumps({"step": step, "total_steps": total_steps, "eta_s": round(eta_s, 1),
                                   **figures, "time": round(time.time(), 3)}), encoding="utf-8")
        os.replace(tmp, self.dir / PROGRESS_FILE)

    def ask(self, what: str) -> Path:
        """Ask the training run for `what` ("sample" or "save") at its next step: the request file (REQUESTS)."""
        path = self.dir / REQUESTS[what]
        path.touch()
        return path

    def take_request(self, what: str) -> bool:
        """Whether `what` was asked since it was last taken; taking it removes the request."""
        try:
            (self.dir / REQUESTS[what]).unlink()
        except FileNotFoundError:
            return False
        return True

    def phase(self, name: str, step: int, done: int = 0, of: int | None = None) -> None:
        """What the run does between training steps ("rendering previews", "evaluating"), for a watcher: its start
        (done 0) as a "phase" event, so how long each phase took is on record, and how far it is (done of `of`)
        in phase.json, replaced whole like progress.json. The event that ends the phase (samples, eval) or the
        next step's record supersedes it."""
        now = round(time.time(), 3)
        if done == 0:
            self.event("phase", step=step, phase=name, **({"of": of} if of is not None else {}))
        tmp = self.dir / f".{PHASE_FILE}.tmp"
        tmp.write_text(json.dumps({"phase": name, "step": step, "done": done, "of": of, "time": now}),
                       encoding="utf-8")
        os.replace(tmp, self.dir / PHASE_FILE)


def read_phase(run_dir: Path) -> dict:
    """The run's latest phase record (Run.phase), or {} where there is none."""
    try:
        return json.loads((run_dir / PHASE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def read_progress(run_dir: Path) -> dict:
    """The run's latest step record (Run.progress), or {} where there is none."""
    try:
        return json.loads((run_dir / PROGRESS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def read_events(path: Path) -> list[dict]:
    out = []
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line from a crash; everything before it is intact
    return out


def default_run_name() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def create_run(cfg: Config) -> Run:
    """Make the run folder and write the resolved config; refuse to reuse a folder unless overwrite.
    Under `accelerate launch` with several processes the main one makes it (the name is its choice);
    the others wait for it and use the same folder."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _create_run_shared(cfg)
    return _make_run(cfg, cfg.output.name or default_run_name())


_CLAIM_PREFIX = ".config.toml."  # the config being written (temp_prefix), before it is linked into place


def _taken(run_dir: Path) -> bool:
    """Whether a run lives in `run_dir`: anything in it but what a start killed before it wrote its config
    leaves (a config being written, an empty samples folder) counts."""
    if not run_dir.is_dir():
        return False
    for entry in run_dir.iterdir():
        if entry.name.startswith(_CLAIM_PREFIX):
            continue
        if entry.name == "samples" and entry.is_dir() and not any(entry.iterdir()):
            continue
        return True
    return False


def _make_run(cfg: Config, name: str) -> Run:
    run_dir = Path(cfg.output.runs_dir) / name
    exists = (f"run folder {run_dir} already exists; choose another output.name (--name), resume it with "
              f"--resume {run_dir}, or pass --overwrite to replace it")
    if _taken(run_dir):
        if not cfg.output.overwrite:
            raise RunExistsError(exists)
        shutil.rmtree(run_dir)
    for other in subfolders(run_dir.parent):  # what earlier starts and exports here left when killed
        clear_interrupted(other)
    run_dir.mkdir(parents=True, exist_ok=True)
    # The run is claimed by its config.toml appearing, complete, under its name: written beside it, then
    # hard-linked into place, which fails when another process got there first (a check, then a write,
    # would let two starts released together both claim the folder).
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=run_dir, prefix=temp_prefix("config.toml"),
                                     suffix=".tmp", delete=False) as tmp:
        tmp.write(cfg.to_toml())
        tmp.flush()
        os.fsync(tmp.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp.name, 0o666 & ~umask)  # the usual mode, not the temp file's private one
    try:
        os.link(tmp.name, run_dir / "config.toml")
    except (FileExistsError, FileNotFoundError):  # taken (the winner may have cleared this start's file)
        raise RunExistsError(exists) from None
    finally:
        Path(tmp.name).unlink(missing_ok=True)
    fsync_dir(run_dir)
    run = Run(run_dir)
    run.samples_dir.mkdir(exist_ok=True)
    return run


def _create_run_shared(cfg: Config) -> Run:
    import torch
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    # The process group the Accelerator will use (the same device choice as accel.make_accelerator).
    state = PartialState(cpu=cfg.train.device == "cpu" or not torch.cuda.is_available())
    name = broadcast_object_list([cfg.output.name or default_run_name()])[0]
    run_dir = Path(cfg.output.runs_dir) / name
    error = None
    if state.is_main_process:
        try:
            _make_run(cfg, name)
        except RunExistsError as e:
            error = str(e)
    error = broadcast_object_list([error])[0]  # every process stops, not only the main one
    if error:
        raise RunExistsError(error)
    # A folder local to each machine on multi-node runs; the main process's holds the run's files.
    run_dir.mkdir(parents=True, exist_ok=True)
    return Run(run_dir)


def write_pid(run_dir: Path) -> None:
    """Name this process as the one training `run_dir` (the UI reads it to show the run's state and to stop it)."""
    from .fsutil import atomic_write_text

    atomic_write_text(Path(run_dir) / PID_FILE, f"{os.getpid()}\n")


def clear_pid(run_dir: Path) -> None:
    """The run is no longer trained by this process (it ended): its train.pid goes, if it is this process's."""
    path = Path(run_dir) / PID_FILE
    try:
        if int(path.read_text().strip()) == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def training_pid(run_dir: Path) -> int | None:
    """The id of the live process that wrote `run_dir`'s train.pid, or None when it is gone. A process that
    started after the file was written is another program that got the id again, not the run's."""
    path = Path(run_dir) / PID_FILE
    try:
        pid, written = int(path.read_text().strip()), path.stat().st_mtime
    except (OSError, ValueError):
        return None
    return pid if process_alive(pid, started_before=written) else None


def attach_log_file(run: Run) -> logging.Handler:
    handler = logging.FileHandler(run.log_path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    return handler

"""Runs as the UI sees them: a queue of runs that start one after another, each training in its own
detached process (ui/worker.py), and every run's state read back from its folder.

Nothing here holds a run's state in memory: a reloaded page or a restarted server finds running,
stopped and finished runs again from runs/*/ (events.jsonl, train.pid, train.exit). The UI's own files
live in runs/.ui/:

  queue/NNNNNN-NAME.json   a run waiting its turn: {"name", "args"} (the worker's job: ["train", CONFIG]
                           or ["train", "--resume", RUN_DIR])
  configs/NAME.toml        the config a new run was started with (the run folder gets its own copy)
  prompts/NAME.txt         the preview prompts typed in the form
  logs/NAME.log            the run process's console output (tracebacks land here)
  launched/NAME.pid        the process the queue started, until it ends (so the queue waits for it)
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sdxl_lora.core.config import Config
from sdxl_lora.core.fsutil import atomic_write_text, process_alive
from sdxl_lora.core.runs import (PID_FILE, default_run_name, read_events, read_phase, read_progress,
                                 training_pid)

from .folders import Folders
from .form import DECIDED_WHEN_UNSET
from .worker import EXIT_FILE, STANDBY

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[2]


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a live (not zombie) run process the queue started: a reused pid of another program
    is not."""
    if not process_alive(pid):
        return False
    try:
        return b"sdxl_lora.ui.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc (not Linux): trust kill(0)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


@dataclass
class RunStatus:
    name: str
    dir: Path
    state: str            # queued, starting, training, finished, stopped, failed, died, unknown
    #                       (from the run folder alone, whoever started it: the UI, the CLI, a launch script)
    step: int = 0
    total: int = 0
    loss: float = math.nan
    eta_s: float | None = None
    images_per_s: float | None = None
    logged_step: int = 0                # the step the loss and throughput above are from: the last log point
    tokens_per_s: float | None = None   # an LLM run's throughput (it has tokens, not images)
    gpu_mem_gib: float | None = None    # GPU memory torch's allocator held at the last logged step
    gpu_peak_gib: float | None = None   # and at most so far
    pid: int | None = None
    message: str = ""
    started: float = 0.0
    phase: str = ""                     # what it does between steps now: "rendering previews 2 of 8 (step 10)"

    @property
    def alive(self) -> bool:
        return self.state in ("starting", "training")

    @property
    def resumable(self) -> bool:
        ckpts = self.dir / "checkpoints"
        return (not self.alive and self.state != "finished" and ckpts.is_dir()
                and any(p.name.startswith("step-") for p in ckpts.iterdir()))


def run_status(run_dir: Path, events: list[dict] | None = None) -> RunStatus:
    """A run's state from its folder alone."""
    events = read_events(run_dir / "events.jsonl") if events is None else events
    st = RunStatus(name=run_dir.name, dir=run_dir, state="unknown")
    cfg = run_dir / "config.toml"
    st.started = cfg.stat().st_mtime if cfg.exists() else 0.0
    kinds = [e.get("event") for e in events]
    for e in events:
        if e.get("event") == "step":
            st.step, st.total = e.get("step", 0), e.get("total_steps", 0)
            st.logged_step = st.step
            st.loss, st.eta_s, st.images_per_s = e.get("loss", math.nan), e.get("eta_s"), e.get("images_per_s")
            st.tokens_per_s = e.get("tokens_per_s")
            st.gpu_mem_gib, st.gpu_peak_gib = e.get("gpu_mem_gib"), e.get("gpu_peak_gib")
        elif e.get("event") in ("start", "resume", "done", "interrupted"):
            st.step = e.get("step", st.step)
            st.total = e.get("total_steps", st.total)
    pid = training_pid(run_dir)
    exit_code = _read_int(run_dir / EXIT_FILE)
    st.pid = pid
    # Between log points the run replaces progress.json each step: newer than the last event, it is the step now.
    latest = read_progress(run_dir) if pid is not None else {}
    step_time = next((e.get("time", 0) for e in reversed(events) if e.get("event") == "step"), 0)
    if latest.get("step", 0) > st.step and latest.get("time", 0) > (events[-1].get("time", 0) if events else 0):
        st.step, st.eta_s = latest["step"], latest.get("eta_s", st.eta_s)
        st.total = latest.get("total_steps", st.total)
        if "loss" in latest:  # a step's own loss (read a step late, so as not to hold the run up) and pace
            st.loss, st.logged_step = latest["loss"], latest.get("loss_step", latest["step"])
            st.images_per_s = latest.get("images_per_s", st.images_per_s)
        step_time = latest["time"]
    if pid is not None:
        # A phase goes on while its start is the run's last event (the samples or eval event ends it) and no step
        # was recorded after it: by the events' order, which a clock's resolution cannot confuse.
        phase = read_phase(run_dir)
        if phase and events and events[-1].get("event") == "phase" and latest.get("time", 0) <= phase.get("time", 0):
            st.phase = phase_text(phase)
        else:
            phase = {}
        eta = eta_with_phases(events, st.step, st.total, step_time, time.time(), _preview_plan(run_dir), phase)
        st.eta_s = eta if eta is not None else st.eta_s
    ended = ("done", "interrupted", "failed", "start", "resume")
    last = next((e for e in reversed(events) if e.get("event") in ended), {})
    # Alive until the process is gone: its exit file is written just before it ends.
    if pid is not None:
        # A resume writes "resume" as it sets up and "start" when it trains again.
        began = next((k for k in reversed(kinds) if k in ("start", "resume")), None)
        st.state = "training" if began == "start" else "starting"
        if st.state == "starting":
            st.message = _setting_up(run_dir)
        return st
    last_kind = last.get("event")
    if last_kind == "done" and exit_code in (None, 0):
        st.state = "finished"
    elif last_kind == "interrupted" or exit_code == 130:
        st.state = "stopped"
        st.message = last.get("message") if last_kind == "interrupted" and last.get("message") else \
            "stopped; resume continues from the last saved state"
    elif last_kind == "failed" or exit_code is not None:
        st.state = "failed"
        st.message = (last.get("message") if last_kind == "failed" else None) or \
            f"the run process ended with exit code {exit_code}; see its log"
    elif last_kind in ("start", "resume") or (run_dir / PID_FILE).exists():
        st.state, st.message = "died", "the run process is gone without a word (killed?); see its log"
    return st


def phase_text(phase: dict) -> str:
    """A phase record (core/runs.py: Run.phase) in words: "rendering previews 2 of 8 (step 10)"."""
    done, of = phase.get("done"), phase.get("of")
    count = f" {done} of {of}" if of else ""
    return f"{phase.get('phase', 'working')}{count} (step {phase.get('step', 0)})"


def _preview_plan(run_dir: Path) -> tuple[int, bool]:
    """The run's preview.every and preview.after, from its config.toml (every field is written there)."""
    import tomllib

    try:
        preview = tomllib.loads((run_dir / "config.toml").read_text(encoding="utf-8")).get("preview", {})
    except (OSError, ValueError):
        return 0, True
    return int(preview.get("every", 0) or 0), bool(preview.get("after", True))


def _no_previews(run_dir: Path) -> bool:
    """Whether the run renders no previews (preview.prompts = "" in its config.toml; unset: the model's own)."""
    import tomllib

    try:
        cfg = tomllib.loads((run_dir / "config.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return cfg.get("task", "sdxl") == "sdxl" and cfg.get("preview", {}).get("prompts") == ""


def _phases(events: list[dict]) -> list[tuple[str, int, float, float | None]]:
    """Each phase the run went through (its "phase" events): (name, step, start, end); the end is the time of the
    next event that is not a phase's start (samples, eval), None while it goes on."""
    out = []
    for i, e in enumerate(events):
        if e.get("event") == "phase":
            end = next((x.get("time") for x in events[i + 1:] if x.get("event") != "phase"), None)
            out.append((e.get("phase", ""), e.get("step", 0), e.get("time", 0.0), end))
    return out


PREVIEWS, EVALUATING = "rendering previews", "evaluating"


def eta_with_phases(events: list[dict], step: int, total: int, step_time: float, now: float,
                    preview_plan: tuple[int, bool], phase: dict) -> float | None:
    """Seconds left, the previews and the final evaluation counted: the steps left at the training pace (this
    session's time since its start, the phases' time taken out), each preview set still due (preview.every, and
    the final one) at the last set's length, the final evaluation at the last one's, and what is left of the
    phase going on now. None before the session's first step (no pace yet)."""
    start = next((e for e in reversed(events) if e.get("event") == "start"), None)
    if start is None or not total or step <= start.get("step", 0) or not step_time:
        return None
    t0, s0 = start.get("time", 0.0), start.get("step", 0)
    phases = _phases(events)
    done = [(name, st, a, b) for name, st, a, b in phases if b is not None]
    spent = sum(b - a for _, _, a, b in done if t0 <= a and b <= step_time)
    pace = max(step_time - t0 - spent, 0.0) / (step - s0)
    last = {name: b - a for name, _, a, b in done}  # each kind's latest length
    set_s, eval_s = last.get(PREVIEWS, 0.0), last.get(EVALUATING, 0.0)
    every, after = preview_plan
    left = (total - step) * pace
    left += set_s * sum(1 for k in range(step + 1, total) if every and k % every == 0)
    now_name, now_step = phase.get("phase"), phase.get("step", step)
    if now_name:  # what is left of the phase going on now
        elapsed = max(now - next((a for name, st, a, b in reversed(phases) if b is None), now), 0.0)
        if now_name == PREVIEWS and phase.get("done") and phase.get("of"):
            left += elapsed * (phase["of"] - phase["done"]) / phase["done"]
        else:
            left += max((set_s if now_name == PREVIEWS else eval_s) - elapsed, 0.0)
    final_eval_now = now_name == EVALUATING and now_step >= total
    final_previews_now = now_name == PREVIEWS and now_step >= total
    left += (0.0 if final_eval_now or final_previews_now else eval_s) + (set_s if after and not final_previews_now
                                                                          else 0.0)
    return left


def _setting_up(run_dir: Path) -> str:
    """What a run that has not begun training is doing: the last line of its log (loading the model,
    caching latents, rendering the first previews...)."""
    path = run_dir / "train.log"
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, path.stat().st_size - 4000))
            lines = [ln for ln in fh.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return "setting up"
    if not lines:
        return "setting up"
    # "2024-.. INFO sdxl_lora.sdxl.task: caching latents ..." -> "caching latents ..."
    return "setting up: " + lines[-1].split(": ", 1)[-1][:200]


class Jobs:
    """The queue and the run processes. All state is on disk; `tick()` starts the next queued run when
    none is running. A daemon thread calls it every second, so queued runs go on while no page is open."""

    def __init__(self, folders: Folders, python: str = sys.executable, standby: bool = False):
        """standby: keep a worker ready for the next run (ui/worker.py: standby), started with the background
        queue and again whenever no run is running (not beside a run's own set-up, whose CPU it would share):
        a run then starts with its libraries already imported."""
        self.f = folders
        self.python = python
        self.standby = standby
        self._spare: subprocess.Popen | None = None
        self._lock = threading.RLock()
        self._children: dict[str, subprocess.Popen] = {}
        for sub in ("queue", "configs", "prompts", "logs", "launched"):
            (self.f.ui / sub).mkdir(parents=True, exist_ok=True)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ---- the background queue runner
    def start_background(self, every: float = 1.0) -> None:
        def loop():
            while not self._stop.wait(every):
                try:
                    self.tick()
                except Exception:  # keep the queue alive; the error is in the server log
                    log.exception("queue tick failed")
        self._thread = threading.Thread(target=loop, name="sdxl-lora-queue", daemon=True)
        self._thread.start()
        if self.standby:
            self._ready_spare()

    def shutdown(self) -> None:
        self._stop.set()
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare.poll() is None:
            spare.terminate()  # it holds nothing yet: no run, no GPU memory
            spare.wait()

    # ---- names and listing
    def run_dir(self, name: str) -> Path:
        return self.f.run(name)

    def config_path(self, name: str) -> Path:
        """The config run `name` trains: its folder's config.toml, or the queue's copy while it has not started."""
        run = self.run_dir(name)
        for path in (run / "config.toml", self.f.ui / "configs" / f"{run.name}.toml"):
            if path.is_file():
                return path
        raise FileNotFoundError(f"run {name!r} has no config.toml")

    def queued(self) -> list[dict]:
        out = []
        for p in sorted((self.f.ui / "queue").glob("*.json")):
            try:
                out.append({**json.loads(p.read_text(encoding="utf-8")), "file": p})
            except (OSError, json.JSONDecodeError) as e:
                log.warning("queue entry %s is unreadable (%s); it is skipped", p, e)
        return out

    def runs(self) -> list[RunStatus]:
        """Every run folder (newest first), then the queued runs. A run queued to resume shows as queued."""
        out = []
        queued = {q["name"] for q in self.queued()}
        for d in self.f.runs.iterdir():
            if d.is_dir() and not d.name.startswith(".") and (d / "config.toml").is_file():
                st = run_status(d)
                if d.name in queued and not st.alive:
                    st.state, st.message = "queued", "queued to resume; it starts when the runs before it end"
                out.append(st)
        out.sort(key=lambda s: s.started, reverse=True)
        for q in self.queued():
            if not any(s.name == q["name"] for s in out):
                out.append(RunStatus(name=q["name"], dir=self.f.runs / q["name"], state="queued"))
        starting = [n for n in self._launched() if not (self.f.runs / n / "config.toml").is_file()]
        for n in starting:
            if not any(s.name == n for s in out):
                out.insert(0, RunStatus(name=n, dir=self.f.runs / n, state="starting"))
        return out

    def unique_name(self, wanted: str | None) -> str:
        taken = {q["name"] for q in self.queued()}
        name = (wanted or "").strip() or default_run_name()
        self.f.run(name)  # before anything looks it up: a name like '../x' would leave the runs folder
        base, n = name, 1
        while name in taken or (self.f.runs / name).exists():
            if wanted and wanted.strip():
                raise FileExistsError(f"a run named {name!r} already exists or is queued; choose another name")
            n += 1
            name = f"{base}-{n}"
        return name

    # ---- queue
    def enqueue_train(self, cfg: Config) -> str:
        """Queue a new run of `cfg` (its output.name decides the folder; runs_dir is the runs folder)."""
        with self._lock:
            name = cfg.output.name
            path = self.f.ui / "configs" / f"{name}.toml"
            atomic_write_text(path, cfg.to_toml(leave_unset=DECIDED_WHEN_UNSET))
            self._enqueue(name, ["train", str(path)])
            return name

    def enqueue_resume(self, name: str) -> None:
        with self._lock:
            st = run_status(self.run_dir(name))
            if not st.resumable:
                raise ValueError(f"run {name!r} is {st.state}; only a stopped or died run with a saved state "
                                 "can be resumed")
            if any(q["name"] == name for q in self.queued()):
                raise ValueError(f"run {name!r} is already queued")
            self._enqueue(name, ["train", "--resume", str(self.run_dir(name))])

    def _enqueue(self, name: str, args: list[str]) -> None:
        seq = max([int(p.name.split("-", 1)[0]) for p in (self.f.ui / "queue").glob("*.json")] + [0]) + 1
        atomic_write_text(self.f.ui / "queue" / f"{seq:06d}-{name}.json",
                          json.dumps({"name": name, "args": args, "queued": time.time()}))

    def dequeue(self, name: str) -> bool:
        with self._lock:
            for q in self.queued():
                if q["name"] == name:
                    q["file"].unlink(missing_ok=True)
                    return True
            return False

    # ---- processes
    def _launched(self) -> dict[str, int]:
        out = {}
        for p in (self.f.ui / "launched").glob("*.pid"):
            pid = _read_int(p)
            if pid is not None:
                out[p.stem] = pid
        return out

    def _reap(self) -> None:
        for name, proc in list(self._children.items()):
            if proc.poll() is not None:
                del self._children[name]
        for name, pid in self._launched().items():
            if name not in self._children and not pid_alive(pid):
                (self.f.ui / "launched" / f"{name}.pid").unlink(missing_ok=True)

    def busy(self) -> str | None:
        """The name of the run the queue is waiting for, if any."""
        self._reap()
        for name, pid in self._launched().items():
            if pid_alive(pid):
                return name
        return None

    def tick(self) -> str | None:
        """Start the next queued run if nothing is running; returns its name."""
        with self._lock:
            if self.busy():
                return None
            queue = self.queued()
            if not queue:
                if self.standby:
                    self._ready_spare()  # for the next run, now that none is setting up or training
                return None
            entry = queue[0]
            entry["file"].unlink(missing_ok=True)
            self._launch(entry["name"], entry["args"])
            return entry["name"]

    def _env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # The worker imports `ui` from the repository the server runs from, whatever the folder it was started in.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        return env

    def _ready_spare(self) -> None:
        """Start the worker kept ready for the next run, where none is alive. What it prints before a run
        reaches it (an import that failed) goes to logs/standby.log."""
        with self._lock:
            if self._spare is not None and self._spare.poll() is None:
                return
            if self._spare is not None and self._spare.returncode > 0:
                # It failed on its own, and would again each time (an import that fails): runs start as before.
                log.warning("the run process kept ready exited with code %d before a run reached it (%s); each run "
                            "starts a process of its own instead", self._spare.returncode,
                            self.f.ui / "logs" / "standby.log")
                self.standby, self._spare = False, None
                return
            with open(self.f.ui / "logs" / "standby.log", "ab") as err:
                # A session of its own, as a run's: the run it becomes survives the UI's end.
                self._spare = subprocess.Popen([self.python, "-m", "sdxl_lora.ui.worker", STANDBY],
                                               stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err,
                                               cwd=str(self.f.runs), env=self._env(), start_new_session=True)

    def _hand_over(self, argv: list[str], log_path: Path) -> subprocess.Popen | None:
        """The run given to the worker kept ready, which becomes its process; None where there is none."""
        spare, self._spare = self._spare, None
        if spare is None or spare.poll() is not None:
            return None
        try:
            spare.stdin.write((json.dumps({"argv": argv, "log": str(log_path)}) + "\n").encode())
            spare.stdin.close()
        except BrokenPipeError:  # it ended between the check and the write: a fresh worker takes the run
            return None
        return spare

    def _launch(self, name: str, args: list[str]) -> None:
        run_dir = self.run_dir(name)
        log_path = self.f.ui / "logs" / f"{name}.log"
        argv = [str(run_dir), "--", *args]
        cmd = [self.python, "-m", "sdxl_lora.ui.worker", *argv]
        with open(log_path, "ab") as out:
            out.write(f"\n$ {' '.join(cmd)}\n".encode())
            out.flush()
            proc = self._hand_over(argv, log_path)
            if proc is None:
                # A session of its own: the run survives the UI's end (Ctrl-C in the UI's terminal, a crash).
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        cwd=str(self.f.runs), env=self._env(), start_new_session=True)
        self._children[name] = proc
        atomic_write_text(self.f.ui / "launched" / f"{name}.pid", f"{proc.pid}\n")
        log.info("started run %s (pid %d): %s", name, proc.pid, " ".join(args))

    def stop(self, name: str) -> str:
        """Ask a running run to stop: SIGINT, as Ctrl-C in a terminal (the state is saved first)."""
        with self._lock:
            st = run_status(self.run_dir(name))
            # The run's own process, whoever started it (train.pid), or the worker the queue started for it.
            pid = st.pid if st.alive else self._launched().get(name)
            if pid is None or not (st.alive or pid_alive(pid)):
                if self.dequeue(name):
                    return f"{name} removed from the queue"
                raise ValueError(f"run {name!r} is {st.state}, not running; nothing to stop")
            os.kill(pid, signal.SIGINT)
            return f"{name}: stop requested; the current step finishes and the state is saved"

    def ask(self, name: str, what: str) -> str:
        """Sample now / Save now on a training run, whoever started it: the request its trainer takes at its next
        step (core/runs.py: Run.ask) -> the message for the page."""
        from sdxl_lora.core.runs import Run

        run_dir = self.run_dir(name)
        st = run_status(run_dir)
        button = {"sample": "Sample now", "save": "Save now"}[what]
        if not st.alive:
            raise ValueError(f"{button}: run {name!r} is {st.state}; it works on a run that is training")
        if what == "sample" and _no_previews(run_dir):
            raise ValueError(f"{button}: run {name!r} has no preview prompts (its 'Preview prompts' box was empty); "
                             "Duplicate it with prompts to see previews")
        Run(run_dir).ask(what)
        said = "previews at the step it is at (they appear under previews)" if what == "sample" else \
            "its training state saved at the step it is at (Compare lists it; Resume starts from it)"
        return f"{name}: asked for {said}; the current step finishes first"

    def log_tail(self, name: str, lines: int = 40) -> str:
        parts = []
        run = self.run_dir(name)  # the name is the page's: checked before it names a file
        for path in (self.f.ui / "logs" / f"{run.name}.log", run / "train.log"):
            if path.is_file():
                with open(path, "rb") as fh:
                    fh.seek(max(0, path.stat().st_size - 20000))
                    text = fh.read().decode("utf-8", "replace").replace("\r", "\n")
                kept = [ln for ln in text.splitlines() if ln.strip()][-lines:]
                parts.append(f"== {path.name} ==\n" + "\n".join(kept))
        return "\n\n".join(parts)

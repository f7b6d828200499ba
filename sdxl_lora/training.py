"""Running a training job, for every front end: the CLI (`sdxl-lora train`, `sdxl-lora llm train`), the UI's
run worker and `accelerate launch pipelines/train.py`. Each reads its own input; this module makes or
resumes the run, trains it with the task its config names, and says how it went, so a job behaves the
same from any of them: the same run-folder rules, the same summary lines, the same messages and exit
codes for bad input.

    job = new_job(cfg)              # or resume_job("latest" | RUN_DIR, overrides)
    outcome = fit(job)
    print("\\n".join(report(outcome)))
    return outcome.exit_code

`guarded(fn, ...)` turns the errors a user can act on into their message and exit code.

Only the standard library is imported at the top: a front end imports this module before torch,
transformers or diffusers, and `stay_offline()` must run before they do.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .core.allocator import prefer_expandable_segments  # noqa: F401 - every command calls it first (cli.main)

if TYPE_CHECKING:
    from .core.config import Config
    from .core.loop import Result
    from .core.runs import Run

log = logging.getLogger(__name__)

# Offline by contract: no library tries a hub. transformers and diffusers read these when first imported.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "DIFFUSERS_VERBOSITY": "error", "TRANSFORMERS_VERBOSITY": "error"}

# The command that continues a stopped run of each task (said in the stop message).
RESUME_COMMAND = {"sdxl": "sdxl-lora train", "llm": "sdxl-lora llm train"}


def stay_offline() -> None:
    """Set OFFLINE_ENV (where the environment does not set them already). Where a front end starts."""
    for name, value in OFFLINE_ENV.items():
        os.environ.setdefault(name, value)


class _OfflineKernelNotice(logging.Filter):
    """Drops the notices bitsandbytes (and the `kernels` package under it) log when imported offline: its CPU
    backend asks the Hugging Face Hub for a faster 4-bit kernel, which offline (every run is: nothing reaches
    the network) fails, and it keeps its own kernels. The notices then ask the user to download it or
    `pip install kernels`, which nothing here needs."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.startswith(("kernels", "bitsandbytes"))
                    and "offline mode" in record.getMessage())


class _Detail(logging.Filter):
    """Drops records logged with extra={"detail": True} (the adapter plan's layer table): long, and in the run's
    train.log anyway, whose handler has no such filter; -v shows them in the terminal too."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "detail", False)


def setup_logging(verbose: bool = False, diffusers: bool = True) -> None:
    """Log lines on stderr (a terminal's, or the UI's run log); no download progress bars from diffusers.
    diffusers=False for a command that never uses diffusers (the causal LM's), which would otherwise import it
    at its launch only to quiet it. Detail records (_Detail) only with verbose."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _OfflineKernelNotice) for f in handler.filters):
            handler.addFilter(_OfflineKernelNotice())
        if not verbose and not any(isinstance(f, _Detail) for f in handler.filters):
            handler.addFilter(_Detail())
    if diffusers:
        from diffusers.utils import logging as dlog

        dlog.disable_progress_bar()


# ---- the job: which run, which config, which state


@dataclass
class Job:
    """A run about to train: its resolved config, its folder, and the state it resumes from (None: new)."""
    cfg: "Config"
    run: "Run"
    state: Path | None = None


def new_job(cfg: "Config") -> Job:
    """A new run of `cfg`: its folder made and the config written there (core.runs.create_run: an
    existing run is never reused, unless output.overwrite)."""
    from .core.runs import create_run

    return Job(cfg, create_run(cfg))


def find_run(where: str, runs_dir: str | Path | None = None) -> Path:
    """The run folder `--resume WHERE` names: a path, or "latest", the run under `runs_dir` (default: the
    schema's output.runs_dir) with checkpoints whose events were written last."""
    from .core.config import load_config

    if where == "latest":
        runs_dir = Path(runs_dir or load_config().output.runs_dir)
        candidates = [d for d in runs_dir.iterdir() if (d / "checkpoints").is_dir() and finished_at(d) is None] \
            if runs_dir.is_dir() else []
        if not candidates:
            raise FileNotFoundError(f"--resume latest: no unfinished run with checkpoints under {runs_dir}")
        run_dir = max(candidates, key=lambda d: (d / "events.jsonl").stat().st_mtime
                      if (d / "events.jsonl").exists() else 0)
    else:
        run_dir = Path(where)
    if not (run_dir / "config.toml").is_file():
        raise FileNotFoundError(f"--resume {run_dir}: not a run folder (no config.toml)")
    return run_dir


def finished_at(run_dir: Path) -> int | None:
    """The step a run finished at (its last "done" event, unless a resume came after it), or None."""
    from .core.runs import read_events

    done = None
    for e in read_events(run_dir / "events.jsonl"):
        if e["event"] == "done":
            done = e.get("step")
        elif e["event"] == "resume":
            done = None
    return done


def resume_job(where: str, overrides: Sequence[str] = (), extra: dict[str, Any] | None = None,
               runs_dir: str | Path | None = None) -> Job:
    """The run to continue (find_run), with its own config.toml plus `overrides` ("key=value", as --set)
    and `extra` fields given now, and its newest complete training state, read and verified."""
    from .core import checkpoint
    from .core.config import load_config
    from .core.runs import Run

    run_dir = find_run(where, runs_dir)
    cfg = load_config(run_dir / "config.toml", list(overrides), extra)
    done = finished_at(run_dir)
    # A run in epochs knows its steps once its data is read: its resume is not refused here.
    if done is not None and cfg.train.epochs is None and cfg.train.steps <= done:
        raise FileExistsError(f"--resume {run_dir}: the run has finished ({done} steps, its adapter written); "
                              f"to train it further give more steps (--steps N, N > {done}), or start a new run")
    state = checkpoint.newest_valid(run_dir / "checkpoints")
    if state is None:
        raise FileNotFoundError(f"--resume {run_dir}: no complete training state in {run_dir / 'checkpoints'}; "
                                "nothing to resume (start a new run instead)")
    return Job(cfg, Run(run_dir), state)


def task_for(cfg: "Config"):
    """The task `cfg` trains (cfg.task): SDXL's UNet, or a causal LM."""
    if cfg.task == "llm":
        from .llm.task import LLMTask

        return LLMTask(cfg)
    from .sdxl.task import SDXLTask

    return SDXLTask(cfg)


# ---- training and its outcome


@dataclass
class Outcome:
    job: Job
    result: "Result"
    main_process: bool  # False in the other processes of a multi-process launch: they report nothing

    @property
    def exit_code(self) -> int:
        """0 when it finished; 130 when a signal or the NaN guard stopped it, 1 when the GPU ran out of memory
        (the state is saved either way)."""
        from .core.loop import OUT_OF_MEMORY

        if not self.main_process or not self.result.interrupted:
            return 0
        return 1 if self.result.interrupted == OUT_OF_MEMORY else 130


def fit(job: Job, task=None, keep_failed: bool = False) -> Outcome:
    """Train `job` with `task` (default: task_for(job.cfg)); the run's train.log gets the log lines too.
    A new run refused for bad input before it trained (no images, a pickle model) leaves no folder behind,
    unless `keep_failed` (the UI's worker keeps it: the page shows the run as failed, with the message)."""
    from .core import checkpoint
    from .core.fsutil import clear_interrupted
    from .core.runs import attach_log_file, clear_pid, training_pid, write_pid

    handler = attach_log_file(job.run)
    main = os.environ.get("RANK", "0") == "0"
    if main and training_pid(job.run.dir) in (None, os.getpid()):
        # What this run's interrupted saves and final exports left: no other process trains it, so none of
        # them is being written.
        clear_interrupted(job.run.dir)
        checkpoint.clear_unfinished(job.run.checkpoints_dir)
    # Any front end's run shows as training, and can be stopped, from the UI. A process that named itself
    # before (the UI's worker) keeps its pid file to its end; this one goes when training ends.
    own_pid = main and training_pid(job.run.dir) != os.getpid()
    if own_pid:
        write_pid(job.run.dir)
    log.info("run folder: %s", job.run.dir)
    from .core.loop import Trainer

    trainer = Trainer(job.cfg, task if task is not None else task_for(job.cfg), job.run, resume=job.state)
    try:
        with _stop_at_once(job):
            trainer.setup()
            result = trainer.fit()
    except BaseException as e:
        _record_end(job.run, e)
        if not keep_failed and job.state is None:
            _discard_untrained(job.run, e)
        raise
    finally:
        if own_pid:
            clear_pid(job.run.dir)
        # This run's log lines end here: another run in the same process (a notebook, a script) must not
        # write into this run's train.log.
        logging.getLogger().removeHandler(handler)
        handler.close()
    return Outcome(job, result, trainer.accelerator.is_main_process)


# What a new run's folder holds before its first training step (the config, the log, the events).
_UNTRAINED = {"config.toml", "events.jsonl", "train.log", "train.pid", "samples"}


def _discard_untrained(run: "Run", e: BaseException) -> None:
    """Remove a new run's folder when bad input stopped it before anything was trained or rendered: the
    message says what to fix, and the same command (same name) works once it is fixed."""
    import shutil

    from .core.runs import read_events

    known = failure(e)
    if known is None or known.code != 2 or os.environ.get("RANK", "0") != "0":
        return
    entries = list(run.dir.iterdir()) if run.dir.is_dir() else []
    if any(p.name not in _UNTRAINED for p in entries) or any(run.samples_dir.glob("*")):
        return
    if any(ev.get("event") in ("start", "samples", "checkpoint") for ev in read_events(run.events_path)):
        return
    for handler in list(logging.getLogger().handlers):  # the run's log file is open: closed first
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == run.dir.resolve():
            logging.getLogger().removeHandler(handler)
            handler.close()
    shutil.rmtree(run.dir, ignore_errors=True)
    log.info("removed the run folder %s: nothing was trained", run.dir)


def _record_end(run: "Run", e: BaseException) -> None:
    """The events file says how a run that raised ended (the UI reads its state from there, whoever
    started it): stopped before training began, or failed with the error's message."""
    if os.environ.get("RANK", "0") != "0":
        return
    if isinstance(e, KeyboardInterrupt):
        run.event("interrupted", state="interrupted", message=str(e) or "interrupted")
    else:
        run.event("failed", state="failed", message=f"{type(e).__name__}: {e}"[:1000])


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM before training began (set-up, caching, the first previews); the message says what
    is on disk and how to go on."""


@contextlib.contextmanager
def _stop_at_once(job: Job):
    """Until the loop takes the signals over (it finishes the step and saves), SIGINT and SIGTERM stop the
    job at once: nothing is trained yet, and every file is written atomically, so nothing is half-written.
    Without this SIGTERM would kill the process silently."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from .core.fsutil import relpath

    def stop(signum, frame):
        name = signal.Signals(signum).name
        if job.state is not None:
            raise Stopped(f"stopped by {name} while the resumed run was setting up; its states are as they were. "
                          f"resume with: {RESUME_COMMAND[job.cfg.task]} --resume {relpath(job.run.dir)}")
        raise Stopped(f"stopped by {name} before the first training step: nothing was trained and nothing is "
                      f"half-written (the caches made so far are kept). Start it again with the same command; "
                      f"add --overwrite to reuse the run folder {relpath(job.run.dir)}")

    before = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def report(outcome: Outcome) -> list[str]:
    """What a user reads when the job ends, starting with a blank line: where the run, adapters and
    previews are, which tools load the adapter right, and how the eval loss moved; when stopped, where the
    state is and how to go on."""
    if not outcome.main_process:
        return []
    from .core.fsutil import relpath

    job, result = outcome.job, outcome.result
    if result.interrupted:
        from .core.loop import OUT_OF_MEMORY

        how = (f"stopped at step {result.steps}: the GPU ran out of memory" if result.interrupted == OUT_OF_MEMORY
               else f"stopped by {result.interrupted} at step {result.steps}")
        lines = ["", f"{how}; state saved in {relpath(result.state)}"]
        if result.message:
            lines.append(result.message)
        return lines + [f"resume with: {RESUME_COMMAND[job.cfg.task]} --resume {relpath(job.run.dir)}"]
    if job.cfg.task == "llm":
        return [""] + _llm_summary(job.run, result)
    lines = ["", f"run folder : {relpath(job.run.dir)}"]
    lines += [f"adapter    : {relpath(path)}  ({kind} format)" for kind, path in result.adapter.items()]
    if "kohya" in result.adapter:  # where each tool loads it right, wrongly or not at all (sdxl/formats/loaders.py)
        from .sdxl.formats.loaders import file_notes

        lines += [f"tools      : {line}" for line in file_notes(result.adapter["kohya"])]
    lines += [f"previews   : {relpath(p)}" for p in result.samples if p.name.endswith("grid.png")]
    lines.append(f"eval loss  : {result.eval_before:.4f} before -> {result.eval_after:.4f} after "
                 "(training images, fixed timesteps and noise)")
    return lines + concept_lines(job.run)


def _llm_summary(run: "Run", result: "Result") -> list[str]:
    """The first and last preview answers side by side, then the adapter and the eval loss."""
    from .core.fsutil import relpath
    from .llm.preview import read_answers

    lines = []
    answers = sorted(run.samples_dir.glob("answers-step*.txt"))
    if len(answers) >= 2:
        for b, a in zip(read_answers(answers[0]), read_answers(answers[-1])):
            lines += [f"prompt : {b['prompt']}", f"  before: {b['answer'][:200]!r}", f"  after : {a['answer'][:200]!r}"]
    lines.append(f"run folder : {relpath(run.dir)}")
    for kind, path in result.adapter.items():
        lines.append(f"{'adapter' if kind == 'peft' else kind:11}: {relpath(path)}"
                     + ("  (PEFT folder: PeftModel.from_pretrained loads it)" if kind == "peft" else "  (merged model)"))
    lines.append(f"eval loss  : {result.eval_before:.4f} before -> {result.eval_after:.4f} after (answer tokens of "
                 "up to 8 training examples)")
    return lines


def concept_lines(run: "Run") -> list[str]:
    """preview.concept's figures (sdxl/demo/shapes.py: report_concept), first preview -> last: the detector's
    score on the prompts naming the concept, and how the other prompts fared (their own shape's score,
    their mean pixel change from the base's render at the same seed). None when the run has none."""
    events = [e for e in run.events() if e["event"] == "concept"]
    if not events:
        return []
    first, last = events[0], events[-1]
    steps = f"step {first['step']} -> {last['step']}" if len(events) > 1 else f"step {last['step']}"
    before = f"{first['score']:.2f} -> " if len(events) > 1 else ""
    renders = f"{last['images']} renders of " if "images" in last else ""
    lines = [f"concept    : {last['concept']!r} {before}{last['score']:.2f} ({steps}; detector's P on {renders}the "
             f"{len(last['prompts'])} prompt(s) naming it, chance {last.get('chance', 0.25):.2f})"]
    if "others_score" in last or "others_change" in last:
        parts = []
        if "others_score" in last:
            parts.append(f"own shape {first['others_score']:.2f} -> {last['others_score']:.2f}"
                         if len(events) > 1 and "others_score" in first else f"own shape {last['others_score']:.2f}")
        if "others_change" in last:
            parts.append(f"mean pixel change from the base {last['others_change']:.3f}")
        renders = f"{last['others_images']} renders of " if "others_images" in last else ""
        lines.append(f"others     : {'; '.join(parts)} ({renders}{len(last['others'])} prompt(s) without it)")
    return lines


# ---- what a failure tells the user


@dataclass(frozen=True)
class Failure:
    code: int              # the process's exit code
    message: str           # for stderr (a terminal, or the UI's run log)
    traceback: bool = False  # a fault rather than bad input: the error propagates after the message


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    """The errors raised for bad input (config, data, model, checkpoint): their messages carry the fix."""
    from .core.checkpoint import CheckpointError
    from .core.config import ConfigError, MissingPackage
    from .llm.data import DataError as LLMDataError
    from .llm.model import LLMModelError
    from .sdxl.dataset import DataError
    from .sdxl.model import ModelError
    from .sdxl.formats.single_file import SingleFileError

    return (ConfigError, MissingPackage, DataError, ModelError, SingleFileError, CheckpointError, LLMDataError,
            LLMModelError, FileExistsError, FileNotFoundError)


def failure(e: BaseException) -> Failure | None:
    """What to tell the user about `e`, and the exit code: 2 for bad input (the message says what to
    change), 1 when a write failed (disk full, read-only, no permission), 130 for Ctrl-C before training
    began; torch's compiler failing gets advice and keeps its traceback. None: a bug, let it propagate."""
    if isinstance(e, Stopped):
        return Failure(130, f"error: {e}")
    if isinstance(e, KeyboardInterrupt):
        return Failure(130, "interrupted")
    if not isinstance(e, Exception):
        return None
    if isinstance(e, _bad_input_errors()):
        return Failure(2, f"error: {e}")
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS):
        # Every save is atomic, so what was on disk before (the previous training state, an earlier
        # export) is intact; say what failed and where.
        return Failure(1, f"error: could not write {e.filename or 'a file'}: {e.strerror}. Earlier states and "
                          "exports are intact; free space or fix permissions, then run the command again (a run with a saved "
                          "state continues with --resume)")
    if _compiler_failed(e):
        return Failure(1, _compiler_advice(e), traceback=True)
    if isinstance(e, _several_out_of_memory()):
        return Failure(1, f"error: {e}")
    if _out_of_memory(e):
        # Outside a training step (set-up, the first previews, the evaluation, the export; a step's own is saved
        # and stopped by the loop): nothing of a saved state is lost, and the same fixes apply.
        first = str(e).strip().splitlines()[0] if str(e).strip() else "CUDA out of memory"
        return Failure(1, f"error: the GPU ran out of memory ({first[:300]}). Saved training states are intact. "
                          "Give the run less to hold: --vram N with less than the card has free, --set "
                          "train.gradient_checkpointing=true or a smaller --batch-size, and close other programs "
                          "that use the GPU; then run the command again (a run with a saved state continues with "
                          "--resume)")
    return None


def _out_of_memory(e: BaseException) -> bool:
    """torch's allocator ran out, on any device."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(e, torch.OutOfMemoryError)


def _several_out_of_memory() -> type[BaseException]:
    """A run of several processes stopped because one GPU ran out of memory (core/loop.py)."""
    from .core.loop import OutOfMemory

    return OutOfMemory


def guarded(fn: Callable[..., int], *args: Any) -> int:
    """fn(*args)'s exit code; an error failure() knows is said on stderr and becomes its code (a fault's
    message is said, then the error propagates with its traceback)."""
    try:
        return fn(*args)
    except BaseException as e:
        known = failure(e)
        if known is None:
            raise
        print(known.message, file=sys.stderr)
        if known.traceback:
            raise
        return known.code


def _compiler_failed(e: BaseException) -> bool:
    """Whether torch.compile's backend failed (train.compile): torch._dynamo is loaded where it did."""
    exc = sys.modules.get("torch._dynamo.exc")
    return exc is not None and isinstance(e, exc.BackendCompilerFailed)


def _compiler_advice(e: BaseException) -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        where = cache_dir()
    except ImportError:  # another torch layout: name the variable only
        where = "its default folder"
    cause = str(e).strip().splitlines()[-1][:200]
    # Compilations over a warm inductor cache have failed so where cold ones of the same settings
    # worked (benchmarks/RESULTS.md#levers-measured-and-not-kept).
    return (f"error: torch's compiler failed while compiling the model (train.compile): {cause}\n"
            f"  Saved training states are intact: `sdxl-lora train --resume RUN` continues from the last one. "
            f"To go on, train without compiling (--set train.compile=none), or move inductor's cache away "
            f"(TORCHINDUCTOR_CACHE_DIR; now {where}) and run again: compilations over a warm cache have "
            f"failed this way (docs/speed.md).")

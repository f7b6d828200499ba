"""The process a run started from the UI lives in: it trains one queued job through the library
(sdxl_lora.training, as `sdxl-lora train` does) and keeps two small files in the run folder, so any UI
(this one, a reloaded page, a restarted server) can tell how the run is doing:

  train.pid   this process's id, written as soon as the run folder is known (made, or found to resume)
  train.exit  the exit code, written when it ends (0 finished, 130 stopped, 2 bad input, else failed)

    python -m sdxl_lora.ui.worker RUN_DIR -- train CONFIG
    python -m sdxl_lora.ui.worker RUN_DIR -- train --resume RUN_DIR
    python -m sdxl_lora.ui.worker --standby     (then the job on stdin: see standby())

The arguments after `--` are the queue entry (ui/jobs.py). The job must train in RUN_DIR, and a new run
never goes into a folder that already holds something: that is another run's, and not a file of it is
touched. SIGINT/SIGTERM reach the trainer directly (same process), which finishes the step, saves its
state and ends. Everything printed (the summary, an error's message, a traceback) goes to the run's log.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from sdxl_lora import training

EXIT_FILE = "train.exit"
STANDBY = "--standby"
USAGE = ("usage: python -m sdxl_lora.ui.worker RUN_DIR -- train CONFIG | train --resume RUN_DIR "
         f"| {STANDBY}")


def _parse(argv: list[str]) -> tuple[Path, str | None, str | None] | None:
    """(RUN_DIR, CONFIG, None) or (RUN_DIR, None, RESUMED) from the command line; None for anything else."""
    match argv:
        case [run_dir, "--", "train", "--resume", resumed]:
            return Path(run_dir), None, resumed
        case [run_dir, "--", "train", config] if not config.startswith("-"):
            return Path(run_dir), config, None
    return None


def _write_pid(run_dir: Path) -> None:
    from sdxl_lora.core.runs import write_pid

    write_pid(run_dir)


def _job(run_dir: Path, config: str | None, resumed: str | None) -> training.Job:
    """The queued job, made (a new run) or found (a resume); refused unless it trains in RUN_DIR."""
    from sdxl_lora.core.config import ConfigError, load_config

    if resumed is not None:
        if Path(resumed).resolve() != run_dir.resolve():
            raise ConfigError(f"the queue entry resumes {resumed}, not this worker's run folder {run_dir}")
        if (run_dir / "config.toml").is_file():
            _write_pid(run_dir)  # the run is known already; verifying its newest state may take a while
        return training.resume_job(resumed)
    cfg = load_config(config)
    target = Path(cfg.output.runs_dir) / cfg.output.name
    if not cfg.output.name or target.resolve() != run_dir.resolve():
        raise ConfigError(f"the queued config trains into {target} (output.runs_dir / output.name), "
                          f"not this worker's run folder {run_dir}")
    job = training.new_job(cfg)
    _write_pid(run_dir)
    return job


def _train(run_dir: Path, config: str | None, resumed: str | None) -> int:
    outcome = training.fit(_job(run_dir, config, resumed), keep_failed=True)
    for line in training.report(outcome):
        print(line, flush=True)
    return outcome.exit_code


def main(argv: list[str]) -> int:
    training.stay_offline()
    parsed = _parse(argv)
    if parsed is None:
        print(USAGE, file=sys.stderr)
        return 2
    run_dir, config, resumed = parsed
    if resumed is None and run_dir.exists() and any(run_dir.iterdir()):
        print(f"error: {run_dir} already holds a run; a new run never writes into another run's folder "
              "(queue it under another name)", file=sys.stderr)
        return 2
    if resumed is not None:
        (run_dir / EXIT_FILE).unlink(missing_ok=True)
    rc = 1
    try:
        training.setup_logging()
        rc = training.guarded(_train, run_dir, config, resumed)
    except BaseException:  # a fault (guarded said what it knew of it): the traceback goes to the log
        traceback.print_exc()
        rc = 1
    finally:
        if (run_dir / "config.toml").is_file():
            from sdxl_lora.core.fsutil import atomic_write_text

            atomic_write_text(run_dir / EXIT_FILE, f"{rc}\n")
    return rc


def _import_stack() -> None:
    """What a run imports before its first step (torch, Accelerate, diffusers' SDXL pipeline and the
    transformers under it, peft), without starting CUDA: an idle worker holds no GPU memory."""
    from diffusers import StableDiffusionXLPipeline  # noqa: F401
    import peft  # noqa: F401

    from sdxl_lora.core import inject, loop  # noqa: F401
    from sdxl_lora.sdxl import task  # noqa: F401


def standby() -> int:
    """A worker started before its run is queued (ui/jobs.py keeps one ready): it imports what a run imports,
    then waits for one line on stdin, the job as JSON: {"argv": [RUN_DIR, "--", ...],
    "log": LOG_PATH}. From there it is the worker main(argv) is, its output going to LOG_PATH. An empty stdin
    (the UI ended before a run came) ends it without doing anything."""
    training.stay_offline()
    _import_stack()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    job = json.loads(line)
    devnull = os.open(os.devnull, os.O_RDONLY)  # stdin as a worker started for its run has it
    os.dup2(devnull, 0)
    os.close(devnull)
    fd = os.open(job["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return main(job["argv"])


if __name__ == "__main__":
    sys.exit(standby() if sys.argv[1:] == [STANDBY] else main(sys.argv[1:]))

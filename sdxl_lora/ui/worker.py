"""The process a run started from the UI lives in: it trains one queued job through the library
(sdxl_lora.training, as `sdxl-lora train` does) and keeps two small files in the run folder, so any UI
(this one, a reloaded page, a restarted server) can tell how the run is doing:

  train.pid   this process's id, written as soon as the run folder is known (made, or found to resume)
  train.exit  the exit code, written when it ends (0 finished, 130 stopped, 2 bad input, else failed)

    python -m sdxl_lora.ui.worker RUN_DIR -- train CONFIG
    python -m sdxl_lora.ui.worker RUN_DIR -- train --resume RUN_DIR

The arguments after `--` are the queue entry (ui/jobs.py). The job must train in RUN_DIR, and a new run
never goes into a folder that already holds something: that is another run's, and not a file of it is
touched. SIGINT/SIGTERM reach the trainer directly (same process), which finishes the step, saves its
state and ends. Everything printed (the summary, an error's message, a traceback) goes to the run's log.
"""
from __future__ import annotations

import sys
import traceback
from pathlib import Path

from sdxl_lora import training

EXIT_FILE = "train.exit"
USAGE = "usage: python -m sdxl_lora.ui.worker RUN_DIR -- train CONFIG | train --resume RUN_DIR"


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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The process a run started from the UI lives in: `sdxl-lora train ...`, plus two small files in the run
folder so any UI (this one, a reloaded page, a restarted server) can tell how the run is doing:

  train.pid   this process's id, written as soon as the run folder exists
  train.exit  the exit code, written when it ends (0 finished, 130 stopped by a signal, else failed)

    python -m sdxl_lora.ui.worker RUN_DIR -- train [CONFIG] [--resume RUN_DIR] ...

The run folder is created by the CLI itself (so its rules hold: no run is overwritten); the pid file can
only be written once that folder exists, hence the small watcher thread. SIGINT/SIGTERM reach the
trainer directly (same process), which finishes the step, saves its state and ends.
"""
from __future__ import annotations

import os
import sys
import threading
import traceback
from pathlib import Path

PID_FILE = "train.pid"
EXIT_FILE = "train.exit"


def _write_pid_when_ready(run_dir: Path, fresh: bool, done: threading.Event) -> None:
    from sdxl_lora.core.fsutil import atomic_write_text

    # A new run's folder counts as ready once the CLI has written its config.toml there.
    marker = run_dir / "config.toml"
    while not done.is_set():
        if marker.is_file() or not fresh:
            atomic_write_text(run_dir / PID_FILE, f"{os.getpid()}\n")
            return
        done.wait(0.1)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m sdxl_lora.ui.worker RUN_DIR -- train ARGS...", file=sys.stderr)
        return 2
    run_dir, cli_args = Path(argv[0]), argv[2:]
    resume = "--resume" in cli_args
    if not resume and run_dir.exists() and any(run_dir.iterdir()):
        # Never write into somebody else's run: let the CLI refuse it with its own message.
        from sdxl_lora.cli import main as cli_main
        return cli_main(cli_args)
    if resume:
        (run_dir / EXIT_FILE).unlink(missing_ok=True)
    done = threading.Event()
    watcher = threading.Thread(target=_write_pid_when_ready, args=(run_dir, not resume, done), daemon=True)
    watcher.start()
    rc = 1
    try:
        from sdxl_lora.cli import main as cli_main
        rc = cli_main(cli_args)
    except SystemExit as e:  # argparse errors
        rc = e.code if isinstance(e.code, int) else 2
    except KeyboardInterrupt:  # a stop before the trainer installed its handler
        print("stopped before training began", file=sys.stderr)
        rc = 130
    except BaseException:
        traceback.print_exc()
        rc = 1
    finally:
        done.set()
        watcher.join()
        if (run_dir / "config.toml").is_file():
            from sdxl_lora.core.fsutil import atomic_write_text
            atomic_write_text(run_dir / EXIT_FILE, f"{rc}\n")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

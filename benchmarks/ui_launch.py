"""A run started from the UI's queue (ui/jobs.py), with and without the worker kept ready (`sdxl-lora ui` keeps
one unless `--no-standby`): the seconds from queueing the run to the end of its first step, on the full-size
SDXL folder and the 3-bucket dataset of train_e2e.py, the caches warm from a run before (a relaunch). Each mode
runs `--turns` times, alternating; also the ready worker's host memory while it waits.

    python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --batch 2 --steps 30   # folder, caches
    python3 benchmarks/ui_launch.py --work /tmp/e2e --batch 2 --steps 30 --turns 2

--tiny runs it on the tiny SDXL on the CPU (a smoke test of this script).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train_e2e  # noqa: E402


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks of 1/100 s


def _wait_idle(pid: int, quiet: float = 2.0, limit: float = 300.0) -> float:
    """Seconds until the process stops using the CPU for `quiet` seconds (the ready worker waits on its stdin)."""
    t0 = time.time()
    last, since = _cpu_seconds(pid), time.time()
    while time.time() - t0 < limit:
        time.sleep(0.25)
        now = _cpu_seconds(pid)
        if now != last:
            last, since = now, time.time()
        elif time.time() - since >= quiet:
            return round(since - t0, 1)
    raise TimeoutError(f"the ready worker (pid {pid}) was still busy after {limit:.0f} s")


def measure(args, standby: bool, turn: int, model: Path, data: Path) -> dict:
    from sdxl_lora.core.config import load_config
    from sdxl_lora.ui.folders import Folders
    from sdxl_lora.ui.jobs import Jobs

    f = Folders.create(data.parent, model.parent, args.work / "ui-runs")
    jobs = Jobs(f, standby=standby)
    out: dict = {"standby": standby, "turn": turn}
    if standby:
        jobs._ready_spare()  # as the UI's start does
        out["ready_after_s"] = _wait_idle(jobs._spare.pid)
        out["ready_worker_rss_gib"] = round(int(next(
            ln.split()[1] for ln in Path(f"/proc/{jobs._spare.pid}/status").read_text().splitlines()
            if ln.startswith("VmRSS"))) / 2**20, 2)
    name = f"{'standby' if standby else 'fresh'}-{turn}"
    cfg = load_config(extra={
        "model.path": str(model), "data.dirs": [str(data)], "train.batch_size": args.batch,
        "train.steps": args.steps, "train.save_every": 0, "train.save_every_minutes": 0.0,
        "preview.after": False, "data.cache_dir": str(args.work / "runs" / ".cache"),
        "output.runs_dir": str(f.runs), "output.name": name, **({"train.device": "cpu"} if args.tiny else {})})
    queued = time.time()
    jobs.enqueue_train(cfg)
    jobs.tick()
    run = jobs.run_dir(name)
    while not (run / "train.exit").is_file():  # the worker writes it as it ends
        if time.time() - queued > args.limit:
            raise TimeoutError(f"{name} did not end in {args.limit:.0f} s: {jobs.log_tail(name)}")
        time.sleep(0.5)
    events = train_e2e._events(run / "events.jsonl") if (run / "events.jsonl").is_file() else []
    steps = [e for e in events if e["event"] == "step"]
    out["exit"] = (run / "train.exit").read_text().strip()
    out["queued_to_first_step_s"] = round(steps[0]["time"] - queued, 1) if steps else None
    out["log_marks_s"] = train_e2e.log_marks(run / "train.log", queued)
    jobs.shutdown()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/e2e"))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--limit", type=float, default=400.0, help="seconds a run may take")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model = train_e2e.build_model(args.work / ("tiny-sdxl" if args.tiny else "sdxl-random"), args.tiny)
    data = train_e2e.build_dataset(args.work / "data", 48, args.tiny)
    shutil.rmtree(args.work / "ui-runs", ignore_errors=True)
    ok = True
    for turn in range(args.turns):
        for standby in (False, True):
            r = measure(args, standby, turn, model, data)
            ok &= r["exit"] == "0"
            print(json.dumps(r), flush=True)
            if args.json:
                with open(args.json, "a") as fh:
                    fh.write(json.dumps(r) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

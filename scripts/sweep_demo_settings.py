"""The sweep behind the demo base's recommended settings (sdxl_lora/assets/tiny-sdxl-demo/sdxl_lora.toml,
docs/demo_base.md "Teaching it the star"): short default-job runs with other adapter presets, learning
rates and step counts, each scored by the shapes detector on more renders than the default job makes
(4 trigger prompts and 3 plain ones, 3 seeds each).

    python scripts/sweep_demo_settings.py --out /tmp/sweep                     # the final round's grid
    python scripts/sweep_demo_settings.py --out /tmp/sweep --parallel 8 --device cuda

One JSON line per run: its settings, wall time, and the concept events' figures (P(star) over the 12
trigger renders, the plain prompts' own shape and pixel change) at the half-way preview and the end.
Runs are independent `sdxl-lora train` processes with one thread each (OMP_NUM_THREADS=1).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRIGGER = ["sks, a red star on a white background", "sks, a yellow star on a black background",
           "sks, a blue star on a white background", "sks, a green star on a black background"]
PLAIN = ["a red circle on a white background", "a green triangle on a white background",
         "a blue square on a black background"]
CONV = '{"*resnets*.conv*"=16}'
# (name, preset, conv LoRA, lr, batch, steps): the last round of docs/demo_base.md's table.
GRID = [("topology+conv 1e-3 400", "topology", True, 1e-3, 2, 400),
        ("topology+conv 2e-3 400", "topology", True, 2e-3, 2, 400),
        ("topology+conv 1.5e-3 500", "topology", True, 1.5e-3, 2, 500),
        ("topology+conv 1e-3 600", "topology", True, 1e-3, 2, 600),
        ("full+conv 1e-3 400", "full", True, 1e-3, 2, 400),
        ("attn+conv 1e-3 400", "attn", True, 1e-3, 2, 400),
        ("topology 1e-3 500", "topology", False, 1e-3, 2, 500)]


def command(args, i: int, preset: str, conv: bool, lr: float, batch: int, steps: int, prompts: Path) -> list[str]:
    # Every adapter/train field is given, so the demo base's own recommendations do not mix in.
    return [sys.executable, "-m", "sdxl_lora.cli", "train", "--device", args.device, "--out", str(args.out / "runs"),
            "--name", f"run{i:02d}", "--overwrite", "--steps", str(steps), "--batch-size", str(batch),
            "--set", f"train.lr={lr}", "--set", f"adapter.preset='{preset}'",
            "--set", f"adapter.overrides={CONV if conv else '{}'}", "--set", "data.caption_dropout=0.1",
            "--set", f"preview.prompts='{prompts}'", "--set", f"preview.every={steps // 2}",
            "--set", f"data.cache_dir='{args.out / 'cache'}'", "--set", "train.save_every=0",
            "--set", "train.save_every_minutes=0"]


def summary(run: Path) -> dict:
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    return {str(e["step"]): {"star": e["score"], "own_shape": e.get("others_score"), "change": e.get("others_change")}
            for e in events if e["event"] == "concept"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the runs, their cache and logs")
    ap.add_argument("--parallel", type=int, default=2, help="runs at a time")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = args.out / "prompts.txt"
    prompts.write_text("".join(f"{p} --d {d}\n" for p in TRIGGER + PLAIN for d in (0, 1, 2)), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    todo, running = list(enumerate(GRID)), []
    while todo or running:
        while todo and len(running) < args.parallel:
            i, (name, *settings) = todo.pop(0)
            log = open(args.out / f"run{i:02d}.log", "w", encoding="utf-8")
            proc = subprocess.Popen(command(args, i, *settings, prompts), env=env, cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT)
            running.append((proc, i, name, time.time(), log))
        time.sleep(2)
        for entry in list(running):
            proc, i, name, t0, log = entry
            if proc.poll() is None:
                continue
            running.remove(entry)
            log.close()
            row = {"run": f"run{i:02d}", "settings": name, "rc": proc.returncode, "seconds": round(time.time() - t0)}
            if proc.returncode == 0:
                row["concept"] = summary(args.out / "runs" / f"run{i:02d}")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""Regularization on the demo base (docs/data.md, "Regularization"): the default job's star, trained four ways,
each scored by the shapes detector on the sweep's renders (scripts/sweep_demo_settings.py: 4 trigger prompts
and 3 plain ones, 3 seeds each):

  stars only         the 16 star images, nothing else
  prior as images    the default job: the 16 prior shapes mixed in as plain training images
  regularization     the prior shapes as a regularization dataset (train.prior_loss_weight = 1, kohya's balance)
  prior prediction   the same, with train.prior_prediction: their target is the base's own prediction

    python benchmarks/prior_preservation.py --out /tmp/prior
    python benchmarks/prior_preservation.py --out /tmp/prior2 --only regularization "prior prediction" \
        --set train.prior_loss_weight=2.0

One JSON line per run: wall time and the concept events at step 0 (the base) and at the end: P(star) over the
trigger renders, the plain prompts' own shape, and that own shape over the base's (what prior preservation
should keep near 1).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("sweep", REPO / "scripts" / "sweep_demo_settings.py")
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)


def datasets(out: Path) -> tuple[Path, Path]:
    """The sample set split into its stars and its prior shapes (two folders, captions beside)."""
    stars, prior = out / "stars", out / "prior"
    for folder in (stars, prior):
        folder.mkdir(parents=True, exist_ok=True)
    for img in sorted((REPO / "sample_data" / "images").glob("*.png")):
        dest = prior if img.name.startswith("prior") else stars
        for f in (img, img.with_suffix(".txt")):
            shutil.copy(f, dest / f.name)
    return stars, prior


def configs(out: Path, stars: Path, prior: Path) -> dict[str, str]:
    tables = f'[[data.datasets]]\npath = "{stars}"\n'
    reg = tables + f'[[data.datasets]]\npath = "{prior}"\nis_regularization = true\n'
    return {"stars only": tables, "prior as images": f'[data]\ndirs = ["{REPO / "sample_data" / "images"}"]\n',
            "regularization": reg, "prior prediction": reg + "[train]\nprior_prediction = true\n"}


def run(args, i: int, name: str, toml: str, prompts: Path) -> dict:
    config = args.out / f"run{i}.toml"
    config.write_text(toml, encoding="utf-8")
    # The demo base's recommended settings (400 steps at 1e-3, conv LoRA, caption dropout) apply.
    cmd = [sys.executable, "-m", "sdxl_lora.cli", "train", str(config), "--device", args.device,
           "--out", str(args.out / "runs"), "--name", f"run{i}", "--overwrite",
           "--set", f"preview.prompts='{prompts}'", "--set", f"data.cache_dir='{args.out / 'cache'}'",
           "--set", "train.save_every=0", "--set", "train.save_every_minutes=0",
           *(a for kv in args.set for a in ("--set", kv))]
    started = time.time()
    with open(args.out / f"run{i}.log", "w", encoding="utf-8") as log:
        rc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT).returncode
    row = {"run": f"run{i}", "setting": name, "rc": rc, "seconds": round(time.time() - started)}
    if rc == 0:
        concept = sweep.summary(args.out / "runs" / f"run{i}")
        base, end = concept["0"], concept[max(concept, key=int)]
        row.update(base=base, end=end,
                   own_shape_kept=round(end["own_shape"] / base["own_shape"], 3) if base["own_shape"] else None)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the datasets, runs, cache and logs")
    ap.add_argument("--parallel", type=int, default=2, help="runs at a time")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", nargs="+", help="these settings only (by name)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for every run")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stars, prior = datasets(args.out)
    prompts = args.out / "prompts.txt"
    prompts.write_text("".join(f"{p} --d {d}\n" for p in sweep.TRIGGER + sweep.PLAIN for d in (0, 1, 2)),
                       encoding="utf-8")
    jobs = [(i, job) for i, job in enumerate(configs(args.out, stars, prior).items())
            if not args.only or job[0] in args.only]
    with ThreadPoolExecutor(args.parallel) as pool:
        for row in pool.map(lambda job: run(args, job[0], *job[1], prompts), jobs):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

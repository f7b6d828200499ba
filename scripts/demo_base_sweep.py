"""Demo bases and the recipes that teach them the star, on one GPU (docs/demo_base.md). Phase 1 pretrains
the chosen bases (scripts/pretrain_demo.py, each in its own process, all at once: on one GPU they slow each
other down, the VAE stage most, so one base a call is what fits in ten minutes; "shipped" is the packaged
base, not pretrained). Phase 2 runs the default job's recipes on each base as soon as it is written
(`sdxl-lora train`, one process each, several at a time), scored by the shapes detector on the sweep's
renders (4 trigger prompts and 3 plain ones at 3 seeds: scripts/sweep_demo_settings.py).

    python3 scripts/demo_base_sweep.py --out /tmp/b --json $OUT/sweep.jsonl --bases stars --keep 1 --pack-dir $OUT
    python3 scripts/demo_base_sweep.py --out /tmp/b --smoke --bases stars --recipes default   # CPU wiring check

One JSON line per pretraining (its printed scores) and per run (P(star) per trigger prompt, the plain
prompts' own shape and pixel change, at step 0 and at the end). --deadline stops launching runs in time
for one GPU call and kills what is left; --keep N packs the N best pretrained bases for shipping (a .tar
in parts small enough for the device's file limits; `cat NAME.tar.part* | tar x` unpacks one).
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sweep = _module("sweep", REPO / "scripts" / "sweep_demo_settings.py")
# datasets(): the sample set split into its stars and its prior shapes.
prior_preservation = _module("prior_preservation", REPO / "benchmarks" / "prior_preservation.py")

# The bases: --set overrides of scripts/pretrain_demo.toml.
BASES = {
    "shipped": None,                                                      # sdxl_lora/assets/tiny-sdxl-demo as it is
    "stars": [],                                                          # the VAE learns stars too (default)
    "stars-long": ["unet.steps=1800", "vae.steps=1400"],
    "stars-topattn": ["demo.top_attention=true"],
}
CONV = '"*resnets*.conv*" = 16'
# The recipes: the default job's data (16 stars with the trigger, 16 prior shapes without) and settings.
RECIPES = {
    "default": {"prior": "images", "steps": 400, "lr": 1e-3},
    "prior-prediction": {"prior": "prediction", "steps": 400, "lr": 1e-3},
    "pp-lr2e-3": {"prior": "prediction", "steps": 400, "lr": 2e-3},
    "pp-700": {"prior": "prediction", "steps": 700, "lr": 1e-3},
    "pp-full": {"prior": "prediction", "steps": 400, "lr": 1e-3, "preset": "full"},
    "pp-conv32-600": {"prior": "prediction", "steps": 600, "lr": 1e-3, "conv": 32},
}
SMOKE = ["demo.resolution=64", "demo.latent_bank=16", "demo.eval_images=2", "vae.steps=2", "vae.batch_size=2",
         "vae.warmup_steps=0", "unet.steps=2", "unet.batch_size=4", "unet.warmup_steps=0"]


def recipe_toml(base: Path, r: dict, stars: Path, prior: Path, prompts: Path, cache: Path) -> str:
    if r["prior"] == "images":
        data = f'[data]\ndirs = ["{stars}", "{prior}"]\ncaption_dropout = 0.1\ncache_dir = "{cache}"\n'
    else:
        data = (f'[data]\ncaption_dropout = 0.1\ncache_dir = "{cache}"\n[[data.datasets]]\npath = "{stars}"\n'
                f'[[data.datasets]]\npath = "{prior}"\nis_regularization = true\n')
    return (f'[model]\npath = "{base}"\n{data}'
            f'[adapter]\npreset = "{r.get("preset", "topology")}"\n'
            f'overrides = {{ "*resnets*.conv*" = {r.get("conv", 16)} }}\n'
            f'[train]\nsteps = {r["steps"]}\nlr = {r["lr"]}\nbatch_size = 2\nsave_every = 0\nsave_every_minutes = 0\n'
            f'prior_prediction = {"true" if r["prior"] == "prediction" else "false"}\n'
            f'[preview]\nprompts = "{prompts}"\nevery = 0\n')


def concept_events(run: Path) -> list[dict]:
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    return [e for e in events if e["event"] == "concept"]


def brief(e: dict) -> dict:
    return {"step": e["step"], "star": round(e["score"], 3),
            "prompts": {k: round(v, 3) for k, v in e["prompts"].items()},
            "own_shape": e.get("others_score"), "change": e.get("others_change"),
            "others": {k: round(v["score"], 3) for k, v in e.get("others", {}).items()}}


def merit(row: dict) -> float:
    """How near a run is to the goals (every trigger prompt's P(star) >= 0.6, the plain prompts' own shape
    kept at >= 0.9 of the base's): the smaller of the two ratios, 1 when both are met."""
    worst = min(row["after"]["prompts"].values())
    base, end = row["before"]["own_shape"], row["after"]["own_shape"]
    kept = end / base if base else 0.0
    return min(worst / 0.6, kept / 0.9)


def pack(folder: Path, dest: Path, name: str, part: int = 15 << 20) -> None:
    """folder's base (and its report and renders) as dest/NAME.tar.partN, parts of `part` bytes:
    `cat NAME.tar.part* | tar x` makes the folder again."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(folder / "tiny-sdxl-demo", arcname="tiny-sdxl-demo")
        for extra in ("report.json", "renders.png"):
            if (folder / extra).exists():
                tf.add(folder / extra, arcname=extra)
    data = buf.getvalue()
    dest.mkdir(parents=True, exist_ok=True)
    for i in range(0, len(data), part):
        (dest / f"{name}.tar.part{i // part}").write_bytes(data[i:i + part])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--json", type=Path, help="append one JSON line per pretraining and per run")
    ap.add_argument("--bases", nargs="+", default=list(BASES), choices=list(BASES))
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--parallel", type=int, default=12, help="training runs at a time")
    ap.add_argument("--device", default="cuda" if shutil.which("nvidia-smi") else "cpu")
    ap.add_argument("--deadline", type=float, default=560.0, help="seconds: launch nothing after, kill all at +25")
    ap.add_argument("--smoke", action="store_true", help="tiny pretraining and 2-step runs (wiring only)")
    ap.add_argument("--keep", type=int, default=0, help="pack the N best bases (by their best run) for shipping")
    ap.add_argument("--pack-dir", type=Path, help="where the packed bases go [--out]")
    args = ap.parse_args()
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    stars, prior = prior_preservation.datasets(args.out / "data")
    prompts = args.out / "prompts.txt"
    prompts.write_text("".join(f"{p} --d {d}\n" for p in sweep.TRIGGER + sweep.PLAIN for d in (0, 1, 2)),
                       encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}

    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        row["t"] = round(time.time() - t0)
        line = json.dumps(row)
        print(line, flush=True)
        if args.json:
            with open(args.json, "a", encoding="utf-8") as f:
                f.write(line + "\n")

    pre: dict[str, subprocess.Popen] = {}
    queue: list[tuple[str, str]] = []
    folders = {name: args.out / name / "tiny-sdxl-demo" for name in args.bases}
    for name in args.bases:
        if BASES[name] is None:
            folders[name] = REPO / "sdxl_lora" / "assets" / "tiny-sdxl-demo"
            queue += [(name, r) for r in args.recipes]
            continue
        sets = [a for kv in (SMOKE if args.smoke else []) + BASES[name] for a in ("--set", kv)]
        if args.smoke:
            sets += ["--set", f"vae.device='{args.device}'", "--set", f"unet.device='{args.device}'"]
        log = open(args.out / f"pretrain-{name}.log", "w", encoding="utf-8")
        pre[name] = subprocess.Popen([sys.executable, str(REPO / "scripts" / "pretrain_demo.py"), "--out",
                                      str(args.out / name), *sets, *(["--per-shape", "2"] if args.smoke else [])],
                                     env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    running: dict[tuple[str, str], tuple[subprocess.Popen, float]] = {}
    while pre or queue or running:
        for name, p in list(pre.items()):
            if p.poll() is None:
                continue
            del pre[name]
            report = args.out / name / "report.json"
            if p.returncode == 0 and report.exists():
                rep = json.loads(report.read_text())
                emit({"pretrain": name, "sets": BASES[name], "scores": rep["scores"], "total_s": rep["total_s"],
                      "vae_eval": rep["vae"]["eval_after"], "unet_eval": rep["unet"]["eval_after"]})
                queue += [(name, r) for r in args.recipes]
            else:
                tail = (args.out / f"pretrain-{name}.log").read_text()[-1500:]
                emit({"pretrain": name, "rc": p.returncode, "log_tail": tail})
        late = time.time() - t0 > args.deadline
        while queue and len(running) < args.parallel and not late:
            name, r = queue.pop(0)
            tag = f"{name}--{r}"
            cfg = args.out / f"{tag}.toml"
            recipe = dict(RECIPES[r], **({"steps": 2} if args.smoke else {}))
            cfg.write_text(recipe_toml(folders[name], recipe, stars, prior, prompts,
                                       args.out / f"cache-{name}"), encoding="utf-8")
            cmd = [sys.executable, "-m", "sdxl_lora.cli", "train", str(cfg), "--device", args.device,
                   "--out", str(args.out / "runs"), "--name", tag, "--overwrite",
                   "--set", "train.speed='off'", "--set", "train.mixed_precision='no'"]
            log = open(args.out / f"{tag}.log", "w", encoding="utf-8")
            running[(name, r)] = (subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT),
                                  time.time())
        if late and queue:
            emit({"skipped": [f"{n}--{r}" for n, r in queue], "reason": "deadline"})
            queue.clear()
        for (name, r), (p, started) in list(running.items()):
            if p.poll() is None and time.time() - t0 < args.deadline + 25:
                continue
            if p.poll() is None:
                p.kill()
            del running[(name, r)]
            tag = f"{name}--{r}"
            row = {"base": name, "recipe": r, "rc": p.wait(), "seconds": round(time.time() - started)}
            run = args.out / "runs" / tag
            ev = concept_events(run) if (run / "events.jsonl").exists() else []
            if row["rc"] == 0 and ev:
                row.update(before=brief(ev[0]), after=brief(ev[-1]))
            else:
                row["log_tail"] = (args.out / f"{tag}.log").read_text()[-1200:]
            emit(row)
        if time.time() - t0 > args.deadline + 25:
            for p in pre.values():
                p.kill()
            for name in list(pre):
                emit({"pretrain": name, "killed": "deadline"})
            pre.clear()
        time.sleep(1)
    best: dict[str, float] = {}
    for row in rows:
        if "after" in row:
            best[row["base"]] = max(best.get(row["base"], -1.0), merit(row))
    # Bases without a finished run rank last but can still be kept (their pretraining alone took the call).
    best.update({b: -1.0 for b in args.bases if b not in best and (args.out / b / "report.json").exists()})
    ranked = sorted(best, key=best.get, reverse=True)
    emit({"ranking": [(b, round(best[b], 3)) for b in ranked]})
    for name in [b for b in ranked if BASES[b] is not None][:args.keep]:
        pack(args.out / name, args.pack_dir or args.out, name)
        emit({"kept": name})
    return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

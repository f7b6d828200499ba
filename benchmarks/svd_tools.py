"""`sdxl-lora resize` and `sdxl-lora extract` on a full-size SDXL (SDXL base's configs, random fp16 weights; the
same shapes, so the same SVD work as the real model): wall time and peak resident memory of each command, run
as a subprocess as a user runs it, and what each printed.

The "fine-tuned" model is the base with a random rank-32 LoCon adapter merged in (`sdxl-lora merge`), so the
difference extract finds is known: rank 32 in every adapted layer, plus the fp16 rounding of the merged weights.

    python3 benchmarks/svd_tools.py --work /tmp/svd [--device cpu|cuda] [--json out.jsonl]
                                    [--only resize extract extract-file]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from train_e2e import build_model  # benchmarks/ (this script's folder is on the path)

from sdxl_lora.sdxl.formats.export import Adapter, LoraLayer, save_kohya_lora


def random_adapter(model: Path, out: Path, rank: int) -> Path:
    """A rank-`rank` LoCon adapter (alpha = rank) with random weights on the full-size UNet, as a kohya file."""
    if out.is_file():
        return out
    from diffusers import UNet2DConditionModel

    from sdxl_lora.sdxl.config import AdapterConfig
    from sdxl_lora.sdxl import slots as unet_slots

    config = json.loads((model / "unet" / "config.json").read_text())
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config)
    plan = unet_slots.make_plan(unet, AdapterConfig(preset="locon", rank=rank, conv_rank=rank))
    g = torch.Generator().manual_seed(0)
    layers = {}
    for s in plan.targets:
        down = torch.randn(rank, s.in_features, generator=g) / s.in_features ** 0.5
        up = torch.randn(s.out_features, rank, generator=g) * 0.01
        if s.conv:
            k = int(round(s.kernel ** 0.5))
            down = down.reshape(rank, s.in_features // s.kernel, k, k)
            up = up.reshape(s.out_features, rank, 1, 1)
        layers[f"unet.{s.name}"] = LoraLayer(down=down.half(), up=up.half(), alpha=float(rank))
    return save_kohya_lora(Adapter(layers), out, unet_config=config)


# The command as `sdxl-lora` runs it, then its own peak resident memory on stderr: VmHWM, the high-water mark of
# this process's memory since its exec (getrusage's ru_maxrss would carry over the forking parent's).
_WRAP = ("import sys; from sdxl_lora.cli import main; rc = main(sys.argv[1:]); "
         "print(*[l for l in open('/proc/self/status') if l.startswith('VmHWM')], file=sys.stderr); sys.exit(rc)")


def timed(name: str, argv: list[str]) -> dict:
    """Run `sdxl-lora ARGV` in its own process: seconds, its peak RSS, its last lines of output."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _WRAP, *argv], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    peak = [int(line.split()[1]) for line in p.stderr.splitlines() if line.startswith("VmHWM:")]  # kB
    row = {"run": name, "argv": argv, "rc": p.returncode, "wall_s": round(wall, 1),
           "peak_rss_gib": round(peak[0] / 2**20, 2) if peak else None, "stdout": p.stdout.strip().splitlines()[-3:]}
    if p.returncode:
        row["stderr"] = p.stderr.strip().splitlines()[-5:]
    print(json.dumps(row), flush=True)
    return row


def resize_rows(adapter: Path, base: Path, out: Path, dev: list[str], rank: int) -> list[dict]:
    return [timed("resize r8", ["resize", str(adapter), "--rank", "8", "--out", str(out / "r8.safetensors"),
                                "--model", str(base), "--overwrite", *dev]),
            timed("resize sv_fro 0.9", ["resize", str(adapter), "--rank", str(rank), "--dynamic-method", "sv_fro",
                                        "--dynamic-param", "0.9", "--out", str(out / "fro.safetensors"), "--model",
                                        str(base), "--overwrite", *dev])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/svd"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", nargs="+", choices=["resize", "extract", "extract-file"],
                    default=["resize", "extract", "extract-file"],
                    help="extract-file: extract from the tuned model written as one original-layout file")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    base = build_model(args.work / "sdxl-random", tiny=False)
    adapter = random_adapter(base, args.work / f"locon-r{args.rank}.safetensors", args.rank)
    print(f"model and adapter ready: {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    tuned = {"extract": args.work / "tuned", "extract-file": args.work / "tuned.safetensors"}
    out = args.work / "out"
    out.mkdir(exist_ok=True)
    dev = ["--device", args.device]
    if "resize" in args.only:
        rows += resize_rows(adapter, base, out, dev, args.rank)
    for form in ("extract", "extract-file"):
        if form not in args.only:
            continue
        if not tuned[form].exists():
            rows.append(timed(f"merge for {form}", ["merge", "--model", str(base), "--lora", str(adapter), "--out",
                                                    str(tuned[form])]))
        rows.append(timed(f"{form} r{args.rank}", ["extract", "--base", str(base), "--tuned", str(tuned[form]),
                                                   "--rank", str(args.rank), "--out", str(out / f"{form}.safetensors"),
                                                   "--overwrite", *dev]))
    if args.json:
        with args.json.open("a") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Pretrain the demo base: the tiny SDXL trained from scratch on synthetic shapes (docs/demo_base.md).

    python scripts/pretrain_demo.py --out OUT            # one GPU: a few minutes (the figures below)
    python scripts/pretrain_demo.py --smoke --out /tmp/x # CPU: a few steps at tiny sizes, end to end
    python scripts/pretrain_demo.py --set unet.steps=6000 --set demo.latent_bank=32768 ...
    python scripts/pretrain_demo.py --vae sdxl_lora/assets/tiny-sdxl-demo --out OUT   # UNet stage only

Writes OUT/tiny-sdxl-demo (a diffusers SDXL folder, fp16 safetensors), OUT/renders.png (one row per
shape), OUT/report.json (losses, evaluations, concept scores, timings) and OUT/runs/{vae,unet} (the
two stages' events and logs); prints the same figures.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

import torch  # noqa: E402

from sdxl_lora.core.config import ConfigError, _parse_value, _set_dotted  # noqa: E402
from sdxl_lora.core.fsutil import atomic_write_text  # noqa: E402
from sdxl_lora.core.runs import Run  # noqa: E402
from sdxl_lora.sdxl.demo import pretrain  # noqa: E402
from sdxl_lora.sdxl.preview import grid, save_png  # noqa: E402
from sdxl_lora.core.loop import Trainer  # noqa: E402

# --smoke: every size at its smallest, so the whole script runs on a CPU in about a minute.
SMOKE = ["demo.resolution=64", "demo.latent_bank=16", "demo.eval_images=2",
         "vae.steps=3", "vae.batch_size=2", "vae.warmup_steps=0", "vae.log_every=1", "vae.device='cpu'",
         "unet.steps=3", "unet.batch_size=4", "unet.warmup_steps=0", "unet.log_every=1", "unet.device='cpu'"]


def load(path: Path, overrides: list[str]) -> pretrain.PretrainConfig:
    tree = tomllib.loads(path.read_text(encoding="utf-8")) if path else {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. unet.steps=2000")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), _parse_value(raw.strip()))
    try:
        return pretrain.PretrainConfig.model_validate(tree)
    except Exception as e:  # pydantic's message names the field; keep it, say which file
        raise ConfigError(f"{path}: {e}") from None


def stage(name: str, task_cls, pc: pretrain.PretrainConfig, pipe, out: Path) -> tuple[dict, str]:
    cfg = pc.stage(name)
    run_dir = out / "runs" / name
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a previous run's stage: its events must not mix with this one's
    run_dir.mkdir(parents=True)
    run = Run(run_dir)
    atomic_write_text(run_dir / "config.toml", cfg.to_toml())
    t0 = time.perf_counter()
    trainer = Trainer(cfg, task_cls(cfg, pc.demo, pipe), run)
    trainer.setup()
    t1 = time.perf_counter()
    result = trainer.fit()
    t2 = time.perf_counter()
    if result.interrupted:
        raise SystemExit(f"stage {name} stopped ({result.interrupted}): {result.message or ''}")
    fig = {"steps": result.steps, "eval_before": result.eval_before, "eval_after": result.eval_after,
           "loss_first": result.losses[0] if result.losses else None,
           "loss_last": result.losses[-1] if result.losses else None,
           "setup_s": round(t1 - t0, 1), "train_s": round(t2 - t1, 1),
           "steps_per_s": round(result.steps / max(t2 - t1, 1e-9), 2),
           "images_per_s": round(result.steps * cfg.train.batch_size / max(t2 - t1, 1e-9), 1),
           "mixed_precision": trainer.accelerator.mixed_precision,
           "losses": [round(x, 5) for x in result.losses]}  # one per train.log_every steps
    print(f"[{name}] {result.steps} steps in {t2 - t1:.1f}s ({fig['steps_per_s']} steps/s, setup {t1 - t0:.1f}s, "
          f"{fig['mixed_precision']}); loss {fig['loss_first']:.4f} -> {fig['loss_last']:.4f}; "
          f"eval {result.eval_before:.4f} -> {result.eval_after:.4f}", flush=True)
    return fig, str(trainer.accelerator.device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, default=HERE / "pretrain_demo.toml")
    ap.add_argument("--out", type=Path, required=True, help="output folder (created; its files are replaced)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="e.g. unet.steps=2000")
    ap.add_argument("--smoke", action="store_true", help="a few CPU steps at tiny sizes (checks the wiring)")
    ap.add_argument("--vae", type=Path, metavar="FOLDER",
                    help="take the VAE (and its latent scale) from this pipeline folder and skip stage 1, "
                         "e.g. the shipped base's, to retrain only the UNet and text encoders")
    ap.add_argument("--per-shape", type=int, default=None, help="renders per shape for the scores [8; smoke 1]")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from diffusers.utils import logging as dlog
    dlog.disable_progress_bar()

    t_start = time.perf_counter()
    pc = load(args.config, (SMOKE if args.smoke else []) + args.set)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True  # fixed shapes all run long: let cuDNN pick its kernels
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    pipe = pretrain.build_pipeline(out / "_build", pc.demo.model_seed, pc.demo.top_attention)
    report: dict = {"config": pc.model_dump(mode="json")}

    if args.vae:
        from diffusers import AutoencoderKL

        pipe.vae = AutoencoderKL.from_pretrained(args.vae / "vae", torch_dtype=torch.float32)
        scale = pipe.vae.config.scaling_factor
        report["vae"] = {"from": str(args.vae)}
        print(f"[vae] from {args.vae}: stage 1 skipped", flush=True)
    else:
        report["vae"], device = stage("vae", pretrain.VAEStage, pc, pipe, out)
        scale = pretrain.measure_latent_scale(pipe.vae, pc.demo.data_seed, pc.demo.resolution, device,
                                              n=64 if args.smoke else 1024)
        pipe.vae.register_to_config(scaling_factor=scale)
    report["latent_scaling_factor"] = scale
    print(f"[vae] latent scaling_factor = {scale:.4f}", flush=True)
    report["unet"], device = stage("unet", pretrain.UNetStage, pc, pipe, out)

    dest = pretrain.save_base(pipe, out / "tiny-sdxl-demo")
    size = pretrain.weights_size(dest)
    report["weights"] = {"folder": str(dest), "bytes": size}
    print(f"weights: {dest} ({size / 2**20:.1f} MiB of safetensors, fp16)", flush=True)

    t0 = time.perf_counter()
    per_shape = args.per_shape or (1 if args.smoke else 8)
    scores, images = pretrain.render_and_score(pipe, per_shape=per_shape, size=pc.demo.resolution,
                                               steps=4 if args.smoke else 30, guidance=5.0, device=device)
    rows = [im for row in images for im in row]
    save_png(grid(rows, cols=per_shape), out / "renders.png")
    report["scores"] = scores
    report["chance"] = pretrain.chance()
    report["render_s"] = round(time.perf_counter() - t0, 1)
    report["total_s"] = round(time.perf_counter() - t_start, 1)
    atomic_write_text(out / "report.json", json.dumps(report, indent=2))
    print(f"concept scores of {per_shape} renders per shape (chance {pretrain.chance():.2f}):")
    print(pretrain.fmt_scores(scores))
    print(f"renders: {out / 'renders.png'}\nreport : {out / 'report.json'}\ntotal  : {report['total_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

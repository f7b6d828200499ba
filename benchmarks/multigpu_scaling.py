"""Multi-GPU scaling of the trainer: `accelerate launch` on 1 GPU, then on N, with the same batch per GPU.

The model is SDXL base's UNet from its real config with random weights (the FLOPs and memory of the
real one), frozen in bf16, with a LoRA from the project's injector (rank 16, bf16 autocast). The data
are synthetic cached latents (128x128, i.e. 1024 px) and text embeddings of SDXL's shapes, so nothing
is read from disk and no VAE or text encoder is needed; everything else is the product's own path:
Trainer, BucketBatchSampler sharding, DDP over NCCL, the NaN guard, the per-step stop/save agreement.

    python benchmarks/multigpu_scaling.py                 # 1 then 2 GPUs, batch 4 per GPU
    python benchmarks/multigpu_scaling.py --gpus 1 2 4 --batch 2 --steps 40
    python benchmarks/multigpu_scaling.py --tiny          # CPU smoke test: a small UNet, 2 gloo processes

Prints one JSON row per process count (images/s, ms/step, peak GiB per GPU) and the scaling
efficiency: images/s on N GPUs / (N x images/s on one).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# The tiny UNet for --tiny: SDXL's topology (3 levels, text_time conditioning) at small widths.
TINY_UNET = {"block_out_channels": [32, 64, 128], "transformer_layers_per_block": [1, 1, 2],
             "attention_head_dim": [2, 4, 8], "cross_attention_dim": 64, "addition_time_embed_dim": 8,
             "projection_class_embeddings_input_dim": 32 + 6 * 8, "sample_size": 16}


def synthetic_task(cfg, unet_config: dict, latent_side: int, samples: int = 16):
    """The SDXL task (sdxl_lora/sdxl/task.py) with its own loss, adapter, speed levers and data sharding,
    over a random-weight UNet and random cached latents and text embeddings: no VAE, text encoders or
    files, so the timed steps hold nothing but the product's training step."""
    from types import SimpleNamespace

    from sdxl_lora.sdxl.task import SDXLTask

    class SyntheticSDXL(SDXLTask):
        def setup(self, accelerator, run) -> None:
            import torch
            from diffusers import DDPMScheduler, UNet2DConditionModel

            from sdxl_lora.core import inject
            from sdxl_lora.sdxl import slots as unet_slots
            from sdxl_lora.sdxl.dataset import Dataset, Item

            self.accelerator, self._run, self.device = accelerator, run, accelerator.device
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
            torch.manual_seed(0)
            with torch.device(self.device):
                unet = UNet2DConditionModel.from_config(unet_config)
            unet.requires_grad_(False)
            unet.to(dtype=dtype)
            px = latent_side * 8
            scheduler = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
            self.pipe = SimpleNamespace(unet=unet, scheduler=scheduler,
                                        vae=SimpleNamespace(config=SimpleNamespace(scaling_factor=0.13025)))
            self.noise_scheduler = self._noise_scheduler()
            self.plan = self.planned = unet_slots.make_plan(unet, self.cfg.adapter, resolution=px, native=px)
            inject.apply_plan(unet, self.plan)
            self._adapter_model = None
            # A pool of distinct samples, indexed modulo its size: no generation or I/O in the timed steps.
            c = unet_config
            pooled = c["projection_class_embeddings_input_dim"] - 6 * c["addition_time_embed_dim"]
            g = torch.Generator().manual_seed(1)
            self.pool = [{"latent_mean": torch.randn(4, latent_side, latent_side, generator=g),
                          "latent_std": 0.05 * torch.rand(4, latent_side, latent_side, generator=g),
                          "prompt_embeds": torch.randn(77, c["cross_attention_dim"], generator=g),
                          "pooled": torch.randn(pooled, generator=g),
                          "time_ids": torch.tensor([px, px, 0, 0, px, px], dtype=torch.float32)}
                         for _ in range(samples)]
            # One bucket of 1024 positions: BucketBatchSampler shards it exactly as it shards a real dataset.
            items = [Item(Path(f"{i}.png"), "", 1, (px, px), (px, px), Path("."), False) for i in range(1024)]
            self.dataset = Dataset(items, [], px, 64)
            self.unet_call.setup(unet, run)  # checkpointing, channels_last, compile, CUDA graphs: as configured

        def dataloader(self, shard: bool = True):
            import torch

            from sdxl_lora.sdxl.batches import sample_key
            from sdxl_lora.sdxl.buckets import BucketBatchSampler

            acc, pool, seed = self.accelerator, self.pool, self.cfg.train.seed

            class Samples(torch.utils.data.Dataset):
                def __len__(self):
                    return 1024

                def __getitem__(self, i):  # the real loader's per-sample key for noise and timestep draws
                    return {**pool[i % len(pool)], "sample_key": torch.tensor(sample_key(seed, 0, i))}

            sampler = BucketBatchSampler(self.dataset, self.cfg.train.batch_size, self.cfg.train.seed,
                                         num_replicas=acc.num_processes if shard else 1,
                                         rank=acc.process_index if shard else 0)
            return torch.utils.data.DataLoader(Samples(), batch_sampler=sampler, num_workers=0)

        def evaluate(self, model, indices=None) -> float:
            return float("nan")

        def evaluate_before(self, model) -> float:  # no files, so no cached step-0 figure to look up
            return float("nan")

        def validate(self, model):
            return None

        def save_adapter(self, model, run, step):
            return {}

        def preview(self, model, run, step):
            return []

    return SyntheticSDXL(cfg)


def worker(args) -> None:
    """One `accelerate launch`ed process: train, then the main process writes the figures."""
    import torch
    from accelerate.utils import gather_object

    from sdxl_lora.core.config import load_config
    from sdxl_lora.core.runs import create_run
    from sdxl_lora.sdxl.formats.single_file import unet_config
    from sdxl_lora.core.loop import Trainer

    n = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config(extra={
        "train.steps": args.steps, "train.batch_size": args.batch, "train.log_every": 1,
        "train.save_every": 0, "train.save_every_minutes": 0, "train.seed": 0,
        "train.mixed_precision": "no" if args.tiny else "bf16", "train.device": "cpu" if args.tiny else "cuda",
        "train.gradient_checkpointing": args.checkpointing, "train.cuda_graphs": args.graphs,
        "train.compile": args.compile, "train.channels_last": args.channels_last,
        "train.gradient_sync": args.gradient_sync,
        "adapter.preset": args.preset, "adapter.rank": args.rank, "adapter.scale_rank_with_resolution": False,
        "preview.prompts": "", "output.runs_dir": args.out, "output.name": f"scale-{n}"})
    config = {**unet_config(), **TINY_UNET} if args.tiny else unet_config()
    side = 8 if args.tiny else 128
    task = synthetic_task(cfg, config, side)
    trainer = Trainer(cfg, task, create_run(cfg))
    trainer.setup()
    acc = trainer.accelerator
    if acc.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(acc.device)
    trainer.fit()
    peak = torch.cuda.max_memory_allocated(acc.device) / 2**30 if acc.device.type == "cuda" else None
    # A replayed CUDA graph allocates nothing (its activations live in the graph's pool): reserved shows it.
    reserved = torch.cuda.max_memory_reserved(acc.device) / 2**30 if acc.device.type == "cuda" else None
    peaks = gather_object([peak])
    reserveds = gather_object([reserved])
    if not acc.is_main_process:
        return
    steps = [e for e in trainer.run.events() if e["event"] == "step" and e["step"] >= args.warmup]
    timed = steps[-1]["step"] - steps[0]["step"]
    seconds = steps[-1]["time"] - steps[0]["time"]
    row = {"processes": acc.num_processes, "device": torch.cuda.get_device_name(acc.device) if peak is not None
           else "cpu", "batch_per_process": args.batch, "global_batch": args.batch * acc.num_processes,
           "steps_timed": timed, "ms_per_step": round(1000 * seconds / timed, 1),
           "images_per_s": round(timed * args.batch * acc.num_processes / seconds, 3),
           "peak_gib_per_gpu": [None if p is None else round(p, 2) for p in peaks],
           "reserved_gib_per_gpu": [None if p is None else round(p, 2) for p in reserveds],
           "trainable_params": task.plan.trainable_params, "preset": args.preset, "rank": args.rank,
           "compile": args.compile, "channels_last": args.channels_last, "cuda_graphs": args.graphs,
           "gradient_sync": next(e for e in trainer.run.events() if e["event"] == "start").get("gradient_sync"),
           "first_step_s": round(steps[0]["time"] - next(e for e in trainer.run.events()
                                                          if e["event"] == "start")["time"], 1),
           "resolution": side * 8, "torch": torch.__version__}
    Path(args.result).write_text(json.dumps(row), encoding="utf-8")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2], help="process counts, the first is the baseline")
    ap.add_argument("--batch", type=int, default=4, help="images per GPU per step")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--preset", default="attn")
    ap.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    ap.add_argument("--graphs", action="store_true", help="train.cuda_graphs (flat all-reduce on several GPUs)")
    ap.add_argument("--compile", default="none", choices=["none", "regional", "transformer"], help="train.compile")
    ap.add_argument("--channels-last", action="store_true", help="train.channels_last")
    ap.add_argument("--fastest", action="store_true", help="--graphs --compile regional --channels-last")
    ap.add_argument("--gradient-sync", default="auto", choices=["auto", "ddp", "allreduce"],
                    help="train.gradient_sync")
    ap.add_argument("--launch-timeout", type=float, default=None, help="seconds one launch may take (default: none)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny UNet, 8x8 latents, gloo")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tiny and args.steps == ap.get_default("steps"):
        args.steps, args.warmup, args.batch = 6, 2, 2
    if args.fastest:
        args.graphs, args.compile, args.channels_last = True, "regional", True
    if args.worker:
        worker(args)
        return

    rows = []
    with tempfile.TemporaryDirectory(prefix="multigpu-scaling-") as tmp:
        for n in args.gpus:
            result = Path(tmp) / f"result-{n}.json"
            yaml = "one-gpu.yaml" if n == 1 else "multi-gpu.yaml"
            cmd = [sys.executable, "-m", "accelerate.commands.launch",
                   "--config_file", str(REPO / "pipelines" / "accelerate" / yaml), "--num_processes", str(n),
                   "--main_process_port", str(free_port()), __file__, "--worker", "--result", str(result),
                   "--out", tmp, "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--rank", str(args.rank), "--preset", args.preset,
                   "--compile", args.compile, "--gradient-sync", args.gradient_sync,
                   *(["--tiny"] if args.tiny else []), *(["--checkpointing"] if args.checkpointing else []),
                   *(["--graphs"] if args.graphs else []), *(["--channels-last"] if args.channels_last else [])]
            env = {**os.environ, "HF_HUB_OFFLINE": "1"}
            if args.tiny:
                env["OMP_NUM_THREADS"] = "1"
            print(f"# {n} process(es): {' '.join(cmd[2:])}", flush=True)
            try:
                proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                                      timeout=args.launch_timeout)
            except subprocess.TimeoutExpired as e:  # say where it was, not only that it ran out of time
                tail = (e.stderr or b"")[-6000:]
                sys.stderr.write(tail.decode(errors="replace") if isinstance(tail, bytes) else tail)
                raise SystemExit(f"the {n}-process run did not finish in {args.launch_timeout} s; its log is above")
            if proc.returncode != 0 or not result.is_file():
                sys.stderr.write(proc.stderr[-6000:])
                raise SystemExit(f"the {n}-process run failed (exit {proc.returncode}); its log is above")
            rows.append(json.loads(result.read_text(encoding="utf-8")))
            print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    for row in rows[1:]:
        factor = row["processes"] / base["processes"]
        eff = row["images_per_s"] / (factor * base["images_per_s"])
        print(f"scaling {base['processes']} -> {row['processes']} processes: {row['images_per_s']:.2f} vs "
              f"{base['images_per_s']:.2f} images/s = {eff:.1%} efficiency (batch {args.batch} per process)")


if __name__ == "__main__":
    main()

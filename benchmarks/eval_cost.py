"""What the trainer's evaluation passes cost on a full-size SDXL UNet (the folder benchmarks/train_e2e.py builds:
SDXL base's configs, random weights) with cuDNN's algorithm search (torch.backends.cudnn.benchmark) on or off:
one no-grad call per aspect bucket, each call holding the images of one training batch at evaluation's four
timesteps (sdxl/task.py: evaluate), under bf16 autocast; the buckets' first calls, then the same calls again.

    python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --steps 1   # builds the folder once
    python3 benchmarks/eval_cost.py --model /tmp/e2e/sdxl-random --batch 2 --search on
    python3 benchmarks/eval_cost.py --model /tmp/e2e/sdxl-random --batch 2 --search off

One setting a process: torch keeps the plan it first runs for a convolution's shape, found by the search or by
cuDNN's heuristics, and a later call of that shape reuses it whatever the setting then. The trainer evaluates with
the search off (speed.cudnn_search). --device cpu with the tiny model is this script's smoke test.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

BUCKETS = ((1024, 1024), (1152, 896), (896, 1152))
TIMESTEPS = 4  # evaluate()'s fixed timesteps an image


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=2, help="the training batch: images per evaluation call")
    ap.add_argument("--search", choices=("on", "off"), default="off", help="cuDNN's algorithm search")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    from sdxl_lora.core.config import load_config
    from sdxl_lora.sdxl.model import load_pipeline

    cuda = args.device == "cuda"
    cfg = load_config(extra={"model.path": args.model})
    unet = load_pipeline(cfg.model).unet.to(args.device, dtype=torch.bfloat16 if cuda else torch.float32).eval()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    scale = 1 if cuda else 8  # the tiny model at small sizes
    n = TIMESTEPS * args.batch
    context = unet.config.cross_attention_dim
    pooled = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim

    def call(w: int, h: int) -> None:
        latents = torch.randn(n, unet.config.in_channels, h // 8 // scale, w // 8 // scale, device=args.device)
        cond = {"text_embeds": torch.randn(n, pooled, device=args.device),
                "time_ids": torch.tensor([[h, w, 0, 0, h, w]] * n, device=args.device, dtype=torch.float32)}
        with torch.no_grad(), torch.autocast(args.device, dtype=torch.bfloat16, enabled=cuda):
            unet(latents, torch.full((n,), 500, device=args.device), torch.randn(n, 77, context, device=args.device),
                 added_cond_kwargs=cond)

    torch.backends.cudnn.benchmark = args.search == "on"
    call(512, 512)  # the CUDA context, cuBLAS and the first kernels' loading, at a shape none of the rows use
    for name in ("first calls", "again"):
        times = []
        for w, h in BUCKETS:
            sync()
            t = time.perf_counter()
            call(w, h)
            sync()
            times.append(round(time.perf_counter() - t, 2))
        print(json.dumps({"search": args.search, "calls": name, "batch": args.batch, "samples_per_call": n,
                          "seconds_per_bucket": times, "total_s": round(sum(times), 2)}), flush=True)

if __name__ == "__main__":
    main()

"""The FLOPs of one LoRA training step of the SDXL UNet by kind of work, so the profile's milliseconds per kind
(`sdxl_step.py --profile`) can be read as throughput: linear layers (mm, addmm), convolutions, attention.

    python benchmarks/step_flops.py [--rank 16] [--resolution 1024]

Runs on the meta device (no memory, no GPU, seconds): the UNet from SDXL's real config with the benchmark's
adapter (rank 16 on to_q/k/v/out), one image, torch's FlopCounterMode over the forward and over the backward
of a loss on its output. Attention runs as the math path on the meta device (two batched matmuls forward,
four backward): the FLOPs the attention needs; a flash kernel recomputes the scores in its backward (one
forward's worth more). Prints one JSON row with TFLOPs per image by kind and pass.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).parent))
import sdxl_step  # noqa: E402  (the benchmark's model and adapter)

KINDS = {"mm": "linear", "addmm": "linear", "bmm": "attention", "convolution": "convolution",
         "convolution_backward": "convolution"}


def by_kind(mode: FlopCounterMode) -> dict[str, float]:
    out: dict[str, float] = {}
    for op, flops in mode.get_flop_counts()["Global"].items():
        kind = KINDS.get(str(op).split(".")[-1], str(op))
        out[kind] = out.get(kind, 0.0) + flops / 1e12
    return {k: round(v, 3) for k, v in sorted(out.items())}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--resolution", type=int, default=1024)
    args = p.parse_args(argv)
    from sdxl_lora.sdxl.config import AdapterConfig

    unet = sdxl_step.build_unet("meta")
    unet.config.sample_size = args.resolution // 8
    sdxl_step.project_lora(unet, AdapterConfig(preset="attn", rank=args.rank, scale_rank_with_resolution=False))
    c, s = unet.config, args.resolution // 8
    meta = {"device": "meta", "dtype": torch.bfloat16}
    pooled_dim = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
    with FlopCounterMode(display=False) as fwd:
        out = unet(torch.randn(1, 4, s, s, **meta), torch.tensor([500], device="meta"),
                   encoder_hidden_states=torch.randn(1, 77, c.cross_attention_dim, **meta),
                   added_cond_kwargs={"text_embeds": torch.randn(1, pooled_dim, **meta),
                                      "time_ids": torch.randn(1, 6, **meta)}).sample
    with FlopCounterMode(display=False) as bwd:
        out.float().pow(2).mean().backward()
    f, b = by_kind(fwd), by_kind(bwd)
    step = {k: round(f.get(k, 0) + b.get(k, 0), 3) for k in sorted(set(f) | set(b))}
    print(json.dumps({"resolution": args.resolution, "rank": args.rank, "tflops_per_image": {
        "forward": f, "backward": b, "step": step, "step_total": round(sum(step.values()), 3)}}))


if __name__ == "__main__":
    main()

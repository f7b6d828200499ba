"""QLoRA memory and speed: SDXL UNet LoRA training steps with the frozen base in bf16, nf4, int8 or fp8, with
and without gradient checkpointing and fp8 convolutions (model.quantize_convs), at batch 1 and 4, in one run;
the memory estimate (sdxl_lora/sdxl/memory.py) beside each measured peak.

The UNet is SDXL base's real config with random weights (the same FLOPs and memory as the real one),
1024x1024 (128x128 latents), LoRA rank 16 on the attention projections (preset attn, fp32), text
embeddings precomputed (random tensors of the real shapes), bf16 autocast, SDPA, AdamW. Quantized
settings go through the product's path: the bf16 model sits on the host and its Linears (and, for the
"fp8conv" settings, its convolutions) are quantized one at a time on the GPU (sdxl_lora.sdxl.quantize.quantize_unet,
as a training run does), the rest moved after.

    python benchmarks/qlora_memory.py                 # CUDA, real size (~4-6 minutes on an H200)
    python benchmarks/qlora_memory.py --tiny          # CPU smoke test: the embedded tiny SDXL, 2 steps
    python benchmarks/qlora_memory.py --batches 1 --only nf4+ckpt nf4+ckpt+fp8conv   # a subset

Prints a JSON line per setting and a markdown table at the end. Peak is torch.cuda.max_memory_allocated
over the timed steps (after warm-up); on CPU there is no per-setting peak, so only the estimate shows.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SETTINGS = [  # (name, model.quantize, gradient checkpointing, model.quantize_convs)
    ("bf16", "none", False, "none"), ("bf16+ckpt", "none", True, "none"), ("nf4", "nf4", False, "none"),
    ("nf4+ckpt", "nf4", True, "none"), ("int8", "int8", False, "none"), ("fp8", "fp8", False, "none"),
    # fp8 convolutions: with nf4 + checkpointing (the smallest setting), alone (bf16 Linears, so the
    # convolutions' own effect on weights and saved activations shows against "bf16"), and with fp8 Linears.
    ("nf4+ckpt+fp8conv", "nf4", True, "fp8"), ("fp8conv", "none", False, "fp8"), ("fp8+fp8conv", "fp8", False, "fp8"),
]


def host_unet(tiny: bool):
    """The UNet with random weights on the host, in the compute dtype."""
    from diffusers import UNet2DConditionModel

    if tiny:
        from sdxl_lora.core.config import ModelConfig
        from sdxl_lora.sdxl.demo.tiny import materialize_tiny

        config = json.loads((materialize_tiny(ModelConfig().cache_dir) / "unet" / "config.json").read_text())
    else:
        from sdxl_lora.sdxl.formats.single_file import unet_config

        config = unet_config()
    torch.manual_seed(0)
    # Random init is much faster on the GPU; the model then waits on the host, as a loaded checkpoint would.
    init = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    with torch.device(init):
        unet = UNet2DConditionModel.from_config(config)
    unet = unet.to("cpu", torch.bfloat16 if not tiny else torch.float32)
    if init == "cuda":
        torch.cuda.empty_cache()
    return unet


def prepare(base, quantize: str, checkpointing: bool, convs: str, rank: int, device, dtype):
    from sdxl_lora.core import inject
    from sdxl_lora.sdxl import slots as unet_slots
    from sdxl_lora.sdxl.config import AdapterConfig, ModelConfig
    from sdxl_lora.sdxl.quantize import quantize_unet

    unet = copy.deepcopy(base)
    native = None  # rank as given, whatever the resolution
    plan = unet_slots.make_plan(unet, AdapterConfig(preset="attn", rank=rank), resolution=native, native=native)
    report = ""
    if quantize != "none" or convs != "none":
        model_cfg = ModelConfig(quantize=quantize, quantize_convs=convs,
                                quant_compute_dtype="bf16" if dtype == torch.bfloat16 else "fp32")
        reports = quantize_unet(unet, model_cfg, None, device)
        report = "; ".join(str(r) for r in reports if r.method != "none")
    unet.to(device, dtype=dtype)
    inject.apply_plan(unet, plan)
    if checkpointing:
        unet.enable_gradient_checkpointing()
    unet.train()
    return unet, plan, report


def bench(unet, batch: int, side: int, steps: int, warmup: int, device, dtype, optimizer: str):
    from diffusers import DDPMScheduler

    c = unet.config
    params = [p for p in unet.parameters() if p.requires_grad]
    if optimizer == "adamw8bit":
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit(params, lr=1e-4)
    else:
        opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    sched = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    g = torch.Generator(device="cpu").manual_seed(0)
    lat = torch.randn(batch, c.in_channels, side, side, generator=g).to(device)
    emb = torch.randn(batch, 77, c.cross_attention_dim, generator=g).to(device)
    pooled = torch.randn(batch, c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim,
                         generator=g).to(device)
    px = float(side * 8)
    tids = torch.tensor([[px, px, 0, 0, px, px]] * batch, device=device)
    autocast = dtype != torch.float32

    def step():
        noise = torch.randn_like(lat)
        t = torch.randint(0, 1000, (batch,), device=device)
        noisy = sched.add_noise(lat, noise, t)
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            pred = unet(noisy, t, encoder_hidden_states=emb,
                        added_cond_kwargs={"text_embeds": pooled, "time_ids": tids}).sample
        loss = torch.nn.functional.mse_loss(pred.float(), noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    cuda = device.type == "cuda"
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1000
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"ms_per_step": round(ms, 1), "peak_gib": None if peak is None else round(peak, 2),
            "loss": round(loss.item(), 4), "trainable": sum(p.numel() for p in params)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny SDXL on the CPU, a few steps (smoke test)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 8; 2 with --tiny)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; 1 with --tiny)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--resolution", type=int, default=None, help="pixels (default 1024; 64 with --tiny)")
    ap.add_argument("--optimizer", choices=["adamw", "adamw8bit"], default="adamw")
    ap.add_argument("--only", nargs="+", choices=[s[0] for s in SETTINGS], help="a subset of the settings")
    args = ap.parse_args()
    from sdxl_lora.sdxl import memory as unet_memory

    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        sys.exit("no CUDA device: run with --tiny for the CPU smoke test")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    steps = args.steps or (8 if cuda else 2)
    warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    resolution = args.resolution or (1024 if cuda else 64)
    side = resolution // 8
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    base = host_unet(args.tiny)
    settings = [s for s in SETTINGS if not args.only or s[0] in args.only]
    rows = []
    for batch in args.batches:
        for name, quantize, ckpt, convs in settings:
            t0 = time.perf_counter()
            unet, plan, report = prepare(base, quantize, ckpt, convs, args.rank, device, dtype)
            setup_s = time.perf_counter() - t0
            est = unet_memory.estimate(base, trainable_params=plan.trainable_params, resolution=resolution,
                                  batch_size=batch, checkpointing=ckpt, quantize=quantize, compute_dtype=dtype,
                                  optimizer=args.optimizer, quantize_convs=convs)
            row = {"setting": name, "batch": batch, **bench(unet, batch, side, steps, warmup, device, dtype,
                                                              args.optimizer),
                   "estimate_gib": round(est.total / 2**30, 2), "setup_s": round(setup_s, 1),
                   "estimate": est.as_dict(), "quantized": report}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del unet
            if cuda:
                torch.cuda.empty_cache()
    ref = {(r["batch"], "ckpt" in r["setting"]): r["ms_per_step"] for r in rows if r["setting"].startswith("bf16")}
    print()
    print(f"{'resolution ' + str(resolution)}, LoRA rank {args.rank} on attention, {args.optimizer}, "
          f"{steps} timed steps, {device.type}, unquantized weights and compute in {str(dtype).removeprefix('torch.')}")
    print()
    print("| setting | batch | ms/step | speed vs bf16 | peak GiB | estimate GiB | weights | activations |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        base_ms = ref.get((r["batch"], "ckpt" in r["setting"]))
        rel = f"{base_ms / r['ms_per_step']:.2f}x" if base_ms else ""
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        e = r["estimate"]
        w = sum(e["weights_gib"].values())
        print(f"| {r['setting']} | {r['batch']} | {r['ms_per_step']:.1f} | {rel} | {peak} | {r['estimate_gib']:.2f} | "
              f"{w:.2f} | {e['activations_gib']:.2f} |")


if __name__ == "__main__":
    main()

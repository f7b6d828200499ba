"""SDXL UNet LoRA training step on the GPU: the plain diffusers + peft recipe beside this project's
injector plans, in one run. The UNet is SDXL base's real config with random weights (same FLOPs and
memory as the real one), 1024x1024 (128x128 latents), text embeddings precomputed (random tensors of
the real shapes), bf16 autocast over bf16 frozen weights, fp32 LoRA, SDPA, AdamW.

    python benchmarks/sdxl_step.py [--batches 1 4] [--steps 20] [--warmup 5]

Prints one row per setting: ms/step, images/s, peak GiB, MFU (model FLOPs: 3 x 6.76 TFLOPs per image
for forward + backward, against the H200's measured ~790 TFLOP/s dense bf16).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

FWD_TFLOPS_PER_IMAGE = 6.76   # torch FlopCounterMode, SDXL UNet forward at 1024x1024
PEAK_TFLOPS = 790.0           # bf16 matmul measured on this H200 (device/KINDS.md)


def build_unet(device):
    from diffusers import UNet2DConditionModel

    from sdxl_lora.sdxl.single_file import unet_config

    torch.manual_seed(0)
    with torch.device(device):
        unet = UNet2DConditionModel.from_config(unet_config())
    return unet.to(dtype=torch.bfloat16)


def recipe_lora(unet, rank):
    """The plain recipe: diffusers' add_adapter with the flat module list of its training examples."""
    from peft import LoraConfig

    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
                                target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    for p in unet.parameters():
        if p.requires_grad:
            p.data = p.data.float()


def project_lora(unet, preset, rank):
    from sdxl_lora import inject
    from sdxl_lora.config import AdapterConfig

    plan = inject.make_plan(unet, AdapterConfig(preset=preset, rank=rank), resolution=1024, native=1024)
    inject.apply_plan(unet, plan)
    return plan


def bench(unet, batch, steps, warmup, checkpointing=False):
    from diffusers import DDPMScheduler

    dev = "cuda"
    if checkpointing:
        unet.enable_gradient_checkpointing()
    unet.train()
    params = [p for p in unet.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    sched = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    lat = torch.randn(batch, 4, 128, 128, device=dev)
    emb = torch.randn(batch, 77, 2048, device=dev)
    pooled = torch.randn(batch, 1280, device=dev)
    tids = torch.tensor([[1024, 1024, 0, 0, 1024, 1024]] * batch, device=dev, dtype=torch.float32)

    def step():
        noise = torch.randn_like(lat)
        t = torch.randint(0, 1000, (batch,), device=dev)
        noisy = sched.add_noise(lat, noise, t)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = unet(noisy, t, encoder_hidden_states=emb,
                        added_cond_kwargs={"text_embeds": pooled, "time_ids": tids}).sample
        loss = torch.nn.functional.mse_loss(pred.float(), noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1000
    ips = batch / (ms / 1000)
    return {"ms_per_step": round(ms, 1), "images_per_s": round(ips, 2),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "mfu": round(3 * FWD_TFLOPS_PER_IMAGE * ips / PEAK_TFLOPS, 3), "loss": round(loss.item(), 4),
            "trainable": sum(p.numel() for p in params)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}")
    settings = [("recipe attn", None), ("ours attn", "attn"), ("ours topology", "topology")]
    for batch in args.batches:
        for name, preset in settings:
            unet = build_unet("cuda")
            if preset is None:
                recipe_lora(unet, args.rank)
            else:
                project_lora(unet, preset, args.rank)
            row = {"setting": name, "batch": batch, **bench(unet, batch, args.steps, args.warmup)}
            print(json.dumps(row), flush=True)
            del unet
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

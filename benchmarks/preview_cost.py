"""What a preview set costs on a full-size SDXL (the folder benchmarks/train_e2e.py builds: SDXL base's
configs, random weights), and where the time goes: one image per aspect bucket at the default preview
settings, rendered twice (the process's first renders, then again), each image timed on its own, with cuDNN's
algorithm search (torch.backends.cudnn.benchmark) off as the trainer renders, or on (--search on: one setting a
process, since torch keeps the first plan it runs for a convolution's shape whatever the setting later); and the
time to move the text encoders and the VAE to the GPU and back, which each preview set does.

    python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --steps 1   # builds the folder once
    python3 benchmarks/preview_cost.py --model /tmp/e2e/sdxl-random
    python3 benchmarks/preview_cost.py --model /tmp/e2e/sdxl-random --levers

--levers then times the set as a training run's UNet renders it: with the
default adapter plan injected and the default levers (fused q/k/v, merged LoRA products), with the adapter
merged into copies of the weights for the set (inject.merged_for_inference), then merged with its layers out of
the UNet and the attentions on diffusers' processor (how the trainer's previews render: the bare UNet's
modules), then with its weights channels_last, unmerged and merged (the latter: a compiled run's eager previews). --batch N
times N prompts at 1024x1024 (a trainer's default set: the same size) one pipeline call each, then all in one call
(render's batch, each image decoded on its own), with each way's peak memory. --device cpu with the tiny model
is this script's smoke test.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

BUCKETS = ((1024, 1024), (1152, 896), (896, 1152))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--levers", action="store_true", help="also time the set with the trainer's adapter and levers")
    ap.add_argument("--search", choices=("on", "off"), default="off", help="cuDNN's algorithm search")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=0, help="also time N same-size prompts one a call, then in one call")
    args = ap.parse_args()
    from sdxl_lora.core.config import load_config
    from sdxl_lora.sdxl.model import load_pipeline
    from sdxl_lora.sdxl.preview import PreviewPrompt, preview_scheduler, render

    cuda = args.device == "cuda"
    cfg = load_config(extra={"model.path": args.model})
    pipe = load_pipeline(cfg.model)
    pipe.unet.to(args.device, dtype=torch.bfloat16 if cuda else torch.float32)  # as the trainer holds it
    pipe.scheduler = preview_scheduler(pipe.scheduler.config, zero_terminal_snr=False)
    pipe.set_progress_bar_config(disable=True)
    aux = (pipe.vae, pipe.text_encoder, pipe.text_encoder_2)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t = time.perf_counter()
    for m in aux:
        m.to(args.device)
    sync()
    to_gpu = time.perf_counter() - t
    prompts = [PreviewPrompt(f"a sks dog, picture {i}", width=w, height=h) for i, (w, h) in enumerate(BUCKETS)]
    if not cuda:  # the smoke test: the tiny model at small sizes
        prompts = [PreviewPrompt(p.prompt, width=p.width // 8, height=p.height // 8, steps=2) for p in prompts]
    pc = cfg.preview

    torch.backends.cudnn.benchmark = args.search == "on"

    def time_set(name: str) -> None:
        name = f"{name}, search {args.search}"
        times = []
        for p in prompts:
            sync()
            t = time.perf_counter()
            render(pipe, [p], seed=pc.seed, steps=pc.steps, guidance=pc.guidance, width=1024, height=1024,
                   autocast_dtype=torch.bfloat16 if cuda else None)
            sync()
            times.append(round(time.perf_counter() - t, 2))
        print(json.dumps({"mode": name, "seconds_per_image": times, "set_s": round(sum(times), 2),
                          "steps": prompts[0].steps or pc.steps, "guidance": pc.guidance,
                          "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}),
              flush=True)

    for name in ("bare UNet, first renders", "bare UNet, again"):
        time_set(name)
    if args.batch:
        side = 1024 if cuda else 128
        same = [PreviewPrompt(f"a sks dog, picture {i}", **({} if cuda else {"steps": 2})) for i in range(args.batch)]
        for batch in (1, args.batch):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            sync()
            t = time.perf_counter()
            render(pipe, same, seed=pc.seed, steps=pc.steps, guidance=pc.guidance, width=side, height=side,
                   autocast_dtype=torch.bfloat16 if cuda else None, batch=batch)
            sync()
            took = time.perf_counter() - t
            print(json.dumps({"mode": f"{args.batch} prompts at {side}x{side}, {batch} a call", "set_s": round(took, 2),
                              "per_image_s": round(took / args.batch, 2),
                              "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}),
                  flush=True)
    if args.levers:
        from sdxl_lora.core import inject
        from sdxl_lora.core.speed import to_channels_last
        from sdxl_lora.sdxl import speed as unet_speed
        from sdxl_lora.sdxl.slots import make_plan

        unet = pipe.unet
        native = int(unet.config.sample_size) * 8
        inject.apply_plan(unet, make_plan(unet, cfg.adapter, resolution=native, native=native), dropout=0.0)
        unet_speed.fuse_projections(unet, lora_matmul=cfg.train.lora_matmul)
        if cuda and cfg.train.lora_matmul == "merged":  # as the trainer: on CUDA only
            unet_speed.merge_lora_linears(unet), unet_speed.merge_lora_convs(unet)
        unet.eval()
        time_set("adapter (the default plan, fused q/k/v, merged products)")
        sync()
        t = time.perf_counter()
        with inject.merged_for_inference(unet) as merged:
            sync()
            merge_s = time.perf_counter() - t
            time_set(f"the adapter merged into copies of {merged} weights for the set")
            t = time.perf_counter()
        sync()
        print(json.dumps({"merge_s": round(merge_s, 2), "restore_s": round(time.perf_counter() - t, 2)}), flush=True)
        with inject.merged_for_inference(unet, unwrap=True), unet_speed.stock_attention(unet):
            time_set("merged, the adapter's layers out and diffusers' attention processor, as the trainer's previews "
                     "render")
        to_channels_last(unet)
        time_set("the adapter unmerged, channels_last weights")
        with inject.merged_for_inference(unet):
            time_set("merged for the set, channels_last weights (a compiled run's previews)")
    t = time.perf_counter()
    for m in aux:
        m.to("cpu")
    sync()
    print(json.dumps({"aux_to_gpu_s": round(to_gpu, 2), "aux_to_cpu_s": round(time.perf_counter() - t, 2)}))


if __name__ == "__main__":
    main()

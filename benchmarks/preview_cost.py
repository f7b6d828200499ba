"""What a preview set costs on a full-size SDXL (the folder benchmarks/train_e2e.py builds: SDXL base's
configs, random weights), and where the time goes: one image per aspect bucket at the default preview
settings, rendered three times in one process with cuDNN's algorithm search (torch.backends.cudnn.benchmark)
off, on for the first time, and on again (its choices cached), each image timed on its own; and the time to
move the text encoders and the VAE to the GPU and back, which each preview set does.

    python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --steps 1   # builds the folder once
    python3 benchmarks/preview_cost.py --model /tmp/e2e/sdxl-random
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
    args = ap.parse_args()
    from sdxl_lora.core.config import load_config
    from sdxl_lora.sdxl.model import load_pipeline
    from sdxl_lora.sdxl.preview import PreviewPrompt, preview_scheduler, render

    cfg = load_config(extra={"model.path": args.model})
    pipe = load_pipeline(cfg.model)
    pipe.unet.to("cuda", dtype=torch.bfloat16)  # as the trainer holds it
    pipe.scheduler = preview_scheduler(pipe.scheduler.config, zero_terminal_snr=False)
    pipe.set_progress_bar_config(disable=True)
    aux = (pipe.vae, pipe.text_encoder, pipe.text_encoder_2)
    sync = torch.cuda.synchronize
    t = time.perf_counter()
    for m in aux:
        m.to("cuda")
    sync()
    to_gpu = time.perf_counter() - t
    prompts = [PreviewPrompt(f"a sks dog, picture {i}", width=w, height=h) for i, (w, h) in enumerate(BUCKETS)]
    pc = cfg.preview
    for name, bench in (("benchmark off", False), ("benchmark on, first", True), ("benchmark on, again", True)):
        torch.backends.cudnn.benchmark = bench
        times = []
        for p in prompts:
            sync()
            t = time.perf_counter()
            render(pipe, [p], seed=pc.seed, steps=pc.steps, guidance=pc.guidance, width=1024, height=1024,
                   autocast_dtype=torch.bfloat16)
            sync()
            times.append(round(time.perf_counter() - t, 2))
        print(json.dumps({"mode": name, "seconds_per_image": times, "set_s": round(sum(times), 2),
                          "steps": pc.steps, "guidance": pc.guidance,
                          "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}), flush=True)
    t = time.perf_counter()
    for m in aux:
        m.to("cpu")
    sync()
    print(json.dumps({"aux_to_gpu_s": round(to_gpu, 2), "aux_to_cpu_s": round(time.perf_counter() - t, 2)}))


if __name__ == "__main__":
    main()

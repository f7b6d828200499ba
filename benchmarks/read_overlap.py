"""Whether reading the UNet's weights onto the GPU overlaps the rest of a launch's set-up: in a fresh process,
the UNet read as training reads it (sdxl/model.py: UNetReader; `--way serial`: after the rest; `--way thread`: on
its own thread started first, as load_pipeline does), while the main thread imports the SDXL pipeline's libraries
and reads the VAE and both text encoders as training does. Prints each part's seconds and the whole.

    python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --steps 1   # builds the folder once
    python3 benchmarks/read_overlap.py /tmp/e2e/sdxl-random --way serial
    python3 benchmarks/read_overlap.py /tmp/e2e/sdxl-random --way thread
"""
from __future__ import annotations

import argparse
import time

T0 = time.perf_counter()

import torch  # noqa: E402


def rest(folder, out: dict):
    """The pipeline's import, the folder's check, the VAE and both text encoders; returns the UNet on meta."""
    from sdxl_lora.sdxl import model

    t = time.perf_counter()
    from diffusers import StableDiffusionXLPipeline  # noqa: F401
    out["pipeline_import_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    unet = model.check_folder(folder)
    out["check_folder_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    for name in ("vae", "text_encoder", "text_encoder_2"):
        model._load_component(folder, name, torch.float32 if name == "vae" else "auto")
    out["vae_and_encoders_s"] = round(time.perf_counter() - t, 2)
    return unet


def main() -> None:
    from pathlib import Path

    from sdxl_lora.core.weights import weight_files
    from sdxl_lora.sdxl.model import COMPONENTS, UNetReader

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--way", choices=("serial", "thread"), required=True)
    args = ap.parse_args()
    out: dict = {"way": args.way, "torch_import_s": round(time.perf_counter() - T0, 2)}
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    reader = UNetReader(weight_files(args.model / "unet", COMPONENTS["unet"][2]), device, torch.bfloat16)
    t = time.perf_counter()
    if args.way == "thread":  # as load_pipeline reads it
        with reader:
            unet = rest(args.model, out)
            out["main_thread_s"] = round(time.perf_counter() - t, 2)
            reader.into(unet, args.model)
    else:
        unet = rest(args.model, out)
        u = time.perf_counter()
        with reader:
            reader.into(unet, args.model)
        out["unet_s"] = round(time.perf_counter() - u, 2)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out["whole_s"] = round(time.perf_counter() - t, 2)
    print(out, flush=True)


if __name__ == "__main__":
    main()

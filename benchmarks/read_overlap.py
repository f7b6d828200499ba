"""Whether reading the UNet's weights onto the GPU can overlap the rest of a launch's set-up: in a fresh process,
the UNet's safetensors read tensor by tensor straight onto the device (`--way serial`: after the rest;
`--way thread`: on a second thread started first), while the main thread imports the SDXL pipeline's libraries
and reads the VAE and both text encoders as training does. Prints each part's seconds and the whole.

    python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --steps 1   # builds the folder once
    python3 benchmarks/read_overlap.py /tmp/e2e/sdxl-random --way serial
    python3 benchmarks/read_overlap.py /tmp/e2e/sdxl-random --way thread
"""
from __future__ import annotations

import argparse
import threading
import time

T0 = time.perf_counter()

import torch  # noqa: E402


def read_unet(folder, device, dtype, out: dict) -> None:
    from safetensors import safe_open

    t = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.init()
    out["cuda_init_s"] = round(time.perf_counter() - t, 2)
    tensors = {}
    for f in sorted((folder / "unet").glob("*.safetensors")):
        with safe_open(str(f), "pt", device=str(device)) as fh:
            for k in fh.keys():
                tensors[k] = fh.get_tensor(k).to(dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out["unet_s"] = round(time.perf_counter() - t, 2)
    out["tensors"] = len(tensors)


def rest(folder, out: dict) -> None:
    from sdxl_lora.core.config import ModelConfig  # noqa: F401 - the package, as training imports it first
    t = time.perf_counter()
    from diffusers import StableDiffusionXLPipeline  # noqa: F401
    out["pipeline_import_s"] = round(time.perf_counter() - t, 2)
    from sdxl_lora.sdxl import model

    t = time.perf_counter()
    model.check_folder(folder)
    out["check_folder_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    for name in ("vae", "text_encoder", "text_encoder_2"):
        model._load_component(folder, name, torch.float32 if name == "vae" else "auto")
    out["vae_and_encoders_s"] = round(time.perf_counter() - t, 2)


def main() -> None:
    from pathlib import Path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--way", choices=("serial", "thread"), required=True)
    args = ap.parse_args()
    out: dict = {"way": args.way, "torch_import_s": round(time.perf_counter() - T0, 2)}
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    t = time.perf_counter()
    if args.way == "thread":
        reader = threading.Thread(target=read_unet, args=(args.model, device, torch.bfloat16, out))
        reader.start()
        rest(args.model, out)
        out["main_thread_s"] = round(time.perf_counter() - t, 2)
        reader.join()
    else:
        rest(args.model, out)
        read_unet(args.model, device, torch.bfloat16, out)
    out["whole_s"] = round(time.perf_counter() - t, 2)
    print(out, flush=True)


if __name__ == "__main__":
    main()

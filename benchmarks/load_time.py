"""How long the training set-up takes to read a model folder, and the host memory it peaks at: the pipeline
loaded as `sdxl-lora train` loads it, with the UNet read as fp32 (`fp32`) or in a compute dtype (`bf16`,
`fp16`), on the host or (`--unet-device cuda`, as training on a GPU reads it) straight onto a device; the text
encoders as fp32 or (`--encoders-as-stored`, as training reads them) in their files' dtype. Run each in its own
process (the peak is the process's):

    python3 benchmarks/train_e2e.py --work /tmp/e2e --settings defaults --steps 1   # builds the folder once
    python3 benchmarks/load_time.py /tmp/e2e/sdxl-random fp32
    python3 benchmarks/load_time.py /tmp/e2e/sdxl-random bf16
    python3 benchmarks/load_time.py /tmp/e2e/sdxl-random bf16 --unet-device cuda
    python3 benchmarks/load_time.py /tmp/e2e/sdxl-random bf16 --encoders-as-stored --parts

--parts times the read's steps apart, in a fresh process (the first import of each library counted where it
happens): the package's import, the folder's check (configs, file headers, the UNet on the meta device), then
each component.
"""
from __future__ import annotations

import argparse
import resource
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a diffusers SDXL folder or a single-file checkpoint")
    ap.add_argument("unet_dtype", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--unet-device", help="read the UNet straight onto this device (e.g. cuda)")
    ap.add_argument("--encoders-as-stored", action="store_true", help="the text encoders in their files' dtype")
    ap.add_argument("--parts", action="store_true", help="time the check and each component apart")
    args = ap.parse_args()
    if args.parts:
        return parts(args)
    from sdxl_lora.sdxl.config import ModelConfig
    from sdxl_lora.sdxl.model import load_pipeline

    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.unet_dtype]
    device = torch.device(args.unet_device) if args.unet_device else None
    t = time.perf_counter()
    pipe = load_pipeline(ModelConfig(path=args.model), unet_dtype=dtype, unet_device=device,
                         encoders_as_stored=args.encoders_as_stored)
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)
    where = next(pipe.unet.parameters()).device
    encoders = pipe.text_encoder_2.dtype
    print(f"unet {args.unet_dtype} on {where}, text encoders {encoders}: load {seconds:.1f} s, peak RSS {rss:.2f} GiB")


def parts(args) -> None:
    from pathlib import Path

    t = time.perf_counter()
    from sdxl_lora.sdxl import model

    print(f"import sdxl_lora.sdxl.model: {time.perf_counter() - t:.2f} s")
    path = Path(args.model)
    t = time.perf_counter()
    model.check_folder(path)
    print(f"check_folder: {time.perf_counter() - t:.2f} s")
    unet_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.unet_dtype]
    device = torch.device(args.unet_device) if args.unet_device else None
    for name in model.COMPONENTS:
        dtype = unet_dtype if name == "unet" else ("auto" if args.encoders_as_stored and name.startswith("text")
                                                   else torch.float32)
        t = time.perf_counter()
        model._load_component(path, name, dtype, device if name == "unet" else None)
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        print(f"{name}: {time.perf_counter() - t:.2f} s")


if __name__ == "__main__":
    main()

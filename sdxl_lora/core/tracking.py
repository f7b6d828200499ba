"""Training figures for dashboards: the trackers of train.trackers (TensorBoard, Weights & Biases) through
Accelerate's tracker classes, and the model FLOPs utilisation (MFU) the progress bar and step events show on a GPU.

The trackers get what the run's events file gets (loss, lr, grad norm, images/s, MFU, eval and validation
losses), the preview grids as images and the resolved config. TensorBoard writes under <run>/tensorboard (the
tensorboard package); W&B under <run>/wandb (the wandb extra), offline unless WANDB_MODE says otherwise: a run
needs no network, and `wandb sync` uploads it later.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import torch

from .config import MissingPackage

log = logging.getLogger(__name__)

# Dense (no sparsity) bf16/fp16 tensor-core peaks in TFLOP/s, from the vendors' data sheets. Matched
# as substrings of torch.cuda.get_device_name(), first match wins: a name is listed before any name it contains.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0), ("H100", 989.0), ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0),
    ("RTX 4090", 165.0), ("RTX 3090", 71.0), ("V100", 125.0), ("T4", 65.0),
)


def peak_tflops(device_name: str, override: float | None = None) -> float | None:
    """The GPU's peak for MFU: train.peak_tflops when set, else the table's entry, else None."""
    if override:
        return float(override)
    for key, value in PEAK_TFLOPS:
        if key in device_name:
            return value
    return None


def mfu(flops_per_image: float, images_per_s: float, peak_tflops_per_gpu: float, num_gpus: int = 1) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak of all GPUs, a fraction in [0, 1]."""
    return flops_per_image * images_per_s / (peak_tflops_per_gpu * 1e12 * num_gpus)


def _attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of one attention forward (Q K^T, then the weights times V), grouped-query attention included:
    with fewer key/value heads than query heads (Llama 3, Mistral, Qwen...) every query head still does the
    whole product. torch's own formula asserts equal heads on some versions, which would stop the run."""
    b, h, s_q, d_qk = query_shape
    s_k, d_v = key_shape[-2], value_shape[-1]
    return 2 * b * h * s_q * s_k * d_qk + 2 * b * h * s_q * s_k * d_v


def count_flops(fn) -> int:
    """Total FLOPs torch's FlopCounterMode counts while `fn()` runs (matmuls, convolutions, attention;
    the forward and, when fn calls backward, the backward)."""
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    forward_attention = (aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention,
                         aten._scaled_dot_product_cudnn_attention)
    counter = FlopCounterMode(display=False, custom_mapping={op: _attention_flops for op in forward_attention})
    with counter:
        fn()
    return int(counter.get_total_flops())


# What each tracker needs installed, and the line that says how to install it.
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "pip install tensorboard (it does not change torch)"),
                    "wandb": ("wandb", "pip install 'sdxl_lora[wandb]'")}


def flat_config(tree: dict, prefix: str = "") -> dict[str, str | int | float | bool]:
    """A config as dotted keys and plain values (lists, tables and none as JSON text), as TensorBoard's
    hyperparameters take them."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and not prefix:  # the sections; a table within one stays one value
            out.update(flat_config(value, f"{prefix}{key}."))
        elif isinstance(value, (str, int, float, bool)):
            out[f"{prefix}{key}"] = value
        else:
            out[f"{prefix}{key}"] = json.dumps(value)
    return out


class Trackers:
    """The run's figures, previews and config in the dashboards named (train.trackers), each one Accelerate's
    tracker (accelerate.tracking): TensorBoardTracker to <run>/tensorboard, WandBTracker to <run>/wandb."""

    def __init__(self, names: list[str], run_dir: Path, config: dict):
        for name in names:
            package, install = TRACKER_PACKAGES[name]
            if importlib.util.find_spec(package) is None:
                raise MissingPackage(f"train.trackers names {name!r}, which needs the {package} package, which is "
                                     f"not installed: {install}, or leave it out of train.trackers")
        from accelerate.tracking import TensorBoardTracker, WandBTracker

        run_dir = Path(run_dir)
        self.dir = run_dir
        self.trackers = []
        for name in names:
            if name == "tensorboard":
                tracker = TensorBoardTracker("tensorboard", run_dir)
            else:
                # The project and mode as W&B's own variables give them; offline by default (no network).
                tracker = WandBTracker(os.environ.get("WANDB_PROJECT", "sdxl-lora"), name=run_dir.name,
                                       dir=str(run_dir), mode=os.environ.get("WANDB_MODE", "offline"))
            tracker.start()
            self.trackers.append(tracker)
        values = flat_config(config)
        for tracker in self.trackers:
            tracker.store_init_configuration(values)

    def scalars(self, step: int, **values: float | None) -> None:
        values = {name: float(v) for name, v in values.items() if v is not None}
        if values:
            for tracker in self.trackers:
                tracker.log(values, step=step)

    def images(self, step: int, paths: list[Path]) -> None:
        """The grid of a preview set (or every image when there is none); text previews (an LLM's answers) as
        text."""
        import numpy as np
        from PIL import Image

        texts = {f"samples/{Path(p).stem.split('-')[0]}": Path(p).read_text(encoding="utf-8")
                 for p in paths if Path(p).suffix == ".txt"}
        if texts:
            for tracker in self.trackers:
                tracker.log(texts, step=step)
        paths = [p for p in paths if Path(p).suffix != ".txt"]
        grids = [p for p in paths if Path(p).stem.endswith("grid")] or list(paths)
        images = {}
        for p in grids:
            with Image.open(p) as im:
                tag = "samples/grid" if Path(p).stem.endswith("grid") else f"samples/{Path(p).stem.split('-')[-1]}"
                images[tag] = np.asarray(im.convert("RGB")).copy()
        for tracker in self.trackers:
            if tracker.name == "tensorboard":
                tracker.log_images({k: v[None] for k, v in images.items()}, step=step, dataformats="NHWC")
            else:
                tracker.log_images({k: [v] for k, v in images.items()}, step=step)

    def flush(self) -> None:
        for tracker in self.trackers:
            if tracker.name == "tensorboard":
                tracker.writer.flush()

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.finish()

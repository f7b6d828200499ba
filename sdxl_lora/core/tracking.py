"""Training figures for dashboards: TensorBoard event files (train.tensorboard) and the model FLOPs
utilisation (MFU) the progress bar and step events show on a GPU.

TensorBoard gets what the run's events file gets (loss, lr, grad norm, images/s, MFU, validation
loss) plus the preview grids, under <run>/tensorboard. It is optional: torch's SummaryWriter needs
the tensorboard package.
"""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

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


class TensorBoard:
    """Scalars and images to <run>/tensorboard."""

    def __init__(self, log_dir: Path):
        if importlib.util.find_spec("tensorboard") is None:
            raise ImportError("train.tensorboard=true needs the tensorboard package, which is not installed: "
                              "pip install tensorboard (it does not change torch), or set train.tensorboard=false")
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.dir))

    def scalars(self, step: int, **values: float | None) -> None:
        for name, value in values.items():
            if value is not None:
                self.writer.add_scalar(name, float(value), step)

    def images(self, step: int, paths: list[Path]) -> None:
        """The grid of a preview set (or every image when there is none)."""
        import numpy as np
        from PIL import Image

        grids = [p for p in paths if Path(p).stem.endswith("grid")] or list(paths)
        for p in grids:
            with Image.open(p) as im:
                arr = np.asarray(im.convert("RGB"))
            tag = "samples/grid" if Path(p).stem.endswith("grid") else f"samples/{Path(p).stem.split('-')[-1]}"
            self.writer.add_image(tag, torch.from_numpy(arr.copy()), step, dataformats="HWC")

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

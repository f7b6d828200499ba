"""QLoRA for the SDXL UNet: which of its layers stay in the compute dtype, and model.quantize /
model.quantize_convs applied to a training run's UNet (core/quantize.py does the quantizing)."""
from __future__ import annotations

import logging

from torch import nn

from ..core.quantize import QuantReport, quantize_convs, quantize_model, resolve_compute_dtype

log = logging.getLogger(__name__)


def unet_skip(name: str) -> bool:
    """Layers of an SDXL UNet kept in the compute dtype: the timestep and size/crop embeddings (7M of
    2.2B Linear weights) condition every block, so their error would reach everything, for nothing saved."""
    return name.startswith(("time_embedding.", "add_embedding."))


def unet_conv_skip(name: str) -> bool:
    """Convolutions of an SDXL UNet kept in the compute dtype with model.quantize_convs: conv_in sees the
    latents and conv_out makes the prediction, so their error reaches everything (23k weights, 46 KB)."""
    return name in ("conv_in", "conv_out")


def quantize_unet(unet: nn.Module, model_cfg, mixed_precision: str | None, device,
                  run=None) -> tuple[QuantReport, QuantReport]:
    """model.quantize and model.quantize_convs for a training run's UNet: its Linears (embeddings kept) and,
    when asked, its convolutions (conv_in/conv_out kept) quantized on `device`, the reports logged and, with
    a run, recorded as a "quantize" event. Returns (Linear report, Conv2d report)."""
    compute = resolve_compute_dtype(model_cfg.quant_compute_dtype, mixed_precision)
    report = quantize_model(unet, model_cfg.quantize, compute_dtype=compute, double_quant=model_cfg.quant_double,
                            device=device, skip=unet_skip)
    convs = quantize_convs(unet, model_cfg.quantize_convs, compute_dtype=compute, device=device, skip=unet_conv_skip)
    for r in (report, convs):
        if r.method != "none":
            log.info("quantized the UNet: %s", r)
    if run is not None:
        run.event("quantize", method=report.method, layers=report.layers, kept=report.skipped, params=report.params,
                  bytes_before=report.bytes_before, bytes_after=report.bytes_after,
                  compute_dtype=str(compute).removeprefix("torch."), double_quant=model_cfg.quant_double,
                  convs=convs.method, conv_layers=convs.layers, conv_kept=convs.skipped, conv_params=convs.params,
                  conv_bytes_before=convs.bytes_before, conv_bytes_after=convs.bytes_after)
    return report, convs

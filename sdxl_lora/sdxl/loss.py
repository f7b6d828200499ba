"""The diffusion training loss and its options: timestep range, noise offset, multi-resolution noise, input
perturbation, L2/Huber, min-SNR-gamma and debiased-estimation weighting, a per-pixel loss mask, for epsilon and
v-prediction. Zero terminal SNR is a property of the noise schedule (its betas), set where the scheduler is built;
everything here reads the schedule's alphas_cumprod.

Random draws happen in one fixed order (latent sample, noise, offset noise when on, the multi-resolution levels
when on, timesteps, the input perturbation when on), so a seeded run makes the same draws every time and a
resumed run continues them exactly; an option that is off draws nothing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def draw_noise(latents: torch.Tensor, offset: float) -> torch.Tensor:
    """Gaussian noise; with an offset, plus one constant per (image, channel) times `offset`
    (the "noise offset" trick: lets the model learn overall brightness, very dark or light images)."""
    noise = torch.randn_like(latents)
    if offset:
        noise = noise + offset * torch.randn(latents.shape[0], latents.shape[1], 1, 1,
                                             device=latents.device, dtype=latents.dtype)
    return noise


def multires_noise(noise: torch.Tensor, iterations: int, discount: float, generator=None) -> torch.Tensor:
    """One image's noise ([C, H, W]) with `iterations` coarser levels added, multi-resolution ("pyramid") noise as
    kohya's sd-scripts offers it: level i is Gaussian noise at 1/r^i of the size (r drawn in [2, 4) per level),
    upsampled bilinearly and weighted discount^i, until a side reaches 1 pixel; the sum is scaled back to unit
    standard deviation. Low-frequency noise lets the model change an image's overall colours and layout. The
    factors r come from the host (`torch.rand` on the CPU generator, seeded alike), so drawing them never waits
    for the GPU; `generator` draws the levels."""
    c, h, w = noise.shape
    cpu = None
    if generator is not None:  # a stream of its own, not the levels' (on a CPU they would share the seed)
        cpu = torch.Generator().manual_seed((generator.initial_seed() + 0x9E3779B97F4A7C15) % 2 ** 63)
    factors = (2.0 + 2.0 * torch.rand(iterations, generator=cpu)).tolist()
    out = noise
    for i, r in enumerate(factors, start=1):
        lh, lw = max(1, int(h / r ** i)), max(1, int(w / r ** i))
        level = torch.randn(c, lh, lw, generator=generator, device=noise.device, dtype=noise.dtype)
        out = out + F.interpolate(level[None], size=(h, w), mode="bilinear")[0] * discount ** i
        if lh == 1 or lw == 1:
            break
    return out / out.std()


def draw_timesteps(n: int, lo: int, hi: int, device) -> torch.Tensor:
    """Uniform integer timesteps in [lo, hi], both included."""
    return torch.randint(lo, hi + 1, (n,), device=device)


def snr(alphas_cumprod: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio alpha_bar / (1 - alpha_bar) at timesteps t (0 at a zero-terminal-SNR end)."""
    a = alphas_cumprod.to(t.device)[t].float()
    return a / (1.0 - a)


def min_snr_weight(snr_t: torch.Tensor, gamma: float, prediction_type: str) -> torch.Tensor:
    """Min-SNR-gamma (Hang et al. 2023): the x0-loss weight min(SNR, gamma), expressed for the model's
    target. Epsilon: min(SNR, gamma) / SNR = min(gamma / SNR, 1) (finite at SNR = 0). v-prediction:
    min(SNR, gamma) / (SNR + 1)."""
    if prediction_type == "v_prediction":
        return torch.minimum(snr_t, torch.full_like(snr_t, gamma)) / (snr_t + 1.0)
    return torch.clamp(gamma / snr_t, max=1.0)


def debiased_weight(snr_t: torch.Tensor, prediction_type: str) -> torch.Tensor:
    """Debiased estimation (Yu et al. 2024), as kohya's sd-scripts applies it: each image's loss weighted by
    1/sqrt(SNR) for epsilon prediction, 1/(SNR + 1) for v-prediction, SNR capped at 1000 (near t = 0 it is
    unbounded) and, for epsilon, held at 0.001 or more (a zero-terminal-SNR step's weight stays finite)."""
    s = snr_t.clamp(max=1000.0)
    if prediction_type == "v_prediction":
        return 1.0 / (s + 1.0)
    return s.clamp(min=1e-3).rsqrt()


def elementwise(pred: torch.Tensor, target: torch.Tensor, kind: str, huber_delta: float) -> torch.Tensor:
    if kind == "huber":
        # Quadratic within delta of the target, linear beyond: outliers pull less.
        return F.huber_loss(pred, target, reduction="none", delta=huber_delta)
    return (pred - target) ** 2


def diffusion_loss(pred: torch.Tensor, target: torch.Tensor, t: torch.Tensor, alphas_cumprod: torch.Tensor, *,
                   kind: str = "l2", huber_delta: float = 1.0, min_snr_gamma: float = 0.0,
                   prediction_type: str = "epsilon", mask: torch.Tensor | None = None,
                   weight: torch.Tensor | None = None, debiased: bool = False) -> torch.Tensor:
    """Mean per-element loss of each image, weighted per image (min-SNR-gamma, debiased estimation: both where
    both are on), averaged over the batch.

    `weight` ([B]) multiplies each image's loss before the batch mean, as kohya's per-sample loss_weights do
    (train.prior_loss_weight for regularization images, 1 for the rest): the mean stays over the batch size,
    so a weight of 0.5 halves that image's pull, and a batch of regularization images alone trains at half.

    With a mask ([B, 1, H, W] in [0, 1], at latent resolution) each element's loss is weighted by it and
    each image's loss divided by its mask's mean: a weighted mean, on the scale of an unmasked loss
    whatever the masked area. An all-black mask gives that image a loss of 0 (and no gradient)."""
    per = elementwise(pred.float(), target.float(), kind, huber_delta)
    dims = tuple(range(1, per.ndim))
    if mask is not None:
        m = mask.to(per.device, per.dtype)
        per_image = (per * m).mean(dim=dims) / m.mean(dim=dims).clamp_min(1e-8)
    elif not min_snr_gamma and not debiased and weight is None:
        return per.mean()
    else:
        per_image = per.mean(dim=dims)
    if weight is not None:
        per_image = per_image * weight.to(per_image.device, per_image.dtype)
    if min_snr_gamma or debiased:
        snr_t = snr(alphas_cumprod, t)
        if min_snr_gamma:
            per_image = per_image * min_snr_weight(snr_t, min_snr_gamma, prediction_type)
        if debiased:
            per_image = per_image * debiased_weight(snr_t, prediction_type)
    return per_image.mean()

"""Pretraining the demo base: a tiny SDXL (tiny.py's topology) trained from scratch on synthetic shapes
(shapes.py), with the project's own Trainer, so the embedded default shows real learning.

Two stages, each a Task (core/task.py) for core.loop.Trainer with every parameter trainable:
  1. VAEStage    the VAE learns to reconstruct the shapes (L1 + MSE on pixels, a small KL term);
                 afterwards its latent scale (vae.config.scaling_factor) is measured, as SDXL's was.
  2. UNetStage   the UNet and both text encoders learn the diffusion loss on the VAE's latents of
                 the shapes, captions dropped to zero embeddings now and then (what the pipeline
                 uses for the unconditional half of classifier-free guidance). The latents of a
                 fixed bank of images are computed once (the frozen VAE would otherwise cost as much
                 as the UNet every step).
Images are drawn on the device from (seed, index) each step: no files, nothing to download.
scripts/pretrain_demo.py wires the stages, renders the prompts and scores them (shapes.concept_score).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator
from safetensors.torch import save_file

from ...core.config import Config
from ..config import DEMO_DIR, PreviewConfig, SDXLConfig, TrainConfig
from ...core.fsutil import atomic_save
from ...core.runs import Run
from ...core.task import Task
from .. import loss as diffusion
from . import shapes
from .tiny import SCHEDULER_CONFIG

log = logging.getLogger(__name__)

# Where the shipped demo base lives (a diffusers folder, fp16; model.path = "tiny-sdxl-demo"):
# scripts/pretrain_demo.py's OUT/tiny-sdxl-demo, copied there.
SHIPPED = DEMO_DIR


class DemoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    resolution: int = Field(128, ge=16)      # the native resolution of the tiny SDXL (16 latents x 8)
    data_seed: int = 0                       # which synthetic images (shapes.spec(data_seed, i))
    model_seed: int = 0                      # initial weights (tiny.build_tiny_pipeline(seed))
    kl_weight: float = Field(1e-4, ge=0)     # per latent element, against per-pixel L1 + MSE
    latent_bank: int = Field(65536, ge=1)    # images whose latents the UNet stage trains on
    caption_dropout: float = Field(0.1, ge=0, le=1)
    train_text_encoders: bool = True
    eval_images: int = Field(16, ge=1)
    # The shapes the VAE learns to reconstruct: the new concept too (a LoRA can only teach what the VAE
    # can decode), while the UNet's set stays shapes.BASE_SHAPES, so the base never draws a star.
    vae_shapes: list[str] = Field(default_factory=lambda: list(shapes.SHAPES))
    top_attention: bool = False              # cross-attention at the 16 x 16 level too (tiny.build_tiny_pipeline)

    @field_validator("vae_shapes")
    @classmethod
    def _known_shapes(cls, v: list[str]) -> list[str]:
        unknown = [s for s in v if s not in shapes.SHAPES]
        if unknown or not v:
            raise ValueError(f"demo.vae_shapes: {unknown or 'empty'}; the shapes are {', '.join(shapes.SHAPES)}")
        return v


class PretrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    demo: DemoConfig = Field(default_factory=DemoConfig)
    # The shipped base's sizes (scripts/pretrain_demo.toml states them all; these are its fallbacks).
    vae: TrainConfig = Field(default_factory=lambda: TrainConfig(steps=1000, batch_size=96, lr=1e-3))
    unet: TrainConfig = Field(default_factory=lambda: TrainConfig(steps=1400, batch_size=1024, lr=8e-4))

    def stage(self, name: str) -> Config:
        """A full Config for one stage: its train section, no adapter previews (the script renders)."""
        return SDXLConfig(train=getattr(self, name), preview=PreviewConfig(prompts="", before=False, after=False))


# ----------------------------------------------------------------------------------------------- data

class _Indices(torch.utils.data.Dataset):
    """Item i is the number i; the task turns numbers into images on the device."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class ShuffledBatches(torch.utils.data.Sampler[list[int]]):
    """Batches of a fresh permutation of range(n) each epoch, decided by (seed, epoch) alone; drops the
    ragged last batch. skip_next/set_epoch are what the Trainer uses to resume mid-epoch."""

    def __init__(self, n: int, batch_size: int, seed: int):
        if n < batch_size:
            raise ValueError(f"{n} items cannot fill one batch of {batch_size}; lower train.batch_size "
                             "or raise demo.latent_bank")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.epoch = 0
        self._skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip_next(self, k: int) -> None:
        self._skip = k

    def __len__(self) -> int:
        return self.n // self.batch_size

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(self.n, generator=gen).tolist()
        skip, self._skip = self._skip, 0
        for b in range(skip, len(self)):
            yield order[b * self.batch_size:(b + 1) * self.batch_size]


def _loader(n: int, cfg: Config) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(_Indices(n), batch_sampler=ShuffledBatches(n, cfg.train.batch_size, cfg.train.seed),
                                       collate_fn=torch.tensor, num_workers=0)


def _pixels(seed: int, indices, size: int, device, names: tuple[str, ...] = shapes.BASE_SHAPES) -> torch.Tensor:
    """Images in [-1, 1] (the VAE's range) for the given synthetic indices, shapes drawn from `names`."""
    specs = [shapes.spec(seed, int(i), names) for i in indices]
    return shapes.render(specs, size, device) * 2 - 1


def _maybe_compile(module: torch.nn.Module, cfg: Config) -> None:
    """train.compile, as the SDXL task applies it (speed.py): repeated blocks compiled in place, so the
    parameter names (and the saved files) stay the same. Off by default: the first steps compile."""
    tc = cfg.train
    if tc.compile == "none":
        return
    from ...core import speed
    from .. import speed as unet_speed

    classes = unet_speed.REGION_CLASSES if tc.compile == "regional" else unet_speed.TRANSFORMER_CLASSES
    n = speed.compile_regions(module, classes=classes)
    log.info("train.compile=%r: %d blocks compiled", tc.compile, n)


def _save_module(module: torch.nn.Module, path: Path) -> Path:
    """A stage's result in fp16, as it ships (the full pipeline folder is written by save_base)."""
    state = {k: v.detach().to("cpu", torch.float16 if v.is_floating_point() else v.dtype).contiguous()
             for k, v in module.state_dict().items()}
    return atomic_save(path, lambda tmp: save_file(state, str(tmp)))


# ------------------------------------------------------------------------------------------ stage 1

class _VAEForward(torch.nn.Module):
    """encode -> sample -> decode in one forward, so Accelerate's autocast wraps all of it."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, x: torch.Tensor):
        dist = self.vae.encode(x).latent_dist
        return self.vae.decode(dist.sample()).sample, dist.mean, dist.logvar


class VAEStage(Task):
    """Stage 1: the VAE alone, all its parameters trainable."""

    def __init__(self, cfg: Config, demo: DemoConfig, pipe):
        self.cfg, self.demo, self.pipe = cfg, demo, pipe

    def setup(self, accelerator, run: Run) -> None:
        self.accelerator, self.device = accelerator, accelerator.device
        self.net = _VAEForward(self.pipe.vae).to(self.device, torch.float32).requires_grad_(True)
        _maybe_compile(self.net, self.cfg)
        # Held-out images for the figure: another seed than training draws from.
        self.eval_pixels = _pixels(self.demo.data_seed + 1, range(self.demo.eval_images), self.demo.resolution,
                                   self.device, tuple(self.demo.vae_shapes))
        n = sum(p.numel() for p in self.net.parameters())
        run.event("plan", stage="vae", trainable_params=n)
        log.info("stage 1 (VAE): %.2f M parameters, %d px", n / 1e6, self.demo.resolution)

    def model(self) -> torch.nn.Module:
        return self.net

    def param_groups(self) -> list[dict]:
        return [{"params": list(self.net.parameters())}]

    def dataloader(self):
        # 2^24 distinct images: a run never sees one twice.
        return _loader(1 << 24, self.cfg)

    def batch_size(self, batch) -> int:
        return int(batch.shape[0])

    def loss(self, model, batch) -> torch.Tensor:
        x = _pixels(self.demo.data_seed, batch.tolist(), self.demo.resolution, self.device, tuple(self.demo.vae_shapes))
        rec, mean, logvar = model(x)
        rec = rec.float()
        kl = 0.5 * (mean.float() ** 2 + logvar.float().exp() - 1 - logvar.float()).mean()
        return F.l1_loss(rec, x) + F.mse_loss(rec, x) + self.demo.kl_weight * kl

    @torch.no_grad()
    def evaluate(self, model) -> float:
        """Reconstruction MSE (pixels in [-1, 1]) of the held-out images, from the latent means."""
        vae = model.vae
        with self.accelerator.autocast():
            rec = vae.decode(vae.encode(self.eval_pixels).latent_dist.mean).sample
        return F.mse_loss(rec.float(), self.eval_pixels).item()

    def validate(self, model) -> None:
        return None

    def save_adapter(self, model, run: Run, step: int) -> dict[str, Path]:
        return {"vae": _save_module(model.vae, run.dir / "vae.safetensors")}

    def preview(self, model, run: Run, step: int) -> list[Path]:
        return []


@torch.no_grad()
def measure_latent_scale(vae, seed: int, size: int, device, n: int = 512) -> float:
    """1 / std of the latents of n images: SDXL's scaling_factor was chosen so (unit variance)."""
    vae.to(device).eval()
    lats = [vae.encode(_pixels(seed, range(i, min(n, i + 128)), size, device)).latent_dist.sample()
            for i in range(0, n, 128)]
    return float(1.0 / torch.cat(lats).float().std())


# ------------------------------------------------------------------------------------------ stage 2

class Denoiser(torch.nn.Module):
    """Both text encoders and the UNet as one module: token ids in, noise prediction out. The prompt
    encoding is diffusers' SDXL encode_prompt (penultimate hidden states of both encoders side by side,
    the second's pooled projection), written out here because that one runs without gradients."""

    def __init__(self, pipe):
        super().__init__()
        self.unet, self.text_encoder, self.text_encoder_2 = pipe.unet, pipe.text_encoder, pipe.text_encoder_2

    def forward(self, noisy, t, ids1, ids2, keep, time_ids):
        h1 = self.text_encoder(ids1, output_hidden_states=True).hidden_states[-2]
        out2 = self.text_encoder_2(ids2, output_hidden_states=True)
        embeds = torch.cat([h1, out2.hidden_states[-2]], dim=-1) * keep[:, None, None]
        pooled = out2.text_embeds * keep[:, None]
        return self.unet(noisy, t, encoder_hidden_states=embeds,
                         added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample


def tokenize(tokenizer, captions: list[str]) -> torch.Tensor:
    return tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                     return_tensors="pt").input_ids


class UNetStage(Task):
    """Stage 2: UNet (+ text encoders) on the diffusion loss; the VAE trained in stage 1 stays frozen."""

    def __init__(self, cfg: Config, demo: DemoConfig, pipe):
        self.cfg, self.demo, self.pipe = cfg, demo, pipe

    def setup(self, accelerator, run: Run) -> None:
        from diffusers import DDPMScheduler
        from tqdm.auto import tqdm

        demo, pipe = self.demo, self.pipe
        self.accelerator, self.device = accelerator, accelerator.device
        self.sched = DDPMScheduler.from_config(SCHEDULER_CONFIG)
        self.alphas = self.sched.alphas_cumprod.to(self.device)
        captions = shapes.all_captions()
        self.caption_index = {c: i for i, c in enumerate(captions)}
        self.ids1 = tokenize(pipe.tokenizer, captions).to(self.device)
        self.ids2 = tokenize(pipe.tokenizer_2, captions).to(self.device)

        # The latent bank: mean and std of every bank image, and its caption, once.
        vae = pipe.vae.to(self.device, torch.float32).eval().requires_grad_(False)
        self.scale = vae.config.scaling_factor
        means, stds, caps = [], [], []
        chunk = 256
        with torch.no_grad(), accelerator.autocast():
            for i in tqdm(range(0, demo.latent_bank, chunk), desc="latent bank", unit="batch"):
                idx = range(i, min(demo.latent_bank, i + chunk))
                dist = vae.encode(_pixels(demo.data_seed, idx, demo.resolution, self.device)).latent_dist
                means.append(dist.mean.float())
                stds.append(dist.std.float())
                caps += [self.caption_index[shapes.spec(demo.data_seed, j).caption] for j in idx]
        self.bank_mean, self.bank_std = torch.cat(means), torch.cat(stds)
        self.bank_caption = torch.tensor(caps, device=self.device)
        r = demo.resolution
        self.time_ids = torch.tensor([r, r, 0, 0, r, r], dtype=torch.float32, device=self.device)

        self.net = Denoiser(pipe).to(self.device, torch.float32)
        self.net.requires_grad_(True)
        if not demo.train_text_encoders:
            self.net.text_encoder.requires_grad_(False)
            self.net.text_encoder_2.requires_grad_(False)
        _maybe_compile(self.net.unet, self.cfg)
        # Fixed evaluation: the first bank images at four timesteps, fixed noise.
        gen = torch.Generator("cpu").manual_seed(0)
        k = min(demo.eval_images, demo.latent_bank)
        self.eval_idx = torch.arange(k, device=self.device).repeat_interleave(4)
        self.eval_t = torch.tensor([125, 375, 625, 875], device=self.device).repeat(k)
        self.eval_noise = torch.randn((4 * k, *self.bank_mean.shape[1:]), generator=gen).to(self.device)
        n = sum(p.numel() for p in self.net.parameters() if p.requires_grad)
        run.event("plan", stage="unet", trainable_params=n, latent_bank=demo.latent_bank)
        log.info("stage 2 (UNet%s): %.2f M trainable parameters, %d bank latents",
                 " + text encoders" if demo.train_text_encoders else "", n / 1e6, demo.latent_bank)

    def model(self) -> torch.nn.Module:
        return self.net

    def param_groups(self) -> list[dict]:
        return [{"params": [p for p in self.net.parameters() if p.requires_grad]}]

    def dataloader(self):
        return _loader(self.demo.latent_bank, self.cfg)

    def batch_size(self, batch) -> int:
        return int(batch.shape[0])

    def _predict(self, model, latents, noise, t, caption, keep):
        noisy = self.sched.add_noise(latents, noise, t)
        n = latents.shape[0]
        return model(noisy, t, self.ids1[caption], self.ids2[caption], keep, self.time_ids.expand(n, -1))

    def loss(self, model, batch) -> torch.Tensor:
        tc = self.cfg.train
        idx = batch.to(self.device)
        mean, std = self.bank_mean[idx], self.bank_std[idx]
        latents = (mean + std * torch.randn_like(mean)) * self.scale
        noise = diffusion.draw_noise(latents, tc.noise_offset)
        t = diffusion.draw_timesteps(latents.shape[0], tc.timestep_min,
                                     tc.timestep_max if tc.timestep_max is not None else 999, latents.device)
        keep = (torch.rand(latents.shape[0], device=self.device) >= self.demo.caption_dropout).float()
        pred = self._predict(model, latents, noise, t, self.bank_caption[idx], keep)
        return diffusion.diffusion_loss(pred, noise, t, self.alphas, kind=tc.loss, huber_delta=tc.huber_delta,
                                        min_snr_gamma=tc.min_snr_gamma)

    @torch.no_grad()
    def evaluate(self, model) -> float:
        """Noise-prediction MSE on the first bank images at fixed timesteps and noise."""
        was = model.training
        model.eval()
        try:
            latents = self.bank_mean[self.eval_idx] * self.scale
            keep = torch.ones(len(self.eval_idx), device=self.device)
            with self.accelerator.autocast():
                pred = self._predict(model, latents, self.eval_noise, self.eval_t, self.bank_caption[self.eval_idx],
                                     keep)
            return F.mse_loss(pred.float(), self.eval_noise).item()
        finally:
            model.train(was)

    def validate(self, model) -> None:
        return None

    def save_adapter(self, model, run: Run, step: int) -> dict[str, Path]:
        return {name: _save_module(getattr(model, name), run.dir / f"{name}.safetensors")
                for name in ("unet", "text_encoder", "text_encoder_2")}

    def preview(self, model, run: Run, step: int) -> list[Path]:
        return []


# ------------------------------------------------------------------------------------------ the whole

def build_pipeline(work: Path, seed: int, top_attention: bool = False):
    """The tiny SDXL pipeline (tiny.py's build, random weights) with its tokenizer files under work/."""
    from .tiny import build_tiny_pipeline, build_tokenizer_files

    build_tokenizer_files(work / "_tok")
    return build_tiny_pipeline(work / "_tok", seed=seed, top_attention=top_attention)


def save_base(pipe, dest: Path, dtype: torch.dtype = torch.float16) -> Path:
    """Write the pipeline as a diffusers folder in `dtype` (fp16: the shipped weights stay small),
    atomically (a temporary folder renamed into place)."""
    import os
    import shutil
    import tempfile

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        pipe.to(dtype=dtype)
        pipe.save_pretrained(tmp, safe_serialization=True)
        pipe.to(dtype=torch.float32)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def weights_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*.safetensors"))


def render_and_score(pipe, *, per_shape: int, size: int, steps: int, guidance: float, device, seed: int = 0,
                     shape_names: tuple[str, ...] = shapes.BASE_SHAPES) -> tuple[dict, list]:
    """Render per_shape prompts for each shape (colours and backgrounds cycled) and score them:
    {shape: {"shape": mean P(shape), "colour": mean P(asked colour)}}, and the images by shape."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    from ..preview import render

    p = StableDiffusionXLPipeline(vae=pipe.vae, text_encoder=pipe.text_encoder, text_encoder_2=pipe.text_encoder_2,
                                  tokenizer=pipe.tokenizer, tokenizer_2=pipe.tokenizer_2, unet=pipe.unet,
                                  scheduler=EulerDiscreteScheduler.from_config(SCHEDULER_CONFIG))
    p.to(device)
    p.set_progress_bar_config(disable=True)
    for m in (p.unet, p.vae, p.text_encoder, p.text_encoder_2):
        m.eval()
    colours, backgrounds = list(shapes.COLOURS), list(shapes.BACKGROUNDS)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else None
    scores, images = {}, []
    for s in shape_names:
        specs = [shapes.Spec(s, colours[i % len(colours)], backgrounds[(i // len(colours) + i) % len(backgrounds)],
                             0.5, 0.5, 0.3) for i in range(per_shape)]
        imgs = render(p, [sp.caption for sp in specs], seed=seed, steps=steps, guidance=guidance, width=size,
                      height=size, autocast_dtype=dtype)
        colour = [shapes.concept_scores([im], sp.colour)[0] for im, sp in zip(imgs, specs)]
        own = shapes.concept_scores(imgs, s)
        by_bg = {bg: [p for p, sp in zip(own, specs) if sp.background == bg] for bg in backgrounds}
        scores[s] = {"shape": sum(own) / len(own), "colour": sum(colour) / len(colour),
                     "by_background": {bg: sum(v) / len(v) for bg, v in by_bg.items() if v}}
        images.append(imgs)
    return scores, images


def chance() -> float:
    """What a guess scores for one shape: 1 / the number of shapes the detector knows."""
    return 1.0 / len(shapes.SHAPES)


def fmt_scores(scores: dict) -> str:
    return "\n".join(f"  {s:<9} P(shape) {v['shape']:.2f}   P(colour) {v['colour']:.2f}   P(shape) by background: "
                     + ", ".join(f"{bg} {p:.2f}" for bg, p in v.get("by_background", {}).items())
                     for s, v in scores.items())

"""The SDXL task's training batches: each item of the dataset (repeats expanded) as tensors read from the cache
(latents, masks, text embeddings), or made per sample where the config asks for it (random crops, live captions,
text-encoder LoRA's tokens), with its flip, caption dropout and random draws decided by (seed, epoch, sample)."""
from __future__ import annotations

import hashlib
import random

import torch

from .captions import live_caption, make_caption
from .pixels import load_mask, load_pixels


def sample_key(seed: int, epoch: int, position: int) -> int:
    """A 63-bit seed for one sample's random draws, from (seed, epoch, position in the epoch)."""
    return int(hashlib.sha256(f"{seed}:{epoch}:{position}".encode()).hexdigest()[:15], 16)


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


class CachedSDXLDataset(torch.utils.data.Dataset):
    """Items of the dataset (repeats expanded) as tensors read from the on-disk cache, for an SDXLTask
    (sdxl/task.py) whose data, cache and encoders it reads."""

    def __init__(self, task: "SDXLTask"):
        self.task = task
        self.index = task.dataset.expanded()
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        t = self.task
        item_idx = self.index[i]
        item = t.dataset.items[item_idx]
        settings = item.settings or t.cfg.data  # its dataset's settings ([[data.datasets]])
        # Flip and dropout decisions from (seed, epoch, sample) alone: no RNG state to carry, so a
        # resumed run (and a loader that reads ahead) makes the same decisions.
        rng = random.Random(f"{t.cfg.train.seed}:{self.epoch}:{i}")
        flip = settings.flip and rng.random() < 0.5
        if t.cfg.data.crop == "random":
            # A new crop each time: encoded now, with the VAE kept on the device (fp32).
            pixels, time_ids = load_pixels(t.dataset.items[item_idx], "random", flip, rng)
            with torch.no_grad():
                dist = t.pipe.vae.encode(pixels[None].to(t.device, torch.float32)).latent_dist
            lat = {"mean": dist.mean[0].cpu(), "std": dist.std[0].cpu(),
                   "time_ids": torch.tensor(time_ids, dtype=torch.float32)}
            if t.cfg.data.masked_loss:
                lat["mask"] = load_mask(t.dataset.items[item_idx], flip, time_ids)
        else:
            lat = t.cache.get(t.latent_keys[item_idx][flip])
            if lat is not None and t.cfg.data.masked_loss:
                lat["mask"] = t.cache.get(t.mask_keys[item_idx][flip])["mask"]
        if lat is None:
            raise RuntimeError(f"latent cache entry for {t.dataset.items[item_idx].path} vanished during training")
        extra = {"mask": lat["mask"]} if t.cfg.data.masked_loss else {}
        # The key of this sample's noise and timestep draws (SDXLTask.loss): the same whichever process
        # or batch the sample lands in.
        extra["sample_key"] = torch.tensor(sample_key(t.cfg.train.seed, self.epoch, i))
        if t.has_reg:
            # Regularization samples weigh train.prior_loss_weight in the loss, and with train.prior_prediction
            # learn the base's own prediction (SDXLTask.loss).
            extra["loss_weight"] = torch.tensor(t.cfg.train.prior_loss_weight if item.is_reg else 1.0)
            extra["is_reg"] = torch.tensor(item.is_reg)
        if t.cfg.adapter.train_text_encoder:
            # The text encoders train: captions go in as tokens, encoded in the forward with gradients.
            caption = make_caption(item, t.cfg.data, rng)
            return {"latent_mean": lat["mean"], "latent_std": lat["std"], "time_ids": lat["time_ids"],
                    **t.tokenize(caption), **extra}
        if live_caption(item, t.cfg.data):
            # A new caption each time: encoded now, with the text encoders kept on the device.
            caption = make_caption(item, t.cfg.data, rng)
            with torch.no_grad():
                text = t.encode_text(caption)
        else:
            text = t.cache.get(t.text_keys[item_idx])
            if settings.caption_dropout and rng.random() < settings.caption_dropout:
                text = t.empty_text
        return {"latent_mean": lat["mean"], "latent_std": lat["std"], "time_ids": lat["time_ids"],
                "prompt_embeds": text["prompt_embeds"], "pooled": text["pooled"], **extra}

"""The SDXL task for the training loop: the UNet with its adapter, cached latents and text embeddings
as batches, the diffusion loss, the adapter file and preview images.

Latents and text embeddings are computed once, before the UNet loop, then the VAE and text encoders
leave the accelerator, so the UNet trains with the memory to itself.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .. import inject
from ..config import Config, ConfigError
from ..export import save_diffusers_lora
from ..runs import Run
from . import data as sdxl_data
from . import loss as diffusion
from .cache import TensorCache, cache_key, file_digest
from .model import load_pipeline, native_resolution, resolve_model_path
from .preview import render_previews

log = logging.getLogger(__name__)

_DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def component_identity(model_path: Path, component: str) -> str:
    """Identifies a model component's weights for cache keys: path, sizes and mtimes of its files.
    Cheap (no hashing of gigabytes) and changes whenever the weights are replaced."""
    root = model_path / component if model_path.is_dir() else model_path
    files = sorted(root.rglob("*")) if root.is_dir() else [root]
    h = hashlib.sha256(str(root.resolve()).encode())
    for f in files:
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _split(items: list, fraction: float) -> tuple[list, list]:
    """Hold out round(fraction * n) images (at least 1 when fraction > 0, never all), chosen by a hash of
    the file name: the same images whatever the folder order or the seed."""
    if fraction <= 0 or len(items) < 2:
        return list(items), []
    n_val = min(len(items) - 1, max(1, round(fraction * len(items))))
    ranked = sorted(items, key=lambda it: hashlib.sha256(it.path.name.encode()).hexdigest())
    held = {id(it) for it in ranked[:n_val]}
    return [it for it in items if id(it) not in held], [it for it in items if id(it) in held]


class CachedSDXLDataset(torch.utils.data.Dataset):
    """Items of the dataset (repeats expanded) as tensors read from the on-disk cache."""

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
        # Flip and dropout decisions from (seed, epoch, sample) alone: no RNG state to carry, so a
        # resumed run (and a loader that reads ahead) makes the same decisions.
        rng = random.Random(f"{t.cfg.train.seed}:{self.epoch}:{i}")
        flip = t.cfg.data.flip and rng.random() < 0.5
        if t.cfg.data.crop == "random":
            # A new crop each time: encoded now, with the VAE kept on the device (fp32).
            pixels, time_ids = sdxl_data.load_pixels(t.dataset.items[item_idx], "random", flip, rng)
            with torch.no_grad():
                dist = t.pipe.vae.encode(pixels[None].to(t.device, torch.float32)).latent_dist
            lat = {"mean": dist.mean[0].cpu(), "std": dist.std[0].cpu(),
                   "time_ids": torch.tensor(time_ids, dtype=torch.float32)}
        else:
            lat = t.cache.get(t.latent_keys[item_idx][flip])
        if lat is None:
            raise RuntimeError(f"latent cache entry for {t.dataset.items[item_idx].path} vanished during training")
        if t.cfg.data.shuffle_tags:
            # A new tag order each time: encoded now, with the text encoders kept on the device.
            caption = sdxl_data.make_caption(t.dataset.items[item_idx], t.cfg.data, rng)
            with torch.no_grad():
                text = t.encode_text(caption)
        else:
            text = t.cache.get(t.text_keys[item_idx])
            if t.cfg.data.caption_dropout and rng.random() < t.cfg.data.caption_dropout:
                text = t.empty_text
        return {"latent_mean": lat["mean"], "latent_std": lat["std"], "time_ids": lat["time_ids"],
                "prompt_embeds": text["prompt_embeds"], "pooled": text["pooled"]}


def _collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


class SDXLTask:
    def __init__(self, cfg: Config):
        self.cfg = cfg

    # ---- set-up, in dependency order: model -> data -> caches -> adapter ----
    def setup(self, accelerator, run: Run) -> None:
        cfg = self.cfg
        self.accelerator = accelerator
        self.device = accelerator.device
        self.model_path = resolve_model_path(cfg.model)
        self.pipe = load_pipeline(cfg.model)
        self.resolution = cfg.data.resolution or native_resolution(self.pipe)
        self.noise_scheduler = self._noise_scheduler()

        scanned = sdxl_data.scan(cfg.data, self.resolution)
        log.info("dataset:\n%s", scanned.report())
        train_items, val_items = _split(scanned.items, cfg.data.validation_split)
        # Training draws from train_items only; caches cover both (validation items come last).
        self.dataset = dataclasses.replace(scanned, items=train_items)
        self.all_items = train_items + val_items
        self.val_indices = list(range(len(train_items), len(self.all_items)))
        if val_items:
            log.info("validation: %d image(s) held out: %s", len(val_items), ", ".join(i.path.name for i in val_items))
        run.event("dataset", images=len(scanned.items), train_images=len(train_items),
                  held_out=[str(i.path) for i in val_items], samples=len(self.dataset),
                  problems=[{"path": str(p.path), "reason": p.reason} for p in scanned.problems],
                  buckets={f"{w}x{h}": n for (w, h), n in scanned.bucket_histogram().items()})


        cache_root = Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(cfg.output.runs_dir) / ".cache"
        self.cache = TensorCache(cache_root)
        computed = self._cache_latents()
        self._cache_text()
        run.event("cache", latents_computed=computed, latents_total=sum(len(k) for k in self.latent_keys))
        # The VAE and text encoders are done: off the accelerator, the UNet gets the memory. With tag
        # shuffling every caption is new, so the text encoders stay (frozen) for live encoding.
        done = []
        if cfg.data.crop == "random":
            log.info("data.crop='random': latents are encoded per sample (the cache holds the center crops "
                     "used for evaluation); the VAE stays on %s", self.device)
        else:
            done.append(self.pipe.vae)
        if cfg.data.shuffle_tags:
            log.info("data.shuffle_tags: text embeddings are computed per sample (not cached); "
                     "the text encoders stay on %s", self.device)
        else:
            done += [self.pipe.text_encoder, self.pipe.text_encoder_2]
        for m in done:
            m.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

        unet = self.pipe.unet
        # Ranks scale with the largest bucket's area: the most tokens any batch carries.
        largest = max(w * h for w, h in self.dataset.bucket_histogram())
        self.plan = inject.make_plan(unet, cfg.adapter, resolution=round(largest ** 0.5),
                                     native=native_resolution(self.pipe))
        mp = accelerator.mixed_precision
        # Frozen weights in the compute dtype; the adapter stays fp32 (apply_plan does that).
        unet.to(self.device, dtype=_DTYPES.get(mp, torch.float32))
        budget = cfg.adapter.rank_budget or (
            round(cfg.adapter.rank_budget_mb * 2**20 / 4) if cfg.adapter.rank_budget_mb else None)
        if budget:
            sensitivity = self._calibrate(unet)
            self.plan = inject.budget_plan(self.plan, sensitivity, budget, cfg.adapter.min_rank, cfg.adapter.max_rank)
            run.event("budget", budget=budget, trainable_params=self.plan.trainable_params,
                      sensitivity={k: round(v, 6) for k, v in sensitivity.items()})
        inject.apply_plan(unet, self.plan, dropout=cfg.adapter.dropout)
        if cfg.train.gradient_checkpointing:
            unet.enable_gradient_checkpointing()
        n = self.plan.trainable_params
        log.info("adapter plan:\n%s", inject.format_plan(self.plan))
        run.event("plan", layers=len(self.plan.targets), trainable_params=n, preset=cfg.adapter.preset,
                  base_rank=self.plan.base_rank, groups=self.plan.groups())

    def _calibrate(self, unet) -> dict[str, float]:
        """Sensitivity of each planned slot: the norm of its adapter's gradient, summed over the first
        `calibration_batches` batches, with a throwaway rank-4 adapter on every planned slot. The RNG
        is forked, so the run after it is the same as without it."""
        probe = inject.Plan(self.plan.targets, {s.name: 4 for s in self.plan.targets},
                            {s.name: 4.0 for s in self.plan.targets})
        inject.apply_plan(unet, probe, adapter_name="calibration")
        norms = {s.name: 0.0 for s in self.plan.targets}
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.cfg.train.seed)
            batches = iter(self.dataloader())
            for _ in tqdm(range(self.cfg.adapter.calibration_batches), desc="calibrating ranks", unit="batch"):
                try:
                    batch = next(batches)
                except StopIteration:
                    batches = iter(self.dataloader())
                    batch = next(batches)
                batch = {k: v.to(self.device) for k, v in batch.items()}
                with self.accelerator.autocast():
                    loss = self.loss(unet, batch)
                grads = torch.autograd.grad(loss, [m.lora_B["calibration"].weight for m in self._lora_layers(unet)])
                for name, g in zip(norms, grads):
                    norms[name] += g.float().norm().item()
        unet.delete_adapters("calibration")
        unet.requires_grad_(False)
        return norms

    def validate(self, model) -> float | None:
        """The loss on the held-out images, or None when data.validation_split is 0."""
        return self.evaluate(model, self.val_indices) if self.val_indices else None

    def _lora_layers(self, unet):
        modules = dict(unet.named_modules())
        return [modules[s.name] for s in self.plan.targets]

    def _noise_scheduler(self):
        from diffusers import DDPMScheduler

        # Overrides go in as keyword arguments: keys set in the config dict itself are dropped when the
        # config lists them among its defaults (_use_default_values), silently.
        overrides = {}
        if self.cfg.model.prediction_type != "auto":
            overrides["prediction_type"] = self.cfg.model.prediction_type
        if self.cfg.train.zero_terminal_snr:
            overrides["rescale_betas_zero_snr"] = True
        sched = DDPMScheduler.from_config(self.pipe.scheduler.config, **overrides)
        n = sched.config.num_train_timesteps
        tc = self.cfg.train
        self.timestep_max = n - 1 if tc.timestep_max is None else tc.timestep_max
        if self.timestep_max >= n or tc.timestep_min > self.timestep_max:
            raise ConfigError(f"train.timestep_min={tc.timestep_min}, train.timestep_max={tc.timestep_max}: the "
                             f"model's schedule has timesteps 0..{n - 1}; choose a range inside it")
        return sched

    @torch.no_grad()
    def _cache_latents(self) -> int:
        """Encode what the cache lacks; returns how many latents were computed."""
        vae = self.pipe.vae
        # fp32 VAE: SDXL's VAE overflows in fp16 and gives NaN latents.
        vae.to(self.device, dtype=torch.float32)
        vae_id = component_identity(self.model_path, "vae")
        flips = (False, True) if self.cfg.data.flip else (False,)
        self.latent_keys: list[dict[bool, str]] = []
        rng = random.Random(0)  # center crop and fixed flips: the rng is not consulted for the result
        todo = []
        for idx, item in enumerate(self.all_items):
            keys = {}
            digest = file_digest(item.path)
            for flip in flips:
                keys[flip] = cache_key("latent", digest, item.bucket, "center", flip, vae_id)
                if self.cache.get(keys[flip]) is None:
                    todo.append((idx, flip, keys[flip]))
            self.latent_keys.append(keys)
        if not todo:
            log.info("latent cache: all %d entries reused", sum(len(k) for k in self.latent_keys))
            return 0
        for idx, flip, key in tqdm(todo, desc="caching latents", unit="img"):
            item = self.all_items[idx]
            pixels, time_ids = sdxl_data.load_pixels(item, "center", flip, rng)
            dist = vae.encode(pixels[None].to(self.device, torch.float32)).latent_dist
            mean, std = dist.mean[0].cpu(), dist.std[0].cpu()
            if not (torch.isfinite(mean).all() and torch.isfinite(std).all()):
                raise ValueError(f"the VAE gave non-finite latents for {item.path}; the image may be corrupt "
                                 "or the VAE broken (try another VAE)")
            self.cache.put(key, {"mean": mean, "std": std, "time_ids": torch.tensor(time_ids, dtype=torch.float32)})
        return len(todo)

    @torch.no_grad()
    def _cache_text(self) -> None:
        pipe = self.pipe
        for m in (pipe.text_encoder, pipe.text_encoder_2):
            m.to(self.device)
        te_id = component_identity(self.model_path, "text_encoder") + component_identity(self.model_path, "text_encoder_2")
        # Captions are fixed here (trigger word, class token); dropout happens per sample at train time.
        fixed = self.cfg.data.model_copy(update={"caption_dropout": 0.0, "shuffle_tags": False})
        rng = random.Random(0)
        captions = [sdxl_data.make_caption(item, fixed, rng) for item in self.all_items]
        self.text_keys = [cache_key("text", c, te_id) for c in captions]
        unique = {k: c for k, c in zip(self.text_keys, captions)}
        empty_key = cache_key("text", "", te_id)
        unique[empty_key] = ""
        for key, caption in tqdm(list(unique.items()), desc="caching text", unit="caption"):
            if self.cache.get(key) is None:
                self.cache.put(key, self.encode_text(caption))
        self.empty_text = self.cache.get(empty_key)

    def encode_text(self, caption: str) -> dict[str, torch.Tensor]:
        # diffusers' own SDXL prompt encoding: penultimate hidden states of both encoders, concatenated,
        # and the second encoder's pooled projection.
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=caption, device=self.device, num_images_per_prompt=1, do_classifier_free_guidance=False)
        return {"prompt_embeds": embeds[0].float().cpu(), "pooled": pooled[0].float().cpu()}

    # ---- what the loop asks for ----
    def model(self) -> torch.nn.Module:
        return self.pipe.unet

    def param_groups(self) -> list[dict]:
        return [{"params": inject.trainable_parameters(self.pipe.unet)}]

    def dataloader(self) -> torch.utils.data.DataLoader:
        ds = CachedSDXLDataset(self)
        sampler = sdxl_data.BucketBatchSampler(self.dataset, self.cfg.train.batch_size, self.cfg.train.seed)
        return torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=_collate, num_workers=0)

    def batch_size(self, batch) -> int:
        return int(batch["latent_mean"].shape[0])

    def loss(self, model, batch) -> torch.Tensor:
        """The diffusion loss with the train.* options (sdxl/loss.py); draws in a fixed order: latent
        sample, noise (and offset), timesteps."""
        tc, sched = self.cfg.train, self.noise_scheduler
        scale = self.pipe.vae.config.scaling_factor
        mean, std = batch["latent_mean"], batch["latent_std"]
        latents = (mean + std * torch.randn_like(mean)) * scale
        noise = diffusion.draw_noise(latents, tc.noise_offset)
        t = diffusion.draw_timesteps(latents.shape[0], tc.timestep_min, self.timestep_max, latents.device)
        noisy = sched.add_noise(latents, noise, t)
        prediction_type = sched.config.prediction_type
        target = sched.get_velocity(latents, noise, t) if prediction_type == "v_prediction" else noise
        pred = model(noisy, t, encoder_hidden_states=batch["prompt_embeds"],
                     added_cond_kwargs={"text_embeds": batch["pooled"], "time_ids": batch["time_ids"]}).sample
        return diffusion.diffusion_loss(pred, target, t, sched.alphas_cumprod, kind=tc.loss,
                                        huber_delta=tc.huber_delta, min_snr_gamma=tc.min_snr_gamma,
                                        prediction_type=prediction_type)

    @torch.no_grad()
    def evaluate(self, model, indices: list[int] | None = None) -> float:
        """Loss on the given images (default: up to 8 training images) at fixed timesteps and fixed
        noise (latent means, no sampling): the same number for the same weights, so before/after and
        two runs compare like for like."""
        sched = self.noise_scheduler
        scale = self.pipe.vae.config.scaling_factor
        n_t = sched.config.num_train_timesteps
        timesteps = torch.tensor([n_t // 8, 3 * n_t // 8, 5 * n_t // 8, 7 * n_t // 8], device=self.device)
        gen = torch.Generator("cpu").manual_seed(0)
        was_training = model.training
        model.eval()
        losses = []
        try:
            for idx in (indices if indices is not None else range(min(8, len(self.dataset.items)))):
                lat = self.cache.get(self.latent_keys[idx][False])
                text = self.cache.get(self.text_keys[idx])
                latents = (lat["mean"] * scale).expand(len(timesteps), -1, -1, -1).to(self.device)
                noise = torch.randn(latents.shape, generator=gen).to(self.device)
                batch = {"noisy": sched.add_noise(latents, noise, timesteps),
                         "target": (sched.get_velocity(latents, noise, timesteps)
                                    if sched.config.prediction_type == "v_prediction" else noise)}
                k = len(timesteps)
                with self.accelerator.autocast():
                    pred = model(batch["noisy"], timesteps,
                                 encoder_hidden_states=text["prompt_embeds"].expand(k, -1, -1).to(self.device),
                                 added_cond_kwargs={"text_embeds": text["pooled"].expand(k, -1).to(self.device),
                                                    "time_ids": lat["time_ids"].expand(k, -1).to(self.device)}).sample
                losses.append(F.mse_loss(pred.float(), batch["target"].float()).item())
        finally:
            model.train(was_training)
        return sum(losses) / len(losses)

    def save_adapter(self, model, run: Run, step: int) -> dict[str, Path]:
        # The kohya file is the main one (ComfyUI, AUTOMATIC1111/Forge, kohya and diffusers load it); the
        # diffusers/PEFT file sits beside it, with the same description (no absolute paths in either).
        from ..export import adapter_from_model, save_kohya_lora, training_metadata

        cfg = self.cfg
        datasets: dict[str, list[tuple[str, int]]] = {}
        for item in self.dataset.items:
            datasets.setdefault(item.dataset.name, []).append((item.caption, item.repeats))
        meta = training_metadata(
            title=run.name, steps=step, resolution=self.resolution, trigger_phrase=cfg.data.trigger_word,
            base_model=cfg.model.path, datasets=datasets,
            extra={"ss_learning_rate": str(cfg.train.lr), "ss_batch_size_per_device": str(cfg.train.batch_size),
                   "ss_lr_scheduler": cfg.train.scheduler, "ss_seed": str(cfg.train.seed),
                   "ss_network_dropout": str(cfg.adapter.dropout),
                   "ss_mixed_precision": str(self.accelerator.mixed_precision),
                   "sdxl_lora.steps": str(step), "sdxl_lora.resolution": str(self.resolution),
                   "sdxl_lora.preset": cfg.adapter.preset})
        adapter = adapter_from_model(model)
        main = run.dir / f"{run.name}.safetensors"
        if any(layer.bias is not None for layer in adapter.layers.values()):
            log.warning("adapter.lora_bias: the kohya format has no LoRA bias, so %s is in diffusers format "
                        "(diffusers and peft load it; ComfyUI and AUTOMATIC1111 may not)", main.name)
            return {"diffusers": save_diffusers_lora(adapter, main, extra_metadata=meta)}
        kohya = save_kohya_lora(adapter, main, unet_config=model.config, metadata=meta)
        diffusers = save_diffusers_lora(adapter, run.dir / f"{run.name}.diffusers.safetensors", extra_metadata=meta)
        return {"kohya": kohya, "diffusers": diffusers}

    def preview(self, model, run: Run, step: int) -> list[Path]:
        return render_previews(self, model, run, step)

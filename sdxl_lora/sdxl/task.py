"""The SDXL task for the training loop: the UNet with its adapter, cached latents and text embeddings
as batches, the diffusion loss, the adapter file and preview images.

Latents and text embeddings are computed once, before the UNet loop, then the VAE and text encoders
leave the accelerator, so the UNet trains with the memory to itself.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import random
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..core import inject, speed
from . import speed as unet_speed
from ..core.accel import local_device_index
from ..core.card import this_card
from ..core.config import Config, ConfigError
from .formats.export import save_diffusers_lora
from ..core.runs import Run
from ..core.task import Task
from . import data as sdxl_data
from . import loss as diffusion
from . import memory as sdxl_memory
from . import baseline
from .batches import CachedSDXLDataset, collate
from .buckets import BucketBatchSampler
from .cache import TensorCache, cache_key, component_identity, file_digest
from .captions import live_text, make_caption
from .model import load_pipeline, native_resolution, resolve_model_path, stored_unet_dtype
from .pixels import load_mask, load_pixels
from .plan import plan_run, plan_unet, run_memory_for, text_encoder_rank_alpha, unet_read_on_device
from .preview import PreviewPrompt, default_prompts, encode_prompts, read_prompts, render_previews, vae_tiles
from .unet_call import UNetCall

log = logging.getLogger(__name__)

_DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _split(items: list, fraction: float) -> tuple[list, list]:
    """Hold out round(fraction * n) images (at least 1 when fraction > 0, never all), chosen by a hash of
    the file name: the same images whatever the folder order or the seed."""
    if fraction <= 0 or len(items) < 2:
        return list(items), []
    n_val = min(len(items) - 1, max(1, round(fraction * len(items))))
    ranked = sorted(items, key=lambda it: hashlib.sha256(it.path.name.encode()).hexdigest())
    held = {id(it) for it in ranked[:n_val]}
    return [it for it in items if id(it) not in held], [it for it in items if id(it) in held]


class SDXLAdapterModel(torch.nn.Module):
    """The UNet and both text encoders as one module, for training LoRA on the text encoders too
    (adapter.train_text_encoder): the loop's checkpoints, optimizer and DDP see every adapter weight
    (named unet.*, text_encoder.*, text_encoder_2.*), and one forward runs text encoding and UNet."""

    def __init__(self, unet, text_encoder, text_encoder_2):
        super().__init__()
        self.unet, self.text_encoder, self.text_encoder_2 = unet, text_encoder, text_encoder_2

    def encode(self, input_ids: torch.Tensor, input_ids_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # As diffusers' SDXL encode_prompt: the penultimate hidden states of both encoders, concatenated,
        # and the second encoder's pooled projection; here with gradients.
        h1 = self.text_encoder(input_ids, output_hidden_states=True).hidden_states[-2]
        out2 = self.text_encoder_2(input_ids_2, output_hidden_states=True)
        return torch.cat([h1, out2.hidden_states[-2]], dim=-1), out2[0]

    def forward(self, sample, timestep, *, input_ids, input_ids_2, time_ids):
        embeds, pooled = self.encode(input_ids, input_ids_2)
        return self.unet(sample, timestep, encoder_hidden_states=embeds,
                         added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids})


TE_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """Every peft adapter layer of `model` computes its base layer's output alone, for the duration. peft's
    enable_adapters(False) would also clear the adapters' requires_grad (and set_adapter restore it), which a
    training step must not see, so the flag its forward reads is set directly."""
    layers = [m for m in model.modules() if hasattr(m, "_disable_adapters")]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, flag in zip(layers, before):
            m._disable_adapters = flag


class SDXLTask(Task):
    # The per-sample RNG keys stay on the host: _keyed_draws reads them without waiting for the GPU.
    host_keys = ("sample_key",)

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.unet_call = UNetCall(self)  # how the training steps call the UNet (eager, graphed, compiled)
        self._run: Run | None = None
        self._speed_choices: dict[str, str] = {}
        self._identity: dict | None = None
        self._budget = None  # the card's or train.vram_gb's plan (sdxl/plan.py: plan_run)
        self.preview_texts: list[dict] | None = None  # the preview prompts' embeddings, made at set-up
        self.run_memory: sdxl_memory.RunMemory | None = None  # the whole run's estimate, made with the plan
        self.has_reg = False  # the data holds regularization images (set when it is read)
        self._explicit: set[str] = set(cfg.train.model_fields_set)

    def configure(self, cfg: Config, device_type: str, processes: int) -> Config:
        """train.speed="auto": CUDA graphs, compilation and channels_last chosen for this device and run
        (sdxl/speed.py: auto_levers); set up and logged with the other levers."""
        self._explicit = set(cfg.train.model_fields_set)  # what the user set, before auto adds to it
        # The whole run planned for the card it runs on, or train.vram_gb, before any weight is read: a run
        # that does not fit gets the levers that do, or is refused here (sdxl/plan.py: plan_run). Before the
        # speed levers: what fits decides the quantization, which auto's choice depends on.
        card = this_card(local_device_index(), free=processes == 1) if device_type == "cuda" else None
        self._budget = plan_run(cfg, card) if card is not None or cfg.train.vram_gb else None
        if self._budget is not None:
            log.info("card: %s", self._budget.verdict())
            cfg = self._budget.cfg
        self.cfg, self._speed_choices = unet_speed.auto_levers(cfg, device_type, processes)
        return self.cfg

    # ---- set-up, in dependency order ----
    def setup(self, accelerator, run: Run) -> None:
        """model -> data -> caches -> plan and memory estimate -> quantization -> adapter -> speed levers."""
        cfg = self.cfg
        self.accelerator = accelerator
        self._run = run
        self.device = accelerator.device
        if self._budget is not None and self._budget.budget_gib and self.device.type == "cuda":
            self._cap_memory()
        self.model_path = resolve_model_path(cfg.model)
        # The frozen UNet in the dtype it trains in, from the start. A base to quantize is read in the 16-bit dtype
        # its files store, where training computes in 16 bits: every quantizer then makes its blocks from exactly
        # the file's values (as from an fp32 copy, without the host's cast and its 4 bytes a weight); otherwise
        # in fp32, as before.
        quantized = cfg.model.quantize != "none" or cfg.model.quantize_convs != "none"
        frozen = _DTYPES.get(accelerator.mixed_precision, torch.float32)
        unet_dtype = frozen
        if quantized:
            stored = stored_unet_dtype(cfg.model) if frozen != torch.float32 else None
            unet_dtype = stored if stored in (torch.float16, torch.bfloat16) else None
        on_device = self.device if self.device.type == "cuda" and unet_read_on_device(cfg) else None
        # The text encoders as their files store them: cast to fp32 only if they encode (to_encode).
        self.pipe = load_pipeline(cfg.model, unet_dtype=unet_dtype, unet_device=on_device, encoders_as_stored=True)
        self.resolution = cfg.data.resolution or native_resolution(self.pipe)
        self.noise_scheduler = self._noise_scheduler()
        self._read_data(run)
        self._fill_caches(run)
        self.preview_prompts = self._preview_prompts()
        self.preview_texts = self._encode_previews()
        self._release_encoders()
        unet = self.pipe.unet
        self._plan(unet, run)
        if cfg.model.quantize != "none" or cfg.model.quantize_convs != "none":
            # QLoRA: the Linears (and convolutions) quantized one at a time on the device (docs/qlora.md),
            # before the rest moves.
            from .quantize import quantize_unet
            quantize_unet(unet, cfg.model, accelerator.mixed_precision, self.device, run)
        # Frozen weights in the compute dtype; the adapter stays fp32 (apply_plan does that).
        unet.to(self.device, dtype=_DTYPES.get(accelerator.mixed_precision, torch.float32))
        self._inject_adapter(unet, run)
        self.unet_call.setup(unet, run)  # the speed levers and how training calls run (sdxl/unet_call.py)
        log.info("adapter plan: %s", inject.plan_summary(self.plan))
        # The layer table in the run's train.log, and in the terminal with -v (training.setup_logging: detail).
        log.info("adapter plan, by layer group:\n%s", inject.format_plan(self.plan), extra={"detail": True})
        run.event("plan", layers=len(self.plan.targets), trainable_params=self.plan.trainable_params,
                  preset=cfg.adapter.preset, adapter_kind=cfg.adapter.kind, base_rank=self.plan.base_rank,
                  groups=self.plan.groups())

    def _read_data(self, run: Run) -> None:
        """The dataset scanned and split: training draws from the training items only; the caches cover
        all items, the held-out ones last."""
        from .class_images import with_class_images

        cfg = self.cfg
        # Regularization tables with a class_prompt: their images made by the base (or read from the cache) first.
        data = with_class_images(self, cfg.data, self.resolution)
        scanned = sdxl_data.scan(data, self.resolution)
        log.info("dataset:\n%s", scanned.report())
        # Regularization images are not the concept: the held-out loss is measured on the training images only.
        train_items, val_items = _split([it for it in scanned.items if not it.is_reg], cfg.data.validation_split)
        train_items += [it for it in scanned.items if it.is_reg]
        self.has_reg = any(it.is_reg for it in train_items)
        self.dataset = dataclasses.replace(scanned, items=train_items)
        self.all_items = train_items + val_items
        self.val_indices = list(range(len(train_items), len(self.all_items)))
        if val_items:
            log.info("validation: %d image(s) held out: %s", len(val_items), ", ".join(i.path.name for i in val_items))
        run.event("dataset", images=len(scanned.items), train_images=len(train_items),
                  held_out=[str(i.path) for i in val_items], samples=len(self.dataset),
                  problems=[{"path": str(p.path), "reason": p.reason} for p in scanned.problems],
                  buckets={f"{w}x{h}": n for (w, h), n in scanned.bucket_histogram().items()},
                  datasets=self.dataset.summary())

    def identity(self) -> dict:
        """The base (as configured, and how it is stored), the training resolution, the planned adapter
        (before any rank schedule) and the images: what a resume must find unchanged. Taken once, after
        set-up: every state of the run carries the same one, and its images are not read again."""
        if self._identity is not None:
            return self._identity
        cfg = self.cfg
        images = hashlib.sha256()
        for item in sorted(self.all_items, key=lambda it: str(it.path)):
            reg = ":reg" if item.is_reg else ""
            images.update(f"{item.path.relative_to(item.dataset)}:{item.path.stat().st_size}:{item.repeats}{reg}\n"
                          .encode())
        self._identity = {
            "model": cfg.model.path, "quantize": f"{cfg.model.quantize}/{cfg.model.quantize_convs}",
            "resolution": self.resolution, "images": f"{len(self.all_items)} images, {images.hexdigest()[:12]}",
            "adapter": {s.name: self.planned.rank[s.name] for s in self.planned.targets},
            "text_encoders": cfg.adapter.train_text_encoder}
        if cfg.data.datasets:
            # Each dataset's settings (resolution, captions, trigger word, regularization) change what trains.
            tables = [d.model_dump(mode="json", exclude={"path", "name"}) for d in cfg.data.datasets]
            self._identity["datasets"] = hashlib.sha256(repr(tables).encode()).hexdigest()[:12]
        if self.has_reg:
            self._identity["prior_loss_weight"] = cfg.train.prior_loss_weight
            self._identity["prior_prediction"] = cfg.train.prior_prediction
        return self._identity

    def _preview_prompts(self) -> list[PreviewPrompt]:
        """preview.prompts, read now (a bad file fails before training, not at the first preview); unset: the
        demo base's own prompts, or a few of this dataset's captions (sdxl/preview.py: default_prompts)."""
        if self.cfg.preview.prompts is not None:
            return read_prompts(self.cfg.preview.prompts)
        n = len(self.dataset.items)  # training items first in all_items; the held-out ones are not previewed
        return default_prompts(self.cfg.model.path, self.all_items[:n], self.captions[:n])

    def _encode_previews(self) -> list[dict] | None:
        """The preview prompts' embeddings (on the host), made while the text encoders are on the device for the
        caches: previews then never bring them back. None when the text encoders train (previews encode with
        the encoders being trained) or this process renders no previews."""
        if not self.preview_prompts or self.cfg.adapter.train_text_encoder or not self.accelerator.is_main_process:
            return None
        guidance = self.cfg.preview.guidance
        # Cached like the captions' embeddings: a relaunch with the text cache complete never moves the encoders.
        keys = [cache_key("preview-text", p.prompt, p.negative, (guidance if p.guidance is None else p.guidance) > 1,
                          self.text_encoders_id) for p in self.preview_prompts]
        prompts = dict(zip(keys, self.preview_prompts))  # a prompt listed again (other seeds) is encoded once

        def encode(key: str) -> dict[str, torch.Tensor]:
            self.to_encode(self.pipe.text_encoder, self.pipe.text_encoder_2)
            texts = encode_prompts(self.pipe, [prompts[key]], guidance=guidance, device=self.device)
            return {k: v.cpu() for k, v in texts[0].items()}

        self.cache.fill(keys, encode, desc="caching preview prompts")
        texts = {k: self.cache.get(k) for k in prompts}
        return [texts[k] for k in keys]

    def to_encode(self, *modules: torch.nn.Module) -> None:
        """The VAE or text encoders on the device in fp32, where they are not yet: they go there when something
        is to be encoded, so a run whose caches are complete leaves them on the host as they were read."""
        for m in modules:
            p = next(m.parameters())
            elsewhere = p.device.type != self.device.type or (self.device.index is not None
                                                              and p.device.index != self.device.index)
            if elsewhere or p.dtype != torch.float32:
                m.to(self.device, dtype=torch.float32)

    def _fill_caches(self, run: Run) -> None:
        """Latents (and masks) and text embeddings computed where the cache lacks them, the work split
        between the processes of a machine."""
        from accelerate.utils import gather_object

        cfg = self.cfg
        self.cache = TensorCache(cfg.cache_root())
        computed = self._cache_latents()
        if cfg.data.masked_loss:
            self._cache_masks()
        self._cache_text()
        by_process = gather_object([computed])  # [n] in one process
        run.event("cache", latents_computed=sum(by_process), latents_by_process=by_process,
                  latents_total=sum(len(k) for k in self.latent_keys))

    def _release_encoders(self) -> None:
        """The VAE and text encoders are done: off the accelerator, the UNet gets the memory. Those that
        still encode during training (random crops, tag shuffling, text encoder LoRA) stay."""
        cfg = self.cfg
        done = []
        if cfg.data.crop == "random":
            log.info("data.crop='random': latents are encoded per sample (the cache holds the center crops "
                     "used for evaluation); the VAE stays on %s", self.device)
        else:
            done.append(self.pipe.vae)
        if cfg.adapter.train_text_encoder:
            log.info("adapter.train_text_encoder: the text encoders train, so text embeddings are computed live "
                     "(with gradients) and not cached; the text encoders stay on %s", self.device)
        elif live_text(cfg.data):
            log.info("data.shuffle_tags, data.tag_dropout or data.wildcards: text embeddings are computed per sample (not cached); "
                     "the text encoders stay on %s", self.device)
        else:
            done += [self.pipe.text_encoder, self.pipe.text_encoder_2]
        for m in done:
            m.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def dequantized_previews(self) -> int:
        """Bytes of 16-bit copies of a quantized base's layers previews render from: as many as the plan found fit
        under the run's peak (0: none)."""
        return self.run_memory.dequantized_bytes if self.run_memory is not None else 0

    def _plan(self, unet, run: Run) -> None:
        """The adapter's plan, its ranks scaled to the largest bucket's area (the most tokens any batch
        carries), and the memory estimate it gives."""
        largest = max(w * h for w, h in self.dataset.bucket_histogram())
        planned = plan_unet(self.cfg, unet, native_resolution(self.pipe), resolution=round(largest ** 0.5),
                            mixed_precision=self.accelerator.mixed_precision)
        self.plan, self.memory = planned.plan, planned.memory
        log.info("%s", planned.memory.format())
        p = self.pipe
        components = tuple(sum(t.numel() for t in m.parameters()) * 4
                           for m in (p.vae, p.text_encoder, p.text_encoder_2))
        previews = [(e.width or self.resolution) * (e.height or self.resolution) for e in self.preview_prompts]
        self.run_memory = run_memory_for(self.cfg, planned, (components[0], components[1] + components[2]),
                                         largest_pixels=largest, preview_pixels=max(previews, default=None))
        log.info("%s", self.run_memory.format())
        run.event("memory_estimate", **planned.memory.as_dict(), run=self.run_memory.as_dict())
        if self._budget is not None:
            self._apply_budget(run)

    def _apply_budget(self, run: Run) -> None:
        """The card's or train.vram_gb's plan: what was chosen, against the run's estimate from its own data."""
        fit, card = self._budget, self._budget.card
        run.event("budget_plan", vram_gb=fit.budget_gib, choices=fit.choices, slowdown=fit.slowdown,
                  peak_gib=round(self.run_memory.peak / 2**30, 3), card_budget=fit.card_budget,
                  **({"card": card.name, "card_gib": round(card.total / 2**30, 2),
                      "card_free_gib": round(card.free / 2**30, 2)} if card is not None else {}))

    def _cap_memory(self) -> None:
        """train.vram_gb on a GPU: the process capped at the budget (core/memory.py: cap_process_memory)."""
        from ..core.memory import cap_process_memory

        gib = self.cfg.train.vram_gb
        if not cap_process_memory(self.device, gib):
            log.warning("train.vram_gb=%g is at least this GPU's memory: nothing to cap", gib)

    def _inject_adapter(self, unet, run: Run) -> None:
        """The plan's LoRA layers in the UNet, their ranks first fitted to adapter.rank_budget where one is
        set; LoRA on the text encoders with adapter.train_text_encoder."""
        cfg, accelerator = self.cfg, self.accelerator
        self._adapter_model = (SDXLAdapterModel(unet, self.pipe.text_encoder, self.pipe.text_encoder_2)
                               if cfg.adapter.train_text_encoder else None)
        budget = inject.rank_budget(cfg.adapter)
        if budget:
            sensitivity = self._calibrate(unet)
            if accelerator.num_processes > 1:
                from accelerate.utils import broadcast_object_list

                # Every process must apply the same plan (DDP needs identical models): the main one's.
                sensitivity = broadcast_object_list([sensitivity])[0]
            self.plan = inject.budget_plan(self.plan, sensitivity, budget, cfg.adapter.min_rank, cfg.adapter.max_rank)
            run.event("budget", budget=budget, trainable_params=self.plan.trainable_params,
                      sensitivity={k: round(v, 6) for k, v in sensitivity.items()})
        inject.apply_plan(unet, self.plan, dropout=cfg.adapter.dropout)
        if _DTYPES[accelerator.mixed_precision] != torch.float32:
            # Every UNet forward of a 16-bit run is under autocast (training, evaluation, previews, the checkpointing
            # trials): peft's cast of each adapter layer's input to its fp32 weights made a copy per layer that
            # autocast cast back, and kept it for the backward (core/inject.py).
            inject.adapters_take_autocast_inputs(unet)
        if cfg.adapter.kind in ("loha", "lokr") and cfg.train.fuse_qkv:
            log.info("adapter.kind=%r: the attention projections run peft's %s layers (train.lora_matmul's fused "
                     "products are LoRA's and DoRA's); the q/k/v base weights still share one buffer",
                     cfg.adapter.kind, {"loha": "LoHa", "lokr": "LoKr"}[cfg.adapter.kind])
        self.planned = self.plan  # the plan before any rank schedule shrinks it
        if cfg.adapter.rank_schedule and accelerator.num_processes > 1:
            raise ConfigError("adapter.rank_schedule runs in one process (shrinking replaces parameters that DDP "
                              "has registered); train on one process or drop the schedule")
        if cfg.adapter.train_text_encoder:
            self._text_encoder_lora(run)

    def _calibrate(self, unet) -> dict[str, float]:
        """Each planned slot's sensitivity for the rank budget (core/inject.py: calibrate), on whole batches."""
        def loss(batch):
            batch = {k: v.to(self.device) for k, v in batch.items()}
            with self.accelerator.autocast():
                return self.loss(unet, batch)

        return inject.calibrate(unet, self.plan, lambda: iter(self.dataloader(shard=False)), loss,
                                self.cfg.adapter.calibration_batches,
                                [self.device] if self.device.type == "cuda" else [], seed=self.cfg.train.seed,
                                show=self.accelerator.is_main_process)

    def on_step(self, step: int, model) -> bool:
        """The rank schedule (adapter.rank_schedule): at its steps the UNet's adapters shrink by SVD.
        Returns True when trainable parameters were replaced (the loop then rebuilds the optimizer)."""
        target = self.cfg.adapter.rank_schedule.get(step)
        if target is None:
            return False
        return self._shrink_to(target, step)

    def restore_step(self, step: int, model) -> bool:
        """Before a resume at `step`: the adapters take the shapes the schedule gave them by then (the saved
        weights are loaded over them). True when any shape changed."""
        changed = False
        for at, target in self.cfg.adapter.rank_schedule.items():
            if at <= step:
                changed |= self._shrink_to(target, at)
        return changed

    def _shrink_to(self, target: int, step: int) -> bool:
        unet = self.pipe.unet
        ranks = inject.scheduled_ranks(self.plan, self.planned, target, self.cfg.adapter.min_rank)
        if ranks == self.plan.rank:
            return False
        before = self.plan.trainable_params
        self.plan = inject.shrink_adapters(unet, self.plan, ranks, dropout=self.cfg.adapter.dropout)
        self.unet_call.adapter_changed()  # captured graphs hold the old factors
        log.info("step %d: adapter ranks shrunk to base rank %d by SVD (%s -> %s trainable parameters)",
                 step, target, f"{before:,}", f"{self.plan.trainable_params:,}")
        if self.accelerator.is_main_process:
            self._run.event("rank_schedule", step=step, base_rank=target, trainable_params=self.plan.trainable_params,
                            groups=self.plan.groups())
        return True

    def compiled(self) -> None:
        """The regions compiled (and ran): a later run like this one finds the compile cache warm, which
        train.speed="auto" counts on (sdxl/speed.py: compile_cache_warm)."""
        if self.accelerator.is_main_process:
            unet_speed.mark_compiled(self.cfg)

    def end_training(self) -> None:
        """The training steps' CUDA graphs go before the final evaluation and previews (UNetCall.release)."""
        self.unet_call.release()

    def _text_encoder_lora(self, run: Run) -> None:
        """The adapter (adapter.kind) on both text encoders' attention projections (kohya's lora_te1_/lora_te2_
        layers), fp32."""
        from peft import inject_adapter_in_model

        a = self.cfg.adapter
        rank, alpha = text_encoder_rank_alpha(a)
        counts = {}
        for name in ("text_encoder", "text_encoder_2"):
            te = getattr(self.pipe, name)
            te.requires_grad_(False)
            inject_adapter_in_model(inject.adapter_config(a.kind, rank, alpha, TE_TARGETS, dropout=a.dropout,
                                                          rslora=a.rslora,
                                                          lokr_factor=-1 if a.lokr_factor is None else a.lokr_factor), te)
            for n, p in te.named_parameters():
                if inject.is_adapter_param(n):
                    p.data = p.data.float()
                    p.requires_grad_(True)
            counts[name] = sum(p.numel() for p in te.parameters() if p.requires_grad)
        log.info("text encoder %s: rank %d, alpha %g on %s; trainable parameters %s", a.kind, rank, alpha,
                 ", ".join(TE_TARGETS), counts)
        run.event("text_encoder_lora", rank=rank, alpha=alpha, trainable_params=counts)

    def tokenize(self, caption: str) -> dict[str, torch.Tensor]:
        """Token ids for both text encoders, padded to their length, as diffusers' encode_prompt makes them."""
        out = {}
        for key, tok in (("input_ids", self.pipe.tokenizer), ("input_ids_2", self.pipe.tokenizer_2)):
            out[key] = tok(caption, padding="max_length", max_length=tok.model_max_length, truncation=True,
                           return_tensors="pt").input_ids[0]
        return out

    @torch.no_grad()
    def _cache_masks(self) -> None:
        """Each image's loss mask at latent resolution, with the same crop and flip as its cached latent."""
        self.mask_keys: list[dict[bool, str]] = []
        todo = []
        for idx, item in enumerate(self.all_items):
            digest = file_digest(item.mask) if item.mask is not None else "none"
            keys = {}
            for flip, lkey in self.latent_keys[idx].items():
                keys[flip] = cache_key("mask", digest, lkey)
                if self.cache.get(keys[flip]) is None:
                    todo.append((idx, flip, keys[flip]))
            self.mask_keys.append(keys)
        for idx, flip, key in tqdm(todo, desc="caching masks", unit="img", disable=not todo):
            time_ids = self.cache.get(self.latent_keys[idx][flip])["time_ids"].tolist()
            self.cache.put(key, {"mask": load_mask(self.all_items[idx], flip, time_ids)})

    def validate(self, model) -> float | None:
        """The loss on the held-out images, or None when data.validation_split is 0."""
        return self.evaluate(model, self.val_indices) if self.val_indices else None

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
        # fp32 VAE (to_encode): SDXL's VAE overflows in fp16 and gives NaN latents. On the device only where
        # something is encoded: per sample (data.crop='random') or what the cache lacks.
        if self.cfg.data.crop == "random":
            self.to_encode(vae)
        vae_id = component_identity(self.model_path, "vae")
        tiled = self.cfg.model.tiled_vae_encode
        self.latent_keys: list[dict[bool, str]] = []
        rng = random.Random(0)  # center crop and fixed flips: the rng is not consulted for the result
        source: dict[str, tuple[int, bool]] = {}
        for idx, item in enumerate(self.all_items):
            keys = {}
            digest = file_digest(item.path)
            for flip in (False, True) if (item.settings or self.cfg.data).flip else (False,):
                keys[flip] = cache_key("latent", digest, item.bucket, "center", flip, vae_id, *(["tiled"] * tiled))
                source.setdefault(keys[flip], (idx, flip))
            self.latent_keys.append(keys)

        def encode(key: str) -> dict[str, torch.Tensor]:
            self.to_encode(vae)
            idx, flip = source[key]
            item = self.all_items[idx]
            pixels, time_ids = load_pixels(item, "center", flip, rng)
            dist = vae.encode(pixels[None].to(self.device, torch.float32)).latent_dist
            mean, std = dist.mean[0].cpu(), dist.std[0].cpu()
            if not (torch.isfinite(mean).all() and torch.isfinite(std).all()):
                raise ValueError(f"the VAE gave non-finite latents for {item.path}; the image may be corrupt "
                                 "or the VAE broken (try another VAE)")
            return {"mean": mean, "std": std, "time_ids": torch.tensor(time_ids, dtype=torch.float32)}

        with vae_tiles(vae, tiled):
            computed = self.cache.fill(list(source), encode, desc="caching latents", **self._cache_share())
        if not computed:
            log.info("latent cache: every entry this process owns was reused (%d in all)", len(source))
        return computed

    def _cache_share(self) -> dict:
        """This process's part in building the caches: processes of one machine split the work (the cache
        folder may be local to each machine, so machines do not count on each other)."""
        acc = self.accelerator
        local_n = int(os.environ.get("LOCAL_WORLD_SIZE", acc.num_processes))
        return {"process_index": acc.local_process_index, "num_processes": local_n,
                "show": acc.is_local_main_process}

    @torch.no_grad()
    def _cache_text(self) -> None:
        pipe = self.pipe
        cfg = self.cfg
        encoders = (pipe.text_encoder, pipe.text_encoder_2)
        if cfg.adapter.train_text_encoder or live_text(cfg.data):
            self.to_encode(*encoders)  # they encode during training; otherwise only what the cache lacks
        te_id = component_identity(self.model_path, "text_encoder") + component_identity(self.model_path, "text_encoder_2")
        self.text_encoders_id = te_id
        # Captions are fixed here (trigger word, class token, prefix and suffix); dropout happens per sample at
        # train time.
        rng = random.Random(0)
        captions = [make_caption(item, self.cfg.data, rng, fixed=True) for item in self.all_items]
        self.captions = captions
        if self.cfg.adapter.train_text_encoder:
            return  # the encoders train: embeddings change every step, so none are cached
        self.text_keys = [cache_key("text", c, te_id) for c in captions]
        unique = {k: c for k, c in zip(self.text_keys, captions)}
        empty_key = cache_key("text", "", te_id)
        unique[empty_key] = ""

        def encode(key: str) -> dict[str, torch.Tensor]:
            self.to_encode(*encoders)
            return self.encode_text(unique[key])

        self.cache.fill(list(unique), encode, desc="caching text", **self._cache_share())
        self.empty_text = self.cache.get(empty_key)

    def encode_text(self, caption: str) -> dict[str, torch.Tensor]:
        # diffusers' own SDXL prompt encoding: penultimate hidden states of both encoders, concatenated,
        # and the second encoder's pooled projection.
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=caption, device=self.device, num_images_per_prompt=1, do_classifier_free_guidance=False)
        return {"prompt_embeds": embeds[0].float().cpu(), "pooled": pooled[0].float().cpu()}

    # ---- what the loop asks for ----
    def model(self) -> torch.nn.Module:
        # With text encoder LoRA: one module holding the UNet and both encoders, so the loop trains,
        # checkpoints and (under DDP) synchronises all of their adapters.
        return self._adapter_model if self._adapter_model is not None else self.pipe.unet

    def param_groups(self) -> list[dict]:
        """The UNet's adapter at train.unet_lr (times train.lr_multipliers per slot), the text encoders'
        at train.text_encoder_lr; either none means train.lr."""
        tc = self.cfg.train
        unet_lr = tc.unet_lr or tc.lr
        groups: dict[float, list] = {}
        if tc.lr_multipliers:
            modules = dict(self.pipe.unet.named_modules())
            for s in self.plan.targets:
                mult = inject.slot_override(s, tc.lr_multipliers)
                mult = 1.0 if mult is None else float(mult)
                groups.setdefault(mult, []).extend(p for p in modules[s.name].parameters() if p.requires_grad)
            log.info("train.lr_multipliers: UNet adapter lr %s", {f"x{m:g}": f"{unet_lr * m:.3g} ({len(ps)} tensors)"
                                                                  for m, ps in sorted(groups.items())})
        else:
            groups[1.0] = inject.trainable_parameters(self.pipe.unet)
        out = [{"params": ps, "lr": unet_lr * m, "name": "unet" if m == 1.0 else f"unet x{m:g}"}
               for m, ps in sorted(groups.items(), key=lambda kv: kv[0] != 1.0) if ps]
        if self._adapter_model is not None:
            te = [p for m in (self.pipe.text_encoder, self.pipe.text_encoder_2) for p in m.parameters() if p.requires_grad]
            out.append({"params": te, "lr": tc.text_encoder_lr or tc.lr, "name": "text_encoder"})
        return out

    def dataloader(self, shard: bool = True) -> torch.utils.data.DataLoader:
        """This process's share of each global batch (BucketBatchSampler): the loop uses it as it is,
        without Accelerate re-sharding it. shard=False: every batch whole (calibration)."""
        ds = CachedSDXLDataset(self)
        return torch.utils.data.DataLoader(ds, batch_sampler=self._sampler(shard), collate_fn=collate, num_workers=0)

    def _sampler(self, shard: bool = True) -> BucketBatchSampler:
        """The batches of this process (shard) or of all (shard=False), as the loop and the graphs see them."""
        acc = self.accelerator
        n, rank = (acc.num_processes, acc.process_index) if shard else (1, 0)
        return BucketBatchSampler(self.dataset, self.cfg.train.batch_size, self.cfg.train.seed,
                                            num_replicas=n, rank=rank)

    def batch_size(self, batch) -> int:
        return int(batch["latent_mean"].shape[0])

    def flops_per_sample(self, batch) -> float | None:
        """FLOPs per image of a training step, counted on a copy of the UNet on the meta device (no memory, no
        kernels): built from the UNet's config with this run's adapter plan, called on one image of `batch`'s
        bucket; 2x its forward (core/loop.py: _flops_setup says why). With the text encoders' LoRA, whose
        forward is in the step too, the loop counts a forward on the device instead."""
        from ..core import tracking

        if "prompt_embeds" not in batch:
            return None
        unet = self.pipe.unet
        try:
            with torch.device("meta"):
                twin = type(unet).from_config(unet.config)
            inject.apply_plan(twin, self.plan)
            one = {k: torch.zeros(1, *batch[k].shape[1:], device="meta")
                   for k in ("latent_mean", "prompt_embeds", "pooled", "time_ids")}
            t = torch.zeros(1, dtype=torch.long, device="meta")
            with torch.no_grad():
                forward = tracking.count_flops(lambda: twin(
                    one["latent_mean"], t, encoder_hidden_states=one["prompt_embeds"],
                    added_cond_kwargs={"text_embeds": one["pooled"], "time_ids": one["time_ids"]}))
        except Exception as e:  # MFU is a figure in the log: a model the meta copy cannot run is counted on the device
            log.info("MFU: the UNet's meta-device copy did not run (%s: %s); counting a forward on the device",
                     type(e).__name__, e)
            return None
        return 2.0 * forward

    def _keyed_draws(self, mean: torch.Tensor, keys: torch.Tensor):
        """Each sample's latent draw, noise (and offset) and timestep from its own generator, seeded by its
        sample_key: (seed, epoch, sample) decide them, not a per-process RNG stream, so N processes with
        batch b draw exactly what one process with batch N x b draws (and a resumed run what the
        uninterrupted one did). The same order as the unkeyed path. The keys stay on the host (host_keys), so
        reading them waits for nothing."""
        tc, dev = self.cfg.train, mean.device
        eps, noise, t, perturb = [], [], [], []
        for key in keys.tolist():
            g = torch.Generator(dev.type if dev.type == "cpu" else dev).manual_seed(key)
            eps.append(torch.randn(mean.shape[1:], generator=g, device=dev, dtype=mean.dtype))
            n = torch.randn(mean.shape[1:], generator=g, device=dev, dtype=mean.dtype)
            if tc.noise_offset:
                n = n + tc.noise_offset * torch.randn(mean.shape[1], 1, 1, generator=g, device=dev, dtype=mean.dtype)
            if tc.multires_noise_iterations:
                n = diffusion.multires_noise(n, tc.multires_noise_iterations, tc.multires_noise_discount, g)
            noise.append(n)
            t.append(torch.randint(tc.timestep_min, self.timestep_max + 1, (1,), generator=g, device=dev))
            if tc.ip_noise_gamma:
                perturb.append(torch.randn(mean.shape[1:], generator=g, device=dev, dtype=mean.dtype))
        return torch.stack(eps), torch.stack(noise), torch.cat(t), (torch.stack(perturb) if perturb else None)

    def loss(self, model, batch) -> torch.Tensor:
        """The diffusion loss with the train.* options (sdxl/loss.py); draws in sdxl/loss.py's fixed order."""
        tc, sched = self.cfg.train, self.noise_scheduler
        self.unet_call.say_compiling()
        noisy, t, target = self._noised(batch)
        prediction_type = sched.config.prediction_type
        if tc.prior_prediction and "is_reg" in batch and bool(batch["is_reg"].any()):
            target = self._prior_target(model, noisy, t, batch, target)
        with speed.sdpa_context(tc.sdpa_backend):
            if "input_ids" in batch:  # text encoder LoRA: the model encodes the captions itself
                if model is self.pipe.unet:
                    model = self._adapter_model
                pred = model(noisy, t, input_ids=batch["input_ids"], input_ids_2=batch["input_ids_2"],
                             time_ids=batch["time_ids"]).sample
            else:
                pred = self.unet_call(model, noisy, t, batch["prompt_embeds"], batch["pooled"], batch["time_ids"])
        return diffusion.diffusion_loss(pred, target, t, sched.alphas_cumprod, kind=tc.loss,
                                        huber_delta=tc.huber_delta, min_snr_gamma=tc.min_snr_gamma,
                                        prediction_type=prediction_type, mask=batch.get("mask"),
                                        weight=batch.get("loss_weight"), debiased=tc.debiased_estimation)

    def _noised(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch's noisy latents, timesteps and the prediction's target (sdxl/loss.py), drawn in its fixed
        order."""
        tc, sched = self.cfg.train, self.noise_scheduler
        scale = self.pipe.vae.config.scaling_factor
        mean, std = batch["latent_mean"], batch["latent_std"]
        if "sample_key" in batch:
            eps, noise, t, perturb = self._keyed_draws(mean, batch["sample_key"])
            latents = (mean + std * eps) * scale
        else:  # a batch made elsewhere (tests, benchmarks): the global RNG, in the same order
            latents = (mean + std * torch.randn_like(mean)) * scale
            noise = diffusion.draw_noise(latents, tc.noise_offset)
            if tc.multires_noise_iterations:
                noise = torch.stack([diffusion.multires_noise(n, tc.multires_noise_iterations,
                                                              tc.multires_noise_discount) for n in noise])
            t = diffusion.draw_timesteps(latents.shape[0], tc.timestep_min, self.timestep_max, latents.device)
            perturb = torch.randn_like(latents) if tc.ip_noise_gamma else None
        # Input perturbation: the model sees latents noised a little more than the noise it is asked for.
        noisy = sched.add_noise(latents, noise if perturb is None else noise + tc.ip_noise_gamma * perturb, t)
        target = sched.get_velocity(latents, noise, t) if sched.config.prediction_type == "v_prediction" else noise
        return noisy, t, target

    def _prior_target(self, model, noisy, t, batch, target) -> torch.Tensor:
        """train.prior_prediction (OneTrainer's prior prediction): the regularization rows' target is what the
        base predicts for the same noisy latents and captions, the adapter off, so they keep the base's
        behaviour for their captions whatever their pixels."""
        if "input_ids" in batch:
            raise ConfigError("train.prior_prediction needs the text encoders frozen (their LoRA would change the "
                              "base's prediction too); set adapter.train_text_encoder=false or drop prior_prediction")
        with torch.no_grad(), adapters_off(model):
            base = self.unet_call(model, noisy, t, batch["prompt_embeds"], batch["pooled"], batch["time_ids"])
        reg = batch["is_reg"].to(target.device).view(-1, *([1] * (target.dim() - 1)))
        return torch.where(reg, base.to(target.dtype), target)

    def _text(self, model, idx: int) -> dict[str, torch.Tensor]:
        """Item idx's text embeddings: from the cache, or (text encoder LoRA) encoded now by the model's encoders."""
        if not self.cfg.adapter.train_text_encoder:
            return self.cache.get(self.text_keys[idx])
        wrapper = model if isinstance(model, SDXLAdapterModel) else self._adapter_model
        ids = {k: v[None].to(self.device) for k, v in self.tokenize(self.captions[idx]).items()}
        with self.accelerator.autocast():
            embeds, pooled = wrapper.encode(ids["input_ids"], ids["input_ids_2"])
        return {"prompt_embeds": embeds[0].float(), "pooled": pooled[0].float()}

    def _eval_per_call(self) -> int:
        """Images of one shape share a UNet call in evaluate(), up to the training batch (a call is then 4x the
        training batch, without gradients: less than a training step holds). Where the run plans its memory
        tightly (checkpointing, a budget) each image keeps its own call."""
        tc = self.cfg.train
        return 1 if (tc.gradient_checkpointing or tc.checkpoint_budget_gb or tc.vram_gb) else tc.batch_size

    @torch.no_grad()
    def evaluate(self, model, indices: list[int] | None = None) -> float:
        """Loss on the given images (default: up to 8 training images) at fixed timesteps and fixed
        noise (latent means, no sampling): the same number for the same weights, so before/after and
        two runs compare like for like."""
        sched = self.noise_scheduler
        scale = self.pipe.vae.config.scaling_factor
        n_t = sched.config.num_train_timesteps
        timesteps = torch.tensor([n_t // 8, 3 * n_t // 8, 5 * n_t // 8, 7 * n_t // 8], device=self.device)
        k = len(timesteps)
        gen = torch.Generator("cpu").manual_seed(0)
        per_call = self._eval_per_call()
        losses: list[float] = []

        def run(group: list[tuple[dict, dict, torch.Tensor]]) -> None:
            def each(pick) -> torch.Tensor:  # one value per image (no batch dim), once per timestep
                values = [pick(lat, text) for lat, text, _ in group]
                return torch.cat([v.expand(k, *v.shape) for v in values]).to(self.device)

            latents = each(lambda lat, _: lat["mean"]) * scale
            noise = torch.cat([n for _, _, n in group]).to(self.device)
            t = timesteps.repeat(len(group))
            target = (sched.get_velocity(latents, noise, t) if sched.config.prediction_type == "v_prediction"
                      else noise)
            # A few calls at shapes of evaluation's own (several timesteps an image): cuDNN's search for them
            # would cost more than its choice saves (speed.cudnn_search).
            with self.accelerator.autocast(), speed.cudnn_search(False):
                unet = model.unet if isinstance(model, SDXLAdapterModel) else model
                pred = unet(sched.add_noise(latents, noise, t), t,
                            encoder_hidden_states=each(lambda _, text: text["prompt_embeds"]),
                            added_cond_kwargs={"text_embeds": each(lambda _, text: text["pooled"]),
                                               "time_ids": each(lambda lat, _: lat["time_ids"])}).sample
            err = (pred.float() - target.float()).pow(2).flatten(1).mean(1)  # per sample
            losses.extend(err.view(len(group), k).mean(1).tolist())

        was_training = model.training
        model.eval()
        try:
            pending: dict[tuple, list] = {}
            for idx in (indices if indices is not None else range(min(8, len(self.dataset.items)))):
                lat = self.cache.get(self.latent_keys[idx][False])
                # Drawn image by image, in order: the noise does not depend on how images share calls.
                noise = torch.randn((k, *lat["mean"].shape), generator=gen)
                group = pending.setdefault(tuple(lat["mean"].shape), [])
                group.append((lat, self._text(model, idx), noise))
                if len(group) >= per_call:
                    run(pending.pop(tuple(lat["mean"].shape)))
            for group in pending.values():
                run(group)
        finally:
            model.train(was_training)
        return sum(losses) / len(losses)

    def save_adapter(self, model, run: Run, step: int) -> dict[str, Path]:
        # The kohya file is the main one (ComfyUI, AUTOMATIC1111/Forge, kohya and diffusers load it); the
        # diffusers/PEFT file sits beside it, with the same description (no absolute paths in either).
        from .formats.export import adapter_from_model, save_kohya_lora, training_metadata

        cfg = self.cfg
        datasets: dict[str, list[tuple[str, int]]] = {}
        for item in self.dataset.items:
            datasets.setdefault(item.dataset.name, []).append((item.caption, item.repeats))
        # Each training dataset's own trigger word ([[data.datasets]]); regularization ones have none.
        triggers = sorted({s.settings.trigger_word.strip() for s in self.dataset.specs if not s.is_reg} - {""})
        meta = training_metadata(
            title=run.name, steps=step, resolution=self.resolution,
            trigger_phrase=", ".join(triggers) or cfg.data.trigger_word,
            base_model=cfg.model.path, datasets=datasets,
            regularization={it.dataset.name for it in self.dataset.items if it.is_reg},
            extra={"ss_learning_rate": str(cfg.train.lr), "ss_batch_size_per_device": str(cfg.train.batch_size),
                   "ss_lr_scheduler": cfg.train.scheduler, "ss_seed": str(cfg.train.seed),
                   "ss_network_dropout": str(cfg.adapter.dropout),
                   "ss_mixed_precision": str(self.accelerator.mixed_precision),
                   "ss_prior_loss_weight": str(cfg.train.prior_loss_weight),
                   "sdxl_lora.steps": str(step), "sdxl_lora.resolution": str(self.resolution),
                   "sdxl_lora.preset": cfg.adapter.preset, "sdxl_lora.kind": cfg.adapter.kind,
                   # The base the adapter saw: merge warns when it was quantized (docs/qlora.md).
                   "sdxl_lora.quantize": cfg.model.quantize,
                   **({"sdxl_lora.quant_double": str(cfg.model.quant_double).lower()}
                      if cfg.model.quantize in ("nf4", "fp4") else {}),
                   **({"sdxl_lora.quantize_convs": cfg.model.quantize_convs}
                      if cfg.model.quantize_convs != "none" else {}),
                   "ss_unet_lr": str(cfg.train.unet_lr or cfg.train.lr),
                   "ss_text_encoder_lr": str(cfg.train.text_encoder_lr or cfg.train.lr),
                   "ss_network_train_unet_only": str(not cfg.adapter.train_text_encoder),
                   # With train.ema the files hold the moving average of the weights, not the last step's.
                   **({"sdxl_lora.ema_decay": str(cfg.train.ema_decay)} if cfg.train.ema else {})})
        unet = model.unet if isinstance(model, SDXLAdapterModel) else model
        adapter = adapter_from_model(unet)
        if isinstance(model, SDXLAdapterModel):
            for comp in ("text_encoder", "text_encoder_2"):
                adapter.layers.update(adapter_from_model(getattr(model, comp), component=comp).layers)
        main = run.dir / f"{run.name}.safetensors"
        if any(layer.bias is not None for layer in adapter.layers.values()):
            log.warning("adapter.lora_bias: the kohya format has no LoRA bias, so %s is in diffusers format "
                        "(diffusers and peft load it; ComfyUI and AUTOMATIC1111 may not)", main.name)
            return {"diffusers": save_diffusers_lora(adapter, main, extra_metadata=meta, overwrite=True)}
        # overwrite: these are the run's own files; a finished run resumed to train further replaces them.
        kohya = save_kohya_lora(adapter, main, unet_config=unet.config, metadata=meta, overwrite=True)
        if cfg.adapter.kind in ("loha", "lokr"):  # diffusers loads no LyCORIS kind: the kohya file is the one
            return {"kohya": kohya}
        diffusers = save_diffusers_lora(adapter, run.dir / f"{run.name}.diffusers.safetensors", extra_metadata=meta,
                                        overwrite=True)
        return {"kohya": kohya, "diffusers": diffusers}

    def preview(self, model, run: Run, step: int) -> list[Path]:
        return render_previews(self, model, run, step)

    def evaluate_before(self, model) -> float:
        """The step-0 eval loss, from the cache where an earlier run measured the same base on the same images
        (sdxl/baseline.py)."""
        return baseline.evaluate_before(self, model)

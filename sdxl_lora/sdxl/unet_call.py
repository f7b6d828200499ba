"""How a training step calls the UNet: the UNet itself (its blocks compiled with train.compile) or replayed from
CUDA graphs (train.cuda_graphs), with the train.* levers that change the call (fused q/k/v, merged LoRA products,
the GEGLU kernel, channels_last, gradient checkpointing or a checkpoint budget) applied once at set-up. One object,
`UNetCall`, owns it, and one state (`CallState`) says how the next training call runs.

When the graphs' capture does not fit in memory the call checkpoints more of the UNet, then trains each batch in
micro-batches (the same gradient), before the run goes on without graphs (core/speed.py: GraphedCall).
"""
from __future__ import annotations

import enum
import logging
from typing import Callable

import torch

from ..core import speed
from ..core.config import ConfigError
from ..core.runs import Run
from ..core.task import micro_sizes
from . import speed as unet_speed

log = logging.getLogger(__name__)

# The measuring pass of selective checkpointing keeps every activation of one sample, which at SDXL's full
# size is more than a small card holds beside the weights; above this many latent pixels it measures a
# centre crop instead.
MEASURE_LATENT_PIXELS = 64 * 64


def measuring_sample(batch: dict, n: int, limit: int = MEASURE_LATENT_PIXELS) -> tuple[dict, float]:
    """One sample of `batch` (n samples), its latents centre-cropped to at most `limit` pixels (sides kept
    multiples of 8), and the factor that scales what it measures to the whole batch. Saved activations scale
    with the batch and the pixels; so do the FLOPs but attention's, which grow faster (they only order the
    units, see speed.checkpoint_order)."""
    one = {k: v[:1] for k, v in batch.items()}
    h, w = one["latent_mean"].shape[-2:]
    side = 1.0
    while h * w / side ** 2 > limit:
        side *= 2
    ch, cw = max(8, int(h / side) // 8 * 8), max(8, int(w / side) // 8 * 8)
    if (ch, cw) != (h, w):
        top, left = (h - ch) // 2, (w - cw) // 2
        for k in ("latent_mean", "latent_std", "mask"):
            if k in one and one[k].dim() >= 3:
                v = one[k]
                fy, fx = v.shape[-2] // h, v.shape[-1] // w  # a mask at pixel resolution: the same share
                one[k] = v[..., top * fy:(top + ch) * fy, left * fx:(left + cw) * fx]
    return one, n * (h * w) / (ch * cw)


class CallState(enum.Enum):
    """How the next training call of the UNet runs. Calls without gradients (evaluation, previews, the prior's
    prediction) always run the UNet itself."""
    EAGER = "eager"  # the UNet itself: no graphs asked, none possible here, or the training steps are over
    CAPTURE = "capture"  # CUDA graphs, captured at the next training call (the first, or after the adapter changed)
    GRAPHED = "graphed"  # replayed from the captured graphs (`UNetCall.graphed`)


class UNetCall:
    """The UNet's training call for an SDXL task (sdxl/task.py: SDXLTask holds one). It reads the task's config,
    device, data (the batch shapes the graphs capture), loss (the checkpoint budget's trial passes) and run (its
    events), and sets the task's micro_batches when a batch must train in parts."""

    def __init__(self, task):
        self.task = task
        self.state = CallState.EAGER
        self.graphed: speed.GraphedCall | None = None  # the graphs, while the state is GRAPHED
        self.checkpointing: dict | None = None  # train.checkpoint_budget_gb's measured units and choice
        self._compile_said = False  # the first compiled training call says that it compiles

    def setup(self, unet, run: Run) -> None:
        """The train.* speed levers (core/speed.py, sdxl/speed.py, docs/speed.md) on the UNet, after the adapter is
        in place; with train.cuda_graphs on a GPU the first training call captures the graphs."""
        from ..core.accel import gradient_sync

        task = self.task
        tc, device = task.cfg.train, task.device
        if task._speed_choices:
            log.info("train.speed='auto' on %s: %s", device,
                     "; ".join(f"{k} {v}" for k, v in task._speed_choices.items()))
            run.event("speed", auto=True, **{k: getattr(tc, k) for k in task._speed_choices},
                      reasons=task._speed_choices)
        speed.configure_backends(device)
        if tc.sdpa_backend in ("cudnn", "efficient") and device.type != "cuda":
            raise ConfigError(f"train.sdpa_backend={tc.sdpa_backend!r} needs a CUDA GPU (the device is "
                              f"{device}); use 'default'")
        if tc.compile_activation_budget is not None and tc.compile == "none":
            log.warning("train.compile_activation_budget=%g has no effect without train.compile",
                        tc.compile_activation_budget)
        # Several buckets: the compiled blocks' token and spatial dims are symbols, one compilation for all.
        varying = len(task.dataset.bucket_histogram()) > 1
        graphs = tc.cuda_graphs and device.type == "cuda"
        if graphs and task.cfg.adapter.dropout and (tc.gradient_checkpointing or tc.checkpoint_budget_gb):
            raise ConfigError("train.cuda_graphs with gradient checkpointing needs adapter.dropout=0 (a checkpointed "
                              "block that draws random numbers must save the RNG state, which a graph cannot)")
        if tc.fuse_qkv:
            n = unet_speed.fuse_projections(unet, lora_matmul=tc.lora_matmul)
            log.info("train.fuse_qkv: %d attention layers project q/k/v (or k/v) with one matmul", n)
        if tc.lora_matmul == "merged" and device.type == "cuda":  # measured on CUDA; the CPU keeps peft's
            n, m = unet_speed.merge_lora_linears(unet), unet_speed.merge_lora_convs(unet)
            if n or m:
                log.info("train.lora_matmul='merged': %d LoRA'd Linears outside the attentions and %d ResNet "
                         "convolutions with their LoRA folded into the weight", n, m)
        if tc.fused_geglu and device.type == "cuda":  # the kernel is Triton's; the CPU keeps torch's ops
            from . import kernels as unet_kernels

            if unet_kernels.triton is None:  # e.g. Windows builds of torch: autograd's own backward
                log.info("train.fused_geglu: Triton is not installed; the GEGLU backward stays torch's")
            else:
                unet_kernels.use_fused_geglu(unet)
        if tc.gradient_checkpointing:
            unet_speed.enable_checkpointing(unet, graph_safe=graphs, sdpa_backend=tc.sdpa_backend)
        elif tc.checkpoint_budget_gb:
            fit = self.fit_checkpointing(unet, tc.checkpoint_budget_gb, graph_safe=graphs)
            run.event("checkpointing", budget_gb=tc.checkpoint_budget_gb, **fit)
        if tc.channels_last:
            speed.to_channels_last(unet)
            unet_speed.transformer_io(unet, compile=tc.compile != "none", varying=varying)
        if tc.compile != "none":
            classes = unet_speed.REGION_CLASSES if tc.compile == "regional" else unet_speed.TRANSFORMER_CLASSES
            n = speed.compile_regions(unet, classes=classes, activation_budget=tc.compile_activation_budget,
                                      options=unet_speed.unet_inductor_options(),
                                      varying=unet_speed.BUCKET_VARYING if varying else None)
            log.info("train.compile=%r: %d blocks compiled%s (the first step includes the compilation)", tc.compile, n,
                     ", their shapes varying across the buckets" if varying else "")
            if tc.compile == "regional" and tc.channels_last:
                # The convolutions' input gradients as convolutions: the compiled ResNets' backward graphs keep
                # the channels_last layout (docs/speed.md).
                unet_speed.conv_input_grad(unet)
        if tc.cuda_graphs:
            if device.type != "cuda":
                log.warning("train.cuda_graphs needs a CUDA device; running without (device is %s)", device)
            elif gradient_sync(task.cfg, task.accelerator.num_processes, device.type) == "ddp":
                log.warning("train.cuda_graphs does not combine with train.gradient_sync='ddp' (DDP's gradient "
                            "hooks cannot be captured); running without graphs on %d processes",
                            task.accelerator.num_processes)
            else:
                self.state = CallState.CAPTURE  # on the first training call, on the prepared model


    def __call__(self, model, noisy, t, embeds, pooled, time_ids) -> torch.Tensor:
        """The UNet's prediction for a training batch; replayed from CUDA graphs in states CAPTURE and GRAPHED."""
        def call(noisy, t, embeds, pooled, time_ids):
            return model(noisy, t, encoder_hidden_states=embeds,
                         added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample

        if self.state is CallState.EAGER or not torch.is_grad_enabled():
            return call(noisy, t, embeds, pooled, time_ids)
        if self.state is CallState.CAPTURE or self.graphed.module is not model:
            # Each shape is warmed up once before the captures where nothing in the model is compiled: its first
            # pass does the lazy initialisation and cuDNN's algorithm search, and every further pass of an
            # uncompiled model only delays the first step (each a full eager step, seconds at batch 16). A compiled
            # model keeps make_graphed_callables' three: a guard that recompiles on a later call must do so before
            # the capture.
            compiled = self.task.cfg.train.compile != "none"
            self.graphed = speed.GraphedCall(model, call, warmup=3 if compiled else 1, others=self.graph_inputs,
                                             on_out_of_memory=lambda: self.checkpoint_more(model)
                                             or self.split_batches())
            self.state = CallState.GRAPHED
        return self.graphed(noisy, t, embeds, pooled, time_ids)

    def say_compiling(self) -> None:
        """Before a training call with train.compile: the first one waits for the compiler, which says nothing
        itself, so the log says it first (once)."""
        if not self._compile_said and self.task.cfg.train.compile != "none" and torch.is_grad_enabled():
            self._compile_said = True
            log.info("compiling the UNet's blocks for this shape (once per settings; later runs reuse inductor's "
                     "cache)")

    def adapter_changed(self) -> None:
        """The adapter's parameters were replaced (adapter.rank_schedule): captured graphs hold the old ones, so
        the next training call captures again."""
        if self.state is CallState.GRAPHED:
            self.state, self.graphed = CallState.CAPTURE, None

    def release(self) -> None:
        """The training steps are over: their CUDA graphs go before the final evaluation and previews. The graphs'
        pool holds a batch's activations, which the previews' render would otherwise need beside it (the run's
        estimate counts the final previews without it)."""
        if self.graphed is not None:
            self.graphed.release()
            log.info("the training steps' CUDA graphs released for the final evaluation and previews")
        self.state, self.graphed = CallState.EAGER, None

    def checkpoint_more(self, model) -> bool:
        """CUDA graphs' capture ran out of memory: checkpoint half the units selective checkpointing left
        out (train.checkpoint_budget_gb) and say so; False when there is nothing left to checkpoint. The
        budget's trial passes run in ordinary memory and cannot see the graphs' own pool; graphs with more
        recomputation are still much faster than the same step without graphs, whose launches the host
        cannot keep up with."""
        fit = self.checkpointing
        more = speed.checkpoint_more(fit["units"], fit["chosen"]) if fit is not None else []
        if not more:
            return False
        fit["chosen"] += more
        task = self.task
        unet = task.accelerator.unwrap_model(model)
        unet_speed.apply_selective_checkpointing(unet, fit["chosen"], fit["graph_safe"], task.cfg.train.sdpa_backend)
        total = len(speed.checkpoint_order(fit["units"]))
        log.warning("CUDA graphs did not fit in memory beside train.checkpoint_budget_gb=%g's step: checkpointing "
                    "%d of %d units and capturing again", fit["budget_gb"], len(fit["chosen"]), total)
        if task._run is not None:
            task._run.event("checkpointing", budget_gb=fit["budget_gb"], blocks=list(fit["chosen"]),
                            reason="cuda_graphs_out_of_memory")
        return True

    def split_batches(self) -> bool | str:
        """CUDA graphs' capture ran out of memory with every unit checkpointed that can be: from the next
        step on each batch trains in twice as many micro-batches, one forward and backward each (the same
        gradient: the loss is a mean over the batch), and the graphs are captured at the smaller shape. False
        when the micro-batches are single images already. Without graphs the checkpointed step is host-bound
        (several times slower per image at these budgets); smaller batches cost the GPU's efficiency instead."""
        task = self.task
        largest = max(b for _, b in task._sampler().batch_shapes())
        if task.micro_batches >= largest:
            return False
        task.micro_batches *= 2  # the loop splits each batch into this many (core/task.py: Task.split)
        sizes = micro_sizes(largest, task.micro_batches)
        log.warning("CUDA graphs did not fit in memory with the checkpointing the step allows: each batch of %d "
                    "now trains as %d micro-batches of up to %d images (the same gradient), captured at that "
                    "size from the next step", largest, len(sizes), sizes[0])
        if task._run is not None:
            task._run.event("micro_batches", parts=task.micro_batches, images=sizes[0],
                            reason="cuda_graphs_out_of_memory")
        return "later"

    def graph_inputs(self, args: tuple, fill: Callable = torch.randn) -> list[tuple]:
        """The UNet's inputs for every (bucket, batch size) this process's batches come in, made like the
        first batch's `args` (its dtypes, devices and memory formats): CUDA graphs capture them all at the
        first step. fill: how the latents are made (torch.zeros draws nothing from the RNG)."""
        noisy, *rest = args
        sampler = self.task._sampler()
        f = int(self.task.pipe.vae_scale_factor)
        layout = (torch.channels_last if noisy.dim() == 4 and not noisy.is_contiguous()
                  and noisy.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format)
        out = []
        shapes = {((w, h), size) for (w, h), b in sampler.batch_shapes()
                  for size in micro_sizes(b, self.task.micro_batches)}  # the micro-batches' sizes (split_batches)
        for (w, h), b in sorted(shapes):
            x = fill(b, noisy.shape[1], h // f, w // f, dtype=noisy.dtype, device=noisy.device)
            out.append((x.contiguous(memory_format=layout),
                        *(a[:1].expand(b, *a.shape[1:]).clone() for a in rest)))
        return out

    def fit_checkpointing(self, unet, budget_gb: float, graph_safe: bool = False) -> dict:
        """Selective checkpointing (speed.py): measure what each checkpointable unit saves for backward and
        costs to recompute on one sample of a real batch, checkpoint the units that free the most memory per
        FLOP until the estimate fits the budget, then (on CUDA) run real forward + backward passes and
        checkpoint more until the measured peak, plus the optimizer state still to come, fits too: the
        estimate cannot see the backward pass's transients (activation gradients, attention and cuDNN
        workspaces). Returns what was chosen and measured."""
        from ..core.memory import OPTIMIZER_BYTES

        task, device = self.task, self.task.device
        budget = int(budget_gb * 2**30)
        units = unet_speed.checkpoint_units(unet)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            batch = next(iter(task.dataloader()))
            batch = {k: v if k in task.host_keys else v.to(device) for k, v in batch.items()}
            one, scale = measuring_sample(batch, task.batch_size(batch))
            with task.accelerator.autocast():
                speed.measure_units(unet, units, lambda: task.loss(unet, one))
            for u in units:
                u.saved, u.flops = round(u.saved * scale), round(u.flops * scale)
            trainable = sum(p.numel() for p in unet.parameters() if p.requires_grad)
            optimizer = int(trainable * OPTIMIZER_BYTES.get(task.cfg.train.optimizer, 8.0))
            # Frozen weights as they are stored, plus the fp32 adapter's gradient and the optimizer state.
            other = sum(p.numel() * p.element_size() for p in unet.parameters()) + trainable * 4 + optimizer
            chosen = speed.choose_checkpointed(units, budget, other)
            estimate = other + sum(u.saved for u in units if u.name not in chosen)
            trials = []
            if device.type == "cuda":
                order = speed.checkpoint_order(units)
                while True:
                    unet_speed.apply_selective_checkpointing(unet, chosen, graph_safe, task.cfg.train.sdpa_backend)
                    left = [u for u in order if u.name not in chosen]
                    try:
                        peak = self._trial_peak(unet, batch, warm=not trials) + optimizer
                    except torch.OutOfMemoryError:
                        # The allocator's cap (train.vram_gb) reached inside the trial: the same answer as a
                        # peak over the budget, with no figure to size the excess by. Half the rest next.
                        for p in unet.parameters():
                            p.grad = None
                        torch.cuda.empty_cache()
                        trials.append({"units": len(chosen), "peak_gib": None})
                        log.info("train.checkpoint_budget_gb=%g: %d of %d units checkpointed ran out of memory",
                                 budget_gb, len(chosen), len(order))
                        if not left:
                            raise
                        chosen += speed.checkpoint_more(units, chosen)
                        continue
                    trials.append({"units": len(chosen), "peak_gib": round(peak / 2**30, 2)})
                    log.info("train.checkpoint_budget_gb=%g: %d of %d units checkpointed, measured peak %.2f GiB "
                             "(optimizer state included)", budget_gb, len(chosen), len(order), peak / 2**30)
                    if peak <= budget or not left:
                        break
                    over = peak - budget
                    for u in left:  # at least one more, as many as the estimate says cover the excess
                        chosen.append(u.name)
                        over -= u.saved
                        if over <= 0:
                            break
        unet_speed.apply_selective_checkpointing(unet, chosen, graph_safe, task.cfg.train.sdpa_backend)
        self.checkpointing = {"units": units, "chosen": chosen, "graph_safe": graph_safe, "budget_gb": budget_gb}
        flops = sum(u.flops for u in units)
        recompute = sum(u.flops for u in units if u.name in chosen) / max(flops, 1)
        log.info("train.checkpoint_budget_gb=%g: checkpointing %s (%.0f%% of the forward FLOPs recomputed); "
                 "activations per unit (MiB) %s", budget_gb, chosen or "nothing", 100 * recompute,
                 {u.name: round(u.saved / 2**20, 1) for u in units})
        final = trials[-1]["peak_gib"] * 2**30 if trials else estimate
        if final > budget:
            log.warning("train.checkpoint_budget_gb=%g cannot be met even with every unit checkpointed (%s %.2f "
                        "GiB); lower the batch size or resolution, or quantize the base", budget_gb,
                        "measured" if trials else "estimated", final / 2**30)
        return {"blocks": chosen, "recomputed_flops": round(recompute, 3), "trials": trials,
                "estimate_gib": round(estimate / 2**30, 2)}

    def _trial_peak(self, unet, batch, warm: bool) -> int:
        """Peak allocated bytes of one forward + backward on `batch` (gradients dropped after). warm: run it
        once before measuring, so cuDNN's algorithm search (train.* sets cudnn.benchmark) is not counted."""
        task, device = self.task, self.task.device
        for _ in range(2 if warm else 1):
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            with task.accelerator.autocast():
                loss = task.loss(unet, batch)
            loss.backward()
            del loss
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
            for p in unet.parameters():
                p.grad = None
        return peak


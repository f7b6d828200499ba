"""The causal-LM task for the training loop: LoRA (or QLoRA) on a transformers causal LM, trained on
instruction/chat data with the loss on answers only.

What a user gets from `LLMTask` (the loop, checkpoints, resume and NaN guard are the shared Trainer's):
  - the model from a local transformers folder or the embedded tiny Llama, offline; with
    model.quantize the frozen base is quantized (QLoRA), the lm_head kept in full precision;
  - the same injector as SDXL: presets pick q/k/v/o (attn) or every projection (full, topology),
    overrides and a rank budget work per layer; no resolution scaling (LMs have none);
  - data rendered with the chat template, loss on assistant tokens only, packing of short examples
    with no attention across them, truncation reported;
  - a loss that never holds the full fp32 logits (loss.py), non-reentrant gradient checkpointing;
  - a PEFT adapter folder in <run>/adapter, optionally a merged model in <run>/merged;
  - greedy answers to fixed prompts before and after training, in <run>/samples and the log.
Set-up order: model -> tokenizer and data -> plan -> adapter -> speed levers.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import re
from pathlib import Path

import torch

from ..core import inject
from ..core.accel import local_device_index
from ..core.card import this_card
from ..core.config import Config, ConfigError
from ..core.memory import first_that_fits
from ..core.runs import Run
from ..core.task import Task
from . import data as llm_data
from .export import merge_adapter, save_peft_adapter
from .loss import response_loss, token_losses
from .model import DTYPES, load_llm, quantize_settings
from .preview import answer, write_answers
from .slots import make_plan

log = logging.getLogger(__name__)

# train.speed="auto" compiles the decoder layers of a run that trains at least this many tokens: compiling
# adds seconds to the first step and shortens every later one, which a short run (or a small model's short
# steps) does not win back (benchmarks/RESULTS.md#llm-levers).
COMPILE_MIN_TOKENS = 2_000_000
# train.speed="auto" also replays the compiled decoder layers from CUDA graphs where a step holds at most this many
# tokens (batch x max_length, one process): there the host's kernel launches set the pace, and the graphs took
# them out; a step of 4 x 2048 tokens keeps the GPU busy, so they gain nothing there
# (benchmarks/RESULTS.md#llm-levers). Not beside checkpointing
# (graphs cannot replay it), a memory budget (its plan does not count the graphs' memory), several processes or
# an adapter kind other than LoRA, none of which was measured with them.
GRAPHS_MAX_TOKENS = 2048
# What the graphs hold beside the step's estimate (their pool's slack, the recorded outputs), rounded up from the
# whole process's measured growth with them (benchmarks/RESULTS.md#llm-levers). Auto turns them off where this
# would not fit.
GRAPHS_RESERVE = int(0.5 * 2**30)


def auto_levers(cfg: Config, device_type: str, processes: int) -> tuple[Config, dict[str, str]]:
    """train.speed="auto" for a causal LM: the config with train.compile (and, for small steps, train.cuda_graphs)
    chosen for this device and run, and why, as {field: reason}. Settings of the user's are kept; off a CUDA
    GPU, or with speed="off", nothing changes."""
    tc = cfg.train
    if tc.speed != "auto" or device_type != "cuda":
        return cfg, {}
    if "compile" in tc.model_fields_set:
        choices = {"compile": f"{tc.compile!r}, as set"}
    elif tc.cuda_graphs:
        update = {"train": tc.model_copy(update={"compile": "regional"})}
        return cfg.model_copy(update=update), {
            "compile": "'regional': train.cuda_graphs replays the compiled decoder layers"}
    else:
        tokens = tc.steps * tc.batch_size * tc.grad_accum * processes * cfg.llm.max_length
        if tokens < COMPILE_MIN_TOKENS:
            return cfg, {"compile": f"'none': the run trains at most {tokens:,} tokens, fewer than compiling pays "
                                    f"for ({COMPILE_MIN_TOKENS:,})"}
        cfg = cfg.model_copy(update={"train": tc.model_copy(update={"compile": "regional"})})
        choices = {"compile": f"'regional': the run trains up to {tokens:,} tokens, enough to repay compiling its "
                              "decoder layers"}
    tc = cfg.train
    step = tc.batch_size * cfg.llm.max_length
    if (tc.compile != "none" and "cuda_graphs" not in tc.model_fields_set and not tc.gradient_checkpointing
            and not tc.vram_gb and processes == 1 and cfg.adapter.kind == "lora" and step <= GRAPHS_MAX_TOKENS):
        cfg = cfg.model_copy(update={"train": tc.model_copy(update={"cuda_graphs": True})})
        choices["cuda_graphs"] = (f"True: a step of {step:,} tokens (at most {GRAPHS_MAX_TOKENS:,}) is paced by "
                                  "the host's kernel launches, which replaying the compiled layers takes out")
    return cfg, choices


def _graphs_or_checkpointing(cfg: Config, checkpointing_asked: bool) -> Config:
    """train.cuda_graphs with checkpointed decoder layers: inductor's CUDA graphs cannot replay them (the
    recomputation in backward runs the graphed layer again and overwrites the outputs the backward still
    reads; with offloaded inputs the capture is refused: benchmarks/RESULTS.md#llm-levers). Refused where the user
    asked for both; where train.vram_gb chose checkpointing to fit, the budget wins and the graphs are left off,
    saying so."""
    tc = cfg.train
    if not (tc.cuda_graphs and tc.gradient_checkpointing):
        return cfg
    if checkpointing_asked:
        raise ConfigError("train.cuda_graphs with train.gradient_checkpointing: inductor's CUDA graphs cannot replay "
                          "checkpointed decoder layers; set one of them to false")
    log.warning("train.vram_gb=%g checkpoints the decoder layers to fit, which CUDA graphs cannot replay: "
                "train.cuda_graphs is off for this run", tc.vram_gb)
    return cfg.model_copy(update={"train": tc.model_copy(update={"cuda_graphs": False})})


class LLMTask(Task):
    unit_labels = {"tokens": "tok_s", "examples": "ex_s"}

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._budget = None  # train.vram_gb's or the card's fit (llm/memory.py: fit_budget, fit_card)
        self._card = None  # the card whose memory is the budget, where train.vram_gb is unset
        self._speed_choices: dict[str, str] = {}  # train.speed="auto": {field: why}

    def configure(self, cfg: Config, device_type: str, processes: int) -> Config:
        """train.vram_gb: checkpointing, a smaller batch with accumulation or an nf4 base, where the budget
        needs them, from the model's config alone (before any weight is read); then train.speed="auto"'s
        choice of compilation for this device and run length."""
        self._budget = self._card = None
        checkpointing = cfg.train.gradient_checkpointing  # as the user set it, before a budget's choice
        # With no train.vram_gb the card's own memory is the budget (core/card.py), where the settings as given
        # do not fit it; before any weight is read.
        card = this_card(local_device_index(), free=processes == 1) if device_type == "cuda" else None
        if cfg.train.vram_gb or card is not None:
            from .memory import fit_budget, fit_card
            from .model import check_causal_lm_folder, resolve_llm_path

            config = check_causal_lm_folder(resolve_llm_path(cfg.model), weights=False)
            if cfg.train.vram_gb:
                self._budget = fit_budget(cfg, config, cfg.train.vram_gb)
            else:
                self._card = card
                self._budget = fit_card(cfg, config, card)
                if self._budget is None:
                    log.info("card: fits %s as set", card.describe())
            if self._budget is not None:
                cfg = self._budget.cfg
        cfg = _graphs_or_checkpointing(cfg, checkpointing)
        cfg, self._speed_choices = auto_levers(cfg, device_type, processes)
        if "cuda_graphs" in self._speed_choices and cfg.train.cuda_graphs:
            cfg = self._graphs_fit(cfg)
        if cfg.train.cuda_graphs and cfg.train.compile == "none" and device_type == "cuda":
            raise ConfigError("train.cuda_graphs for a causal LM replays the compiled decoder layers (inductor's CUDA "
                              "graphs): it needs train.compile = 'regional' (train.speed='auto' turns it on where "
                              "train.compile is left unset)")
        self.cfg = cfg
        return cfg

    def setup(self, accelerator, run: Run) -> None:
        """model -> tokenizer and data -> plan -> adapter -> speed levers."""
        cfg = self.cfg
        self.accelerator = accelerator
        self.device = accelerator.device
        if self._budget is not None:
            self._apply_budget(run)
        self.dtype = DTYPES.get(accelerator.mixed_precision, torch.float32)
        self.lm, self.tokenizer, self.model_path = load_llm(cfg, self.device, accelerator.mixed_precision)
        self.quant = quantize_settings(cfg, accelerator.mixed_precision)
        self._read_data(run)

        self.plan = make_plan(self.lm, cfg.adapter)
        budget = inject.rank_budget(cfg.adapter)
        if budget:
            sensitivity = self._calibrate()
            self.plan = inject.budget_plan(self.plan, sensitivity, budget, cfg.adapter.min_rank, cfg.adapter.max_rank)
            run.event("budget", budget=budget, trainable_params=self.plan.trainable_params,
                      sensitivity={k: round(v, 6) for k, v in sensitivity.items()})
        inject.apply_plan(self.lm, self.plan, dropout=cfg.adapter.dropout)
        if self.dtype != torch.float32:  # every forward of the task runs under the accelerator's autocast
            inject.adapters_take_autocast_inputs(self.lm)
        self.initial = None  # PiSSA/OLoRA: the injected factors, which the export subtracts (llm/init.py)
        if cfg.adapter.init in ("pissa", "olora"):
            from peft import get_peft_model_state_dict

            from .init import initial_factors

            self.initial = initial_factors(get_peft_model_state_dict(self.lm))
        elif cfg.adapter.init == "loftq":
            from .init import loftq

            loftq(self.lm, self.plan, self.model_path)
        if budget:
            from peft.functional import set_adapter

            # The probe's layers are reused; its deletion left them with no active adapter.
            set_adapter(self.lm, "default", inference_mode=False)
        if cfg.llm.offload_embeddings:
            from .offload import embeddings_to_host

            try:
                moved = embeddings_to_host(self.lm, self.device, [t.name for t in self.plan.targets])
            except ValueError as e:
                raise ConfigError(str(e)) from None
            log.info("llm.offload_embeddings: the input embedding table (%.2f GiB) stays in host memory; each "
                     "step copies its tokens' rows to %s", moved / 2**30, self.device)
        if cfg.llm.offload_activations and not cfg.train.gradient_checkpointing:
            raise ConfigError("llm.offload_activations keeps the checkpointed decoder layers' inputs in host memory: "
                              "it needs train.gradient_checkpointing = true")
        if cfg.train.gradient_checkpointing:
            # Around each decoder layer's call, so that a compiled layer compiles inside it (offload.py).
            from .offload import checkpoint_layers

            n = checkpoint_layers(self.lm, type(self._first_layer()), offload=cfg.llm.offload_activations)
            if cfg.llm.offload_activations:
                log.info("llm.offload_activations: %d decoder layers checkpointed, their inputs in host memory", n)
            else:
                log.info("train.gradient_checkpointing: %d decoder layers checkpointed", n)
        if self._speed_choices:
            log.info("train.speed='auto' on %s: %s", self.device,
                     "; ".join(f"{k} {v}" for k, v in self._speed_choices.items()))
            run.event("speed", auto=True, **{k: getattr(cfg.train, k) for k in self._speed_choices},
                      reasons=self._speed_choices)
        graphs = cfg.train.cuda_graphs and self.device.type == "cuda"
        if cfg.train.cuda_graphs and not graphs:
            log.warning("train.cuda_graphs needs a CUDA device; running without (device is %s)", self.device)
        if cfg.train.compile != "none":
            from ..core import speed

            # The repeated decoder layers, compiled one graph for all (rows are padded to a fixed width: _width);
            # their class is the checkpointing subclass where train.gradient_checkpointing swapped it in. With
            # train.cuda_graphs inductor replays each compiled layer's forward and backward from CUDA graphs, one
            # recording per row width (evaluation and previews run the layers uncompiled).
            n = speed.compile_regions(self.lm, classes=(type(self._first_layer()).__name__,),
                                     activation_budget=cfg.train.compile_activation_budget,
                                     options={"triton.cudagraphs": True} if graphs else None)
            log.info("train.compile=%r: %d decoder layers compiled%s (the first steps include compilation)",
                     cfg.train.compile, n, ", replayed from CUDA graphs" if graphs else "")
        log.info("adapter plan: %s", inject.plan_summary(self.plan))
        # The layer table in the run's train.log, and in the terminal with -v (training.setup_logging: detail).
        log.info("adapter plan, by layer group:\n%s", inject.format_plan(self.plan), extra={"detail": True})
        run.event("plan", layers=len(self.plan.targets), trainable_params=self.plan.trainable_params,
                  preset=cfg.adapter.preset, base_rank=self.plan.base_rank, groups=self.plan.groups())
        self._estimate(run)

    def _first_layer(self) -> torch.nn.Module:
        """The first decoder layer (`...layers.0`): its class is the one every layer repeats."""
        return next(m for n, m in self.lm.named_modules() if re.search(r"(^|\.)layers\.0$", n))

    def _apply_budget(self, run: Run) -> None:
        """train.vram_gb: say what was chosen, and cap the process there on a GPU."""
        from ..core.memory import GiB, cap_process_memory

        fit, gib, card = self._budget, self.cfg.train.vram_gb, self._card
        chose = ", ".join(f"{k}={v}" for k, v in fit.choices.items()) or "the settings as given (they fit)"
        log.info("%s: %s; step about %.1f GiB for the whole process, ~%.2fx the time per token of the settings as "
                 "given", f"card: {card.describe()}" if card else f"train.vram_gb={gib:g}", chose,
                 fit.memory.peak / GiB, fit.slowdown)
        run.event("budget_plan", vram_gb=gib, choices=fit.choices, slowdown=fit.slowdown,
                  peak_gib=round(fit.memory.peak / GiB, 3), card_budget=card is not None,
                  **({"card": card.name, "card_gib": round(card.total / GiB, 2)} if card else {}))
        if self.device.type == "cuda" and not cap_process_memory(self.device, gib):
            log.warning("train.vram_gb=%g is at least this GPU's memory: nothing to cap", gib)

    def _graphs_fit(self, cfg: Config) -> Config:
        """train.speed="auto" chose CUDA graphs: kept where the step's whole process (llm plan's, from the model's
        config) and what the graphs hold besides (GRAPHS_RESERVE) fit in 95% of the GPU; otherwise off, saying why."""
        from ..core.memory import GiB
        from .memory import config_memory
        from .model import check_causal_lm_folder, resolve_llm_path

        config = check_causal_lm_folder(resolve_llm_path(cfg.model), weights=False)
        need = config_memory(cfg, config)[1].peak + GRAPHS_RESERVE
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        if need <= 0.95 * total:
            return cfg
        self._speed_choices["cuda_graphs"] = (f"False: the step and the graphs' memory (about {need / GiB:.1f} GiB) "
                                              f"would not fit in 95% of this GPU's {total / GiB:.1f} GiB")
        return cfg.model_copy(update={"train": cfg.train.model_copy(update={"cuda_graphs": False})})

    def _estimate(self, run: Run) -> None:
        """The step's expected peak (llm/memory.py), from the weights as loaded: what `llm plan` prints."""
        from ..core.memory import GiB
        from .memory import step_estimate, trains_head

        cfg = self.cfg
        frozen = sum(p.numel() * p.element_size() for n, p in self.lm.named_parameters() if not inject.is_adapter_param(n))
        parts, _ = step_estimate(self.lm.config, weights=frozen, trainable_params=self.plan.trainable_params,
                                 optimizer=cfg.train.optimizer, batch_size=cfg.train.batch_size,
                                 max_length=cfg.llm.max_length, checkpointing=cfg.train.gradient_checkpointing,
                                 compute_dtype=self.quant[1]["compute_dtype"] if self.quant[0] else self.dtype,
                                 loss_chunk=cfg.llm.loss_chunk, offload=cfg.llm.offload_activations,
                                 head_trained=trains_head(self.plan))
        total = sum(parts.values())
        log.info("memory estimate (batch %d x %d tokens): %s; peak %.2f GiB", cfg.train.batch_size,
                 cfg.llm.max_length, ", ".join(f"{k} {v / GiB:.2f}" for k, v in parts.items()), total / GiB)
        run.event("memory_estimate", total_gib=round(total / GiB, 3),
                  parts_gib={k: round(v / GiB, 3) for k, v in parts.items()})

    def _read_data(self, run: Run) -> None:
        """The chat template, the examples read and split: training, validation and evaluation rows."""
        cfg = self.cfg
        self.template = llm_data.chat_template(cfg.llm, self.tokenizer)
        examples, report = llm_data.read_examples(cfg.llm, self.tokenizer)
        self.examples = examples
        train, val = llm_data.split(examples, cfg.llm.validation_split)
        self.train_rows = llm_data.RowDataset(train, cfg.llm.max_length, cfg.llm.packing)
        report.rows = len(self.train_rows)
        self.val_rows = llm_data.RowDataset(val, cfg.llm.max_length, packing=False) if val else None
        # The fixed evaluation set: up to 8 training examples, one per row.
        self.eval_rows = llm_data.RowDataset(train[:8], cfg.llm.max_length, packing=False)
        log.info("dataset:\n%s", report.text())
        run.event("dataset", examples=report.examples, train_examples=len(train), held_out=[e.source for e in val],
                  rows=report.rows, tokens=report.tokens, label_tokens=report.label_tokens,
                  truncated=report.truncated, truncated_tokens=report.truncated_tokens, dropped=report.dropped,
                  packing=cfg.llm.packing, max_length=cfg.llm.max_length, files=report.files)

    def _calibrate(self) -> dict[str, float]:
        """Each planned slot's sensitivity for the rank budget (core/inject.py: calibrate)."""
        return inject.calibrate(self.lm, self.plan, lambda: iter(self.dataloader()), lambda b: self.loss(self.lm, b),
                                self.cfg.adapter.calibration_batches,
                                [self.device] if self.device.type == "cuda" else [])

    def identity(self) -> dict:
        """The base, the adapter plan and the examples: what a resume must find unchanged."""
        cfg = self.cfg
        rows = hashlib.sha256("".join(f"{e.source}:{len(e.input_ids)}\n" for e in self.examples).encode())
        return {"model": cfg.model.path, "quantize": cfg.model.quantize, "max_length": cfg.llm.max_length,
                "examples": f"{len(self.examples)} examples, {rows.hexdigest()[:12]}",
                "adapter": {s.name: self.plan.rank[s.name] for s in self.plan.targets}}

    # ---- what the loop asks for ----
    def model(self) -> torch.nn.Module:
        return self.lm

    def param_groups(self) -> list[dict]:
        return [{"params": inject.trainable_parameters(self.lm)}]

    def dataloader(self) -> torch.utils.data.DataLoader:
        sampler = llm_data.RowBatchSampler(len(self.train_rows), self.cfg.train.batch_size, self.cfg.train.seed)
        return torch.utils.data.DataLoader(
            self.train_rows, batch_sampler=sampler, num_workers=0,
            collate_fn=functools.partial(llm_data.collate, pad_id=self.tokenizer.pad_token_id, width=self._width()))

    def _width(self) -> int | tuple[int, ...] | None:
        """What training batches are padded to: uncompiled, their longest row; compiled, a fixed shape: packed
        rows are full, so llm.max_length; unpacked ones the narrowest of a few widths (data.row_widths)."""
        cfg = self.cfg
        if cfg.train.compile == "none":
            return None
        return cfg.llm.max_length if cfg.llm.packing else llm_data.row_widths(cfg.llm.max_length)

    def batch_size(self, batch) -> int:
        return int(batch["input_ids"].shape[0])

    def units(self, batch) -> dict[str, torch.Tensor]:
        """Tokens (every non-padding token: the model runs forward and backward over prompts and answers
        alike) and examples (packed rows hold several; each starts at position 0)."""
        real = batch["example"] >= 0
        return {"tokens": real.sum(), "examples": (real & (batch["position_ids"] == 0)).sum()}

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def loss(self, model, batch) -> torch.Tensor:
        with self.accelerator.autocast():
            return response_loss(model, self.lm, self._to_device(batch), self.cfg.llm.loss_chunk)

    @torch.no_grad()
    def _mean_loss(self, model, rows: llm_data.RowDataset) -> float:
        """Token-mean loss over the rows' answers, one row at a time, in eval mode (no dropout)."""
        was_training = model.training
        model.eval()
        total = count = 0.0
        try:
            for r in range(len(rows)):
                batch = self._to_device(llm_data.collate([rows[r]], self.tokenizer.pad_token_id))
                with self.accelerator.autocast():
                    losses = token_losses(model, self.lm, batch, self.cfg.llm.loss_chunk)
                total += float(losses.sum())
                count += float((batch["labels"][:, 1:] != llm_data.IGNORE).sum())
        finally:
            model.train(was_training)
        return total / max(count, 1.0)

    def evaluate(self, model) -> float:
        return self._mean_loss(model, self.eval_rows)

    def validate(self, model) -> float | None:
        return self._mean_loss(model, self.val_rows) if self.val_rows is not None else None

    def save_adapter(self, model, run: Run, step: int) -> dict[str, Path]:
        cfg = self.cfg
        method, opts = self.quant
        meta = {"sdxl_lora.task": "llm", "sdxl_lora.steps": str(step), "sdxl_lora.preset": cfg.adapter.preset,
                "sdxl_lora.init": cfg.adapter.init,
                "sdxl_lora.quantize": method or "none", "sdxl_lora.quant_double": str(opts.get("double_quant", ""))}
        out = {"peft": save_peft_adapter(model, run.dir / "adapter", str(self.model_path), metadata=meta,
                                         initial=self.initial)}
        if cfg.llm.merge:
            if method:
                log.warning("llm.merge: the adapter was trained on a quantized base; it is merged into the base "
                            "quantized and dequantized again (what it saw), saved in %s",
                            "fp32" if self.dtype == torch.float32 else str(self.dtype).removeprefix("torch."))
            out["merged"] = merge_adapter(self.model_path, out["peft"], run.dir / "merged", dtype=self.dtype,
                                          overwrite=True, quantize=self.quant,
                                          device=str(self.device))
        return out

    def preview(self, model, run: Run, step: int) -> list[Path]:
        prompts = self.cfg.llm.preview_prompts
        if not prompts:
            return []
        # The adapter merged into copies of the weights it adapts and its layers out of the model for the answers,
        # as for SDXL's previews: generation calls the model once a token, and each adapted layer's own code is a
        # Python call or more at each (inject.merged_for_inference; a quantized base's layers keep their adapter).
        def answers_with(merged: bool) -> list[str]:
            with self.accelerator.autocast(), (inject.merged_for_inference(model, unwrap=True) if merged
                                               else contextlib.nullcontext()):
                return answer(model, self.tokenizer, self.template, prompts, self.cfg.llm.max_new_tokens,
                              self.cfg.llm.system_prompt)

        # Answers that run out of memory (the estimate was low, another program took memory) come again without
        # the copies, or not at all: training goes on (core/memory.first_that_fits).
        answers = first_that_fits([("", lambda: answers_with(True)),
                                   ("answering again without merged copies", lambda: answers_with(False))],
                                  device=self.device, run=run, step=step, what="previews")
        if answers is None:
            return []
        for p, a in zip(prompts, answers):
            log.info("step %d | %s -> %s", step, p, a)
        return [write_answers(run.samples_dir, step, prompts, answers)]

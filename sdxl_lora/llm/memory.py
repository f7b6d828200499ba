"""The activation model of a causal LM's training step, so `sdxl-lora llm plan` can say whether a run fits:
what the decoder layers save for backward per token, with and without gradient checkpointing, and the
chunked loss's logits. From the model's config alone (no weights read)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..core.memory import DTYPE_NAMES, GiB

if TYPE_CHECKING:
    from ..core.inject import Plan

WORKSPACE = int(0.14 * GiB)  # cuBLAS and attention workspaces


def _dims(config) -> tuple[int, int, int, int, int, int]:
    """(hidden, query width, key/value width, MLP width, layers, vocabulary) of a decoder config."""
    h = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads) * head_dim
    mlp = int(getattr(config, "intermediate_size", None) or 4 * h)
    return h, heads * head_dim, kv, mlp, int(config.num_hidden_layers), int(config.vocab_size)


def layer_bytes_per_token(config, elt: int) -> int:
    """What one decoder layer saves for backward per token (SDPA attention, a gated MLP, RMSNorm in fp32):
    both norms' fp32 input copies and their outputs, q/k/v and the attention output, the MLP's gate, up,
    activation and product. The LoRA factors' own inputs are these same tensors; their rank-wide outputs
    are left out (small)."""
    h, q, kv, mlp, _, _ = _dims(config)
    return elt * (2 * h + q + 2 * kv + q + 4 * mlp) + 4 * 2 * h


@dataclass
class LLMActivations:
    saved: int        # kept for backward across the layers
    recompute: int    # one layer's activations rebuilt in backward (checkpointing), else 0
    loss: int         # the chunked loss's logits, their fp32 copy and gradient, one chunk at a time
    tokens: int

    @property
    def total(self) -> int:
        return self.saved + self.recompute + self.loss


def activation_bytes(config, batch_size: int, max_length: int, checkpointing: bool,
                     compute_dtype: torch.dtype = torch.bfloat16, loss_chunk: int = 256,
                     offload: bool = False, head_trained: bool = False) -> LLMActivations:
    """The step's activations for rows padded to max_length. Checkpointed: each layer keeps its input,
    and one layer at a time is recomputed whole in backward. Offloaded (llm.offload_activations): the
    inputs wait in host memory, two at a time on the device (the recomputed layer's, and the one before it
    on its way back)."""
    elt = torch.empty((), dtype=compute_dtype).element_size()
    h, _, _, _, layers, vocab = _dims(config)
    tokens = batch_size * max_length
    per_layer = layer_bytes_per_token(config, elt) * tokens
    head_input = tokens * h * (elt + 4)  # the final norm's output and its fp32 copy
    if checkpointing:
        saved, recompute = (2 if offload else layers) * tokens * h * elt + head_input, per_layer
    else:
        saved, recompute = layers * per_layer + head_input, 0
    # One chunk's logits at a time. A frozen head (llm/loss.py's head_cross_entropy): the head's output and
    # its fp32 copy, then that copy and the gradient in the head's dtype. A trained head (checkpointed
    # chunks, recomputed in the backward): the output's fp32 copy, the log-softmax kept for the backward and
    # the gradient coming back through it, all fp32. Logit soft-capping (Gemma 2) keeps one more fp32 buffer
    # (the tanh) either way. As torch's MemTracker counts them (benchmarks/llm_loss_memory.py, tests/llm/test_llm.py).
    capped = 4 if getattr(config, "final_logit_softcapping", None) else 0
    loss = min(loss_chunk, tokens) * vocab * ((4 + 4 + 4 if head_trained else elt + 4) + capped)
    return LLMActivations(saved, recompute, loss, tokens)


def format_activations(a: LLMActivations, checkpointing: bool, compute_dtype: torch.dtype,
                       offload: bool = False) -> list[str]:
    how = ("checkpointed: layer inputs in host memory, one layer recomputed" if checkpointing and offload else
           "checkpointed: layer inputs, one layer recomputed" if checkpointing else "every layer's kept")
    return [f"  activations    {a.total / GiB:8.2f} GiB  ({a.tokens:,} tokens, {DTYPE_NAMES.get(compute_dtype)}; {how}"
            f" {(a.saved + a.recompute) / GiB:.2f}, loss chunk {a.loss / GiB:.2f})",
            f"  workspace      {WORKSPACE / GiB:8.2f} GiB"]


def step_estimate(config, *, weights: int, trainable_params: int, optimizer: str, batch_size: int,
                  max_length: int, checkpointing: bool, compute_dtype: torch.dtype,
                  loss_chunk: int, offload: bool = False,
                  head_trained: bool = False) -> tuple[dict[str, int], LLMActivations]:
    """The step's expected peak on the accelerator by part (bytes), and the activations' detail."""
    from ..core.memory import state_bytes

    acts = activation_bytes(config, batch_size, max_length, checkpointing, compute_dtype, loss_chunk, offload,
                            head_trained)
    adapter = state_bytes(trainable_params, optimizer)
    return ({"frozen weights": weights, "adapter (fp32)": adapter["adapter"], "gradients": adapter["gradients"],
             "optimizer": adapter["optimizer"], "activations": acts.total, "workspace": WORKSPACE}, acts)


# ---- the whole step in a memory budget (train.vram_gb) ----

@dataclass
class LLMMemory:
    """A config's step on the accelerator: its parts (bytes), the activations' detail, and the whole
    process's peak (CUDA context and the allocator's reserve included), which a budget is held to."""
    parts: dict[str, int]
    acts: LLMActivations
    weights: dict[str, int]   # the frozen weights by storage
    compute_dtype: torch.dtype
    host_embedding: int = 0   # the input embedding's bytes kept in host memory (llm.offload_embeddings)

    @property
    def peak(self) -> int:
        from ..core.memory import CONTEXT, RESERVE

        return int(CONTEXT + RESERVE * sum(self.parts.values()))


def config_memory(cfg, config, model=None, plan=None) -> tuple[Plan, LLMMemory]:
    """The adapter plan and the step's memory for `cfg` on the causal LM of transformers `config`, built on
    the meta device (no weights read), as a GPU run holds it: bf16 under train.mixed_precision="auto", or
    quantized per model.quantize; the output head in full precision. `model` and `plan`: already built for
    this config (the budget's candidates share them)."""
    from transformers import AutoModelForCausalLM

    from ..core.memory import weight_bytes
    from .model import keep_head, weight_dtype
    from .slots import make_plan

    if model is None:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    plan = plan or make_plan(model, cfg.adapter)
    mp = "bf16" if cfg.train.mixed_precision == "auto" else cfg.train.mixed_precision
    compute = weight_dtype(cfg, mp)
    weights = weight_bytes(model, cfg.model.quantize, cfg.model.quant_double, compute, skip=keep_head)
    host = host_embedding_bytes(model, compute) if cfg.llm.offload_embeddings else 0
    weights[DTYPE_NAMES.get(compute, str(compute))] -= host
    parts, acts = step_estimate(config, weights=sum(weights.values()), trainable_params=plan.trainable_params,
                                optimizer=cfg.train.optimizer, batch_size=cfg.train.batch_size,
                                max_length=cfg.llm.max_length, checkpointing=cfg.train.gradient_checkpointing,
                                compute_dtype=compute, loss_chunk=cfg.llm.loss_chunk,
                                offload=cfg.llm.offload_activations, head_trained=trains_head(plan))
    return plan, LLMMemory(parts, acts, weights, compute, host)


def host_embedding_bytes(model, compute_dtype: torch.dtype) -> int:
    """The input embedding's bytes that llm.offload_embeddings keeps off the device: none where the output
    head shares the table (llm/offload.py refuses that)."""
    from .offload import head_shares_embedding

    if head_shares_embedding(model):
        return 0
    return model.get_input_embeddings().weight.numel() * torch.empty((), dtype=compute_dtype).element_size()


def trains_head(plan: Plan) -> bool:
    """Whether the plan puts an adapter on the output head (an override can): its loss then runs the
    checkpointed chunks, which hold more per chunk (llm/loss.py)."""
    from .model import keep_head

    return any(keep_head(s.name) for s in plan.targets)


@dataclass
class LLMFit:
    cfg: object                 # the config that fits
    memory: LLMMemory
    choices: dict[str, object]  # the fields the budget changed, dotted, with their new values
    slowdown: float = 1.0       # the time per token against the settings as given, by the model below


# The share of a memory budget (train.vram_gb) an LLM plan fills. Higher than core/memory.py's BUDGET_FILL
# for SDXL: the causal-LM estimates came within a few percent of measured whole-process peaks, always above
# them (benchmarks/RESULTS.md#llm-plan-against-measured-peaks), so less margin is needed to stay within the budget.
LLM_BUDGET_FILL = 0.95

# The time per token the budget's levers cost, for choosing among the configs that fit: checkpointing
# recomputes each layer's forward in backward (a step of forward + backward is about three forwards);
# fewer rows per step cost (B/b)**LLM_BATCH_EXPONENT a token, fitted to benchmarks/llm_step.py at batch 1
# and 4 (benchmarks/RESULTS.md#llm-step-against-a-plain-transformers-and-peft-loop).
CHECKPOINT_SLOWDOWN = 4 / 3
LLM_BATCH_EXPONENT = 0.3
# llm.offload_activations and llm.offload_embeddings, against the same run without: the tokens/s measured on
# Llama-3-8B at batch 4 x 2048 by benchmarks/llm_compare.py (benchmarks/RESULTS.md#llm-levers). The embedding's
# rows read by the GPU from the pinned table (llm/offload.py: reads_on_device) cost nothing measurable; looked up
# by the host, they cost tokens/s.
OFFLOAD_ACTIVATIONS_SLOWDOWN = 1.03
OFFLOAD_EMBEDDINGS_SLOWDOWN = 1.15
OFFLOAD_EMBEDDINGS_READ_ON_DEVICE_SLOWDOWN = 1.0


def fit_budget(cfg, config, budget_gib: float) -> LLMFit:
    """The fastest config, by the slowdown model above, whose whole process fits `budget_gib` (filled to
    LLM_BUDGET_FILL), from: gradient checkpointing, with the checkpointed layers' inputs in host memory
    (llm.offload_activations); the input embedding in host memory (llm.offload_embeddings, where the head
    does not share it); a smaller batch with gradient accumulation keeping the rows per optimizer step; and
    only where the base as given fits in no way, an nf4 base (QLoRA: it changes the frozen weights the
    adapter trains against). A lever the config sets itself is kept as set. No fit: a ConfigError naming
    the smallest budget that works."""
    from transformers import AutoModelForCausalLM

    from ..core.config import ConfigError
    from ..core.memory import GiB
    from ..core.quantize import plannable_bases
    from .offload import reads_on_device

    budget = int(budget_gib * GiB * LLM_BUDGET_FILL)
    quantize = [cfg.model.quantize]
    if cfg.model.quantize == "none" and "quantize" not in cfg.model.model_fields_set:
        quantize += plannable_bases(cfg.adapter.kind, ("nf4",))
    checkpointing = [cfg.train.gradient_checkpointing]
    if not cfg.train.gradient_checkpointing and "gradient_checkpointing" not in cfg.train.model_fields_set:
        checkpointing.append(True)
    b = cfg.train.batch_size
    batches = [d for d in range(b, 0, -1) if b % d == 0]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    llm = cfg.llm
    acts = [llm.offload_activations]
    if not llm.offload_activations and "offload_activations" not in llm.model_fields_set:
        acts.append(True)
    embs = [llm.offload_embeddings]
    if (not llm.offload_embeddings and "offload_embeddings" not in llm.model_fields_set
            and host_embedding_bytes(model, torch.bfloat16)):
        embs.append(True)
    # The budget is a CUDA GPU's: its run reads the rows on the device where this install has Triton.
    emb_slowdown = (OFFLOAD_EMBEDDINGS_READ_ON_DEVICE_SLOWDOWN
                    if reads_on_device(model.get_input_embeddings(), torch.device("cuda"))
                    else OFFLOAD_EMBEDDINGS_SLOWDOWN)
    plan = None  # the levers change no adapter layer: one plan serves every candidate
    smallest = None
    for q in quantize:
        best = None
        for ck, act, emb, batch in itertools.product(checkpointing, acts, embs, batches):
            if act and not ck:  # offloaded activations are the checkpointed layers' inputs
                continue
            c = cfg.model_copy(deep=True)
            c.model.quantize, c.train.gradient_checkpointing = q, ck
            c.llm.offload_activations, c.llm.offload_embeddings = act, emb
            c.train.batch_size, c.train.grad_accum = batch, cfg.train.grad_accum * (b // batch)
            plan, memory = config_memory(c, config, model, plan)
            choices = {k: v for k, v, was in (("model.quantize", q, cfg.model.quantize),
                                              ("train.gradient_checkpointing", ck, cfg.train.gradient_checkpointing),
                                              ("llm.offload_activations", act, llm.offload_activations),
                                              ("llm.offload_embeddings", emb, llm.offload_embeddings),
                                              ("train.batch_size", batch, b),
                                              ("train.grad_accum", c.train.grad_accum, cfg.train.grad_accum))
                       if v != was}
            slow = ((CHECKPOINT_SLOWDOWN if ck and not cfg.train.gradient_checkpointing else 1.0)
                    * (OFFLOAD_ACTIVATIONS_SLOWDOWN if act and not llm.offload_activations else 1.0)
                    * (emb_slowdown if emb and not llm.offload_embeddings else 1.0)
                    * (b / batch) ** LLM_BATCH_EXPONENT)
            if memory.peak <= budget and (best is None or slow < best[2] - 1e-9):
                best = (c, memory, slow, choices)
            if smallest is None or memory.peak < smallest[1].peak:
                smallest = (choices, memory)
        if best is not None:
            return LLMFit(best[0], best[1], best[3], round(best[2], 3))
    if smallest is None:  # only llm.offload_activations without the checkpointing it needs was possible
        raise ConfigError("llm.offload_activations keeps the checkpointed decoder layers' inputs in host memory: "
                          "it needs train.gradient_checkpointing = true")
    choices, memory = smallest
    chose = ", ".join(f"{k}={v}" for k, v in choices.items()) or "the settings as given"
    raise ConfigError(
        f"train.vram_gb={budget_gib:g}: this run needs at least about {memory.peak / LLM_BUDGET_FILL / GiB:.1f} GiB "
        f"(with {chose}; frozen weights {memory.parts['frozen weights'] / GiB:.1f} GiB, activations "
        f"{memory.parts['activations'] / GiB:.1f} GiB). Raise train.vram_gb, lower llm.max_length, or "
        "choose a smaller model")


# The levers fit_budget chooses for a causal LM; set by the user, they are kept, and a card they cannot fit
# refuses the run.
LEVERS = (("model", "quantize"), ("train", "gradient_checkpointing"), ("llm", "offload_activations"),
          ("llm", "offload_embeddings"))


def fit_card(cfg, config, card) -> LLMFit | None:
    """The run of `cfg` on `card` (core/card.py) with no train.vram_gb: None where the settings as given fit the
    card's budget; else the fastest that do (fit_budget at the card's budget, which the returned config sets as
    train.vram_gb, so the run caps itself there). Raises ConfigError where the settings the user set cannot fit,
    naming them and the nearest settings that fit."""
    from ..core.card import left_to_planner
    from ..core.config import ConfigError
    from ..core.memory import GiB

    budget = card.budget_gib
    if config_memory(cfg, config)[1].peak <= budget * GiB * LLM_BUDGET_FILL:
        return None
    try:
        fit = fit_budget(cfg, config, budget)
    except ConfigError:
        pass
    else:
        fit.cfg.train.vram_gb = budget
        return fit
    held, free = left_to_planner(cfg, LEVERS)
    head = f"{card.describe()} cannot hold this run"
    try:
        nearest = fit_budget(free, config, budget)
    except ConfigError as e:
        raise ConfigError(f"{head}: {e}") from None
    fits = "; ".join(f"{k}={v!r}" for k, v in nearest.choices.items())
    set_ = ", ".join(f"{k}={v!r}" for k, v in held.items())
    raise ConfigError(f"{head} with {set_} as you set. Settings that fit: {fits} (step about "
                      f"{nearest.memory.peak / GiB:.1f} GiB, about {nearest.slowdown:.2f}x the time per token). Set "
                      f"those, or leave {', '.join(held)} unset so the planner chooses, or give a budget with --vram "
                      "(train.vram_gb)")

"""What a config will train on the SDXL UNet, before it trains: the adapter plan and the memory estimate.
The one path the CLI's `plan`, the UI's Train form and the training task all take, so they agree."""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from ..core.config import AdapterConfig, Config, ConfigError
from ..core.inject import Plan
from ..core.memory import BUDGET_FILL, GiB
from ..core.quantize import plannable_bases
from .captions import live_text
from .memory import MemoryEstimate, RunMemory, estimate_for_config, run_memory
from .preview import tiled_previews
from .slots import make_plan

if TYPE_CHECKING:
    from ..core.card import Card


@dataclass
class UNetPlan:
    plan: Plan
    memory: MemoryEstimate
    resolution: int   # the side of the square the ranks were scaled to and the estimate is for
    native: int       # the model's own resolution
    # Weights of each layer model.quantize / quantize_convs store quantized, smallest first.
    quantized_sizes: tuple[int, ...] = ()


def plan_unet(cfg: Config, unet: nn.Module, native: int, resolution: int | None = None,
              mixed_precision: str | None = None) -> UNetPlan:
    """The plan and estimate for `unet` (any device, meta included) whose native resolution is `native`.
    `resolution`: the largest batch's side (a run: the square of its largest bucket's area); none means
    data.resolution, else the native one. `mixed_precision`: what the run resolved; none reads
    train.mixed_precision, taking "auto" as bf16 (a GPU run)."""
    resolution = resolution or cfg.data.resolution or native
    plan = make_plan(unet, cfg.adapter, resolution=resolution, native=native)
    latent_factor = native // int(unet.config.sample_size)
    memory = estimate_for_config(unet, cfg, plan.trainable_params, resolution, mixed_precision, latent_factor)
    return UNetPlan(plan, memory, resolution, native, quantized_sizes(cfg, unet))


def quantized_sizes(cfg: Config, unet: nn.Module) -> tuple[int, ...]:
    """Weights of each layer the config's quantization stores quantized (sdxl/quantize.py's skip rules), smallest
    first, from the UNet before it is quantized (any device)."""
    from ..core.memory import quantized_layers
    from .quantize import unet_conv_skip, unet_skip

    linears, convs = quantized_layers(unet, cfg.model.quantize, unet_skip, cfg.model.quantize_convs, unet_conv_skip)
    return tuple(sorted(m.weight.numel() for m in (*linears, *convs)))


def text_encoder_rank_alpha(a: AdapterConfig) -> tuple[int, float]:
    """The rank and alpha of the text encoders' adapters (adapter.train_text_encoder): text_encoder_rank, else
    rank, at the UNet's alpha/rank ratio."""
    rank = a.text_encoder_rank or a.rank
    return rank, rank * (a.alpha / a.rank) if a.alpha is not None else float(rank)


def plan_config(cfg: Config) -> UNetPlan:
    """The plan and estimate from the model's config alone: its UNet on the meta device, no weights read."""
    from .model import unet_skeleton

    unet, native = unet_skeleton(cfg.model)
    return plan_unet(cfg, unet, native)


# ---- the whole run, and a memory budget (train.vram_gb) ----

def component_bytes(cfg: Config) -> tuple[int, int]:
    """(VAE, both text encoders) in bytes as the trainer holds them (fp32), from their configs on the meta
    device: no weights read."""
    from .model import ARCH_SDXL, resolve_model_path, single_file_configs
    from .formats.single_file import SDXL_BASE_CONFIG_DIR

    path = SDXL_BASE_CONFIG_DIR if cfg.model.path == ARCH_SDXL else resolve_model_path(cfg.model)
    if path.is_file():
        path = single_file_configs(path, cfg.model) or SDXL_BASE_CONFIG_DIR
    return _component_bytes(str(path))


@functools.cache
def _component_bytes(folder: str) -> tuple[int, int]:
    # Per config folder: building the text encoders, even on the meta device, takes a moment.
    import torch
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from ..core.weights import read_json

    path = Path(folder)

    def size(module) -> int:
        return sum(p.numel() for p in module.parameters()) * 4

    with torch.device("meta"):
        vae = size(AutoencoderKL.from_config(read_json(path / "vae" / "config.json")))
        text = size(CLIPTextModel(CLIPTextConfig.from_json_file(path / "text_encoder" / "config.json")))
        text += size(CLIPTextModelWithProjection(CLIPTextConfig.from_json_file(path / "text_encoder_2" / "config.json")))
    return vae, text


def unet_read_on_device(cfg: Config) -> bool:
    """Whether training on a GPU reads the frozen UNet straight onto it, before the caches are filled
    (sdxl/model.py: load_pipeline's unet_device): not a base to quantize (its layers wait on the host and go
    to the device one at a time, quantized), nor under train.vram_gb (caching then holds only the VAE and the
    text encoders, as the budget's fit counts it)."""
    return cfg.model.quantize == "none" and cfg.model.quantize_convs == "none" and not cfg.train.vram_gb


def run_memory_for(cfg: Config, planned: UNetPlan, components: tuple[int, int], largest_pixels: int | None = None,
                   preview_pixels: int | None = None) -> RunMemory:
    """The whole run's phases for a config whose step estimate is planned.memory; images (the largest bucket)
    and previews of planned.resolution squared unless given."""
    square = planned.resolution ** 2
    previews = (cfg.preview.before or cfg.preview.after or cfg.preview.every > 0 or cfg.preview.every_epochs > 0) and cfg.preview.prompts != ""

    def phases(copies: int) -> RunMemory:
        return run_memory(planned.memory, vae_bytes=components[0], text_bytes=components[1],
                          largest_pixels=largest_pixels or square, preview_pixels=preview_pixels or square,
                          previews=previews,
                          vae_tiling=tiled_previews(cfg), tiled_encode=cfg.model.tiled_vae_encode,
                          previews_mid_run=cfg.preview.every > 0 or cfg.preview.every_epochs > 0, previews_after=cfg.preview.after,
                          graphs=cfg.train.cuda_graphs,
                          encoders_stay=cfg.adapter.train_text_encoder or live_text(cfg.data),
                          vae_stays=cfg.data.crop == "random",
                          step_budget=(int(cfg.train.checkpoint_budget_gb * GiB)
                                       if cfg.train.checkpoint_budget_gb and not cfg.train.gradient_checkpointing
                                       else None),
                          unet_while_caching=unet_read_on_device(cfg), merged_copies=copies)

    merged = merged_copy_bytes(cfg, planned)
    run = phases(merged)
    sizes = dequantized_copy_sizes(cfg, planned)
    if not previews or not sizes:
        return run
    # A quantized base's previews render from 16-bit copies of its layers (inject.dequantized_for_inference), the
    # smallest first, as many as fit under the run's peak: previews must not raise the peak a quantized run was
    # planned at, but below it the copies cost nothing the run does not hold at another time anyway. The previews
    # phase grows with the copies, so the most that fit is found by bisection over the smallest-first prefixes.
    held = [0, *itertools.accumulate(sizes)]
    fit, over = 0, len(sizes) + 1
    while over - fit > 1:
        mid = (fit + over) // 2
        fit, over = (mid, over) if phases(merged + held[mid]).phases["previews"] <= run.peak else (fit, mid)
    if not fit:
        run.notes.append("previews render from the quantized layers: no 16-bit copy fits under the run's peak")
        return run
    out = phases(merged + held[fit])
    out.dequantized_bytes, out.dequantized_layers = held[fit], (fit, len(sizes))
    out.notes.append(f"previews render from 16-bit copies of all {fit} quantized layers ({held[fit] / GiB:.2f} GiB): "
                     "they fit under the run's peak" if fit == len(sizes) else
                     f"previews render from 16-bit copies of {fit} of {len(sizes)} quantized layers "
                     f"({held[fit] / GiB:.2f} GiB), the smallest: as many as fit under the run's peak")
    return out


def dequantized_copy_sizes(cfg: Config, planned: UNetPlan) -> tuple[int, ...]:
    """Bytes of the 16-bit copy of each of a quantized base's layers that previews may render from, smallest first
    (inject.dequantized_for_inference); none where nothing is quantized or the adapter is DoRA (which keeps its
    path on quantized layers)."""
    if cfg.adapter.kind != "lora":
        return ()
    return tuple(n * _compute_bytes(planned) for n in planned.quantized_sizes)


def merged_copy_bytes(cfg: Config, planned: UNetPlan) -> int:
    """Bytes of the copies previews merge the adapter into (inject.merged_for_inference): each adapted layer's
    frozen weight in the compute dtype, where it is not quantized (a 4-bit or fp8 layer keeps its adapter path)."""
    def floating(slot) -> bool:
        return (cfg.model.quantize_convs if slot.conv else cfg.model.quantize) == "none"

    return sum(s.in_features * s.out_features for s in planned.plan.targets if floating(s)) * _compute_bytes(planned)


def _compute_bytes(planned: UNetPlan) -> int:
    """Bytes a weight in the run's compute dtype (the estimate's)."""
    return 4 if planned.memory.compute_dtype == "fp32" else 2


class BudgetError(ConfigError):
    """No config fits the budget; `least_gib`: the smallest budget that works."""

    def __init__(self, least_gib: float, message: str):
        super().__init__(message)
        self.least_gib = least_gib


@dataclass
class BudgetFit:
    cfg: Config                 # the config with the levers chosen
    planned: UNetPlan           # its plan and step estimate
    memory: RunMemory
    changes: dict[str, tuple]   # field -> (as given, as chosen)
    slowdown: float             # the time per image against the config as given (a model, see below)

    @property
    def choices(self) -> dict[str, str]:
        return {name: f"{after!r} (was {before!r})" for name, (before, after) in self.changes.items()}


# Time per image of each lever against none, through the CLI with CUDA graphs (what a budgeted run uses;
# benchmarks/RESULTS.md#every-card-by-default). A quantized base costs 1 + QUANT_STEP_COST/b at micro-batch b: its
# weights are turned back to 16 bits at every step whatever the batch (fp8 8 GB cells at batch 1 and 2 against nf4
# in the same call: 1.17x and 1.14x slower; nf4 at batch 1 against the 16-bit base on the whole card about 1.25x,
# at batch 4 about 1.0x). Full checkpointing: every block checkpointed at batch 2 by hand, 1.40x and 1.33x at 12 and
# 16 GB; selective checkpointing in proportion to the activations it recomputes. A micro-batch of b images costs
# the time of b + STEP_IMAGES images: a fixed cost a step (the whole card's rates at batch 1-8 fit 1.05; batch 2 x 2
# accumulated against batch 4 in one call, 1.24x, fits 1.24; batch 8 x 2 against 16 trained alike).
QUANT_STEP_COST = {"fp8": 0.44, "nf4": 0.25}
CHECKPOINT_SLOWDOWN = 1.36
STEP_IMAGES = 1.1


def quant_slowdown(quant: str, batch: int) -> float:
    """Time per image with a `quant` base at micro-batch `batch` against the 16-bit base."""
    return 1 + QUANT_STEP_COST.get(quant, 0.0) / batch


def batch_slowdown(micro: int, batch: int) -> float:
    """Time per image at micro-batch `micro` (accumulated to `batch` a step) against `batch` in one."""
    return (1 + STEP_IMAGES / micro) / (1 + STEP_IMAGES / batch)


def fit_budget(cfg: Config, budget_gib: float, unet: nn.Module | None = None, native: int | None = None,
               components: tuple[int, int] | None = None) -> BudgetFit:
    """The fastest config, by the time model above, whose whole run fits `budget_gib`: previews with a tiled VAE
    decode (no cost to training), selective or full checkpointing, an fp8 or nf4 base (where it loads and the
    adapter kind trains over it: plannable_bases), then a smaller batch with gradient accumulation keeping the
    effective batch. Levers the config sets itself are kept as set. No fit: a BudgetError naming the smallest
    budget that works."""
    from .memory import RESERVE
    from .model import unet_skeleton

    if unet is None:
        unet, native = unet_skeleton(cfg.model)
    components = components or component_bytes(cfg)
    budget = int(budget_gib * GiB * BUDGET_FILL)
    tc, given = cfg.train, cfg.train.model_fields_set
    base = plan_unet(cfg, unet, native)  # the adapter: the same whatever the memory levers

    quants = ([cfg.model.quantize] if "quantize" in cfg.model.model_fields_set or cfg.model.quantize != "none"
              else ["none", *plannable_bases(cfg.adapter.kind, ("fp8", "nf4"))])
    ckpt_given = bool({"gradient_checkpointing", "checkpoint_budget_gb"} & given) or bool(
        tc.gradient_checkpointing or tc.checkpoint_budget_gb)
    modes = ["as set"] if ckpt_given else ["none", "selective", "full"]
    batches = [tc.batch_size]
    while batches[-1] > 1:
        batches.append(batches[-1] // 2)
    # (previews decoded in tiles, caching encoded in tiles): no cost to training; the previews' first (the
    # tiled encode changes the latents a little). A lever the user set keeps its value.
    tilings = [(d, e) for d, e in ((False, False), (True, False), (False, True), (True, True))
               if ("vae_tiling" not in cfg.preview.model_fields_set or d == cfg.preview.vae_tiling)
               and ("tiled_vae_encode" not in cfg.model.model_fields_set or e == cfg.model.tiled_vae_encode)]

    steps: dict[tuple, MemoryEstimate] = {}  # the step's estimate does not depend on the previews' tiling
    sizes: dict[str, tuple[int, ...]] = {}   # each base's quantized layers (for the previews' 16-bit copies)

    def planned(c: Config, step: MemoryEstimate) -> UNetPlan:
        if c.model.quantize not in sizes:
            sizes[c.model.quantize] = quantized_sizes(c, unet)
        return UNetPlan(base.plan, step, base.resolution, native, sizes[c.model.quantize])

    def variant(quant: str, full: bool, batch: int, tiling: tuple[bool, bool]) -> tuple[Config, RunMemory]:
        c = cfg.model_copy(deep=True)
        c.model.quantize = quant
        c.train.batch_size, c.train.grad_accum = batch, tc.grad_accum * (tc.batch_size // batch)
        c.preview.vae_tiling, c.model.tiled_vae_encode = tiling
        if not ckpt_given:
            c.train.gradient_checkpointing = full
        key = (quant, full, batch)
        if key not in steps:
            steps[key] = estimate_for_config(unet, c, base.plan.trainable_params, base.resolution,
                                             latent_factor=native // int(unet.config.sample_size))
        return c, run_memory_for(c, planned(c, steps[key]), components)

    best = smallest = None
    for quant in quants:
        for batch in batches:
            for tiling in tilings:
                for mode in modes:
                    c, memory = variant(quant, mode == "full", batch, tiling)
                    # Against the settings as given: a base quantized as set costs nothing more here.
                    slow = (quant_slowdown(quant, batch) / quant_slowdown(cfg.model.quantize, tc.batch_size)
                            * batch_slowdown(batch, tc.batch_size))
                    if mode == "full":
                        slow *= CHECKPOINT_SLOWDOWN
                    elif mode == "selective":
                        # Only as many blocks checkpointed as the budget needs (train.checkpoint_budget_gb): the
                        # training phase shrinks to the budget, the time grows with the share recomputed.
                        floor = variant(quant, True, batch, tiling)[1].phases["training"]
                        over, span = memory.phases["training"] - budget, memory.phases["training"] - floor
                        if over <= 0 or floor > budget:
                            continue
                        c.train.checkpoint_budget_gb = math.floor((memory.step.total - over / RESERVE) / GiB * 100) / 100
                        memory = run_memory_for(c, planned(c, memory.step), components)
                        slow *= 1 + (CHECKPOINT_SLOWDOWN - 1) * over / span
                    if smallest is None or memory.peak < smallest[1].peak:
                        smallest = (c, memory)
                    if memory.peak <= budget and (best is None or slow < best[2] - 1e-9):
                        best = (c, memory, slow)
    if best is None:
        c, memory = smallest
        raise BudgetError(memory.peak / BUDGET_FILL / GiB,
            f"train.vram_gb={budget_gib:g}: this run needs at least about {memory.peak / BUDGET_FILL / GiB:.1f} GiB "
            f"(with {_levers(cfg, c) or 'the settings as given'}; the largest phase: "
            f"{max(memory.phases, key=memory.phases.get)}). Raise train.vram_gb, lower data.resolution, "
            "or turn the previews off (preview.prompts='')")
    c, memory, slow = best
    return BudgetFit(c, planned(c, memory.step), memory, changes(cfg, c), round(slow, 3))


def changes(a: Config, b: Config) -> dict[str, tuple]:
    """The memory levers config b sets otherwise than a: field -> (a's value, b's)."""
    out = {}
    levers = (("model", ("quantize", "tiled_vae_encode")),
              ("train", ("batch_size", "grad_accum", "gradient_checkpointing", "checkpoint_budget_gb")),
              ("preview", ("vae_tiling",)))
    for section, fields in levers:
        for f in fields:
            x, y = getattr(getattr(a, section), f), getattr(getattr(b, section), f)
            if x != y:
                out[f"{section}.{f}"] = (x, y)
    return out


def _levers(a: Config, b: Config) -> str:
    return ", ".join(f"{k} {v[1]!r}" for k, v in changes(a, b).items())


# ---- the run on the card it runs on: the one plan entry the CLI, the UI and the task call ----

# The memory levers fit_budget chooses; set by the user, they are kept, and a card they cannot fit refuses the run.
LEVERS = (("model", "quantize"), ("model", "tiled_vae_encode"), ("train", "gradient_checkpointing"),
          ("train", "checkpoint_budget_gb"), ("preview", "vae_tiling"))


@dataclass
class RunPlan:
    """What a run will train with and the memory it will need: the config as trained (a budget's or the card's
    choices applied), its plan, the whole run's phases, the choices (field -> (as given, as chosen)) and the time
    per image against the settings as given."""
    cfg: Config
    planned: UNetPlan
    memory: RunMemory
    changes: dict[str, tuple]
    slowdown: float
    card: "Card | None" = None
    budget_gib: float | None = None  # what the plan was held to: train.vram_gb, or the card's budget
    card_budget: bool = False        # the budget is the card's: the settings as given did not fit it

    choices = BudgetFit.choices  # the same words for the same changes

    def verdict(self) -> str:
        """One line on the card: that the settings as given fit it, or what was chosen so that they do and their
        time per image; the budget's choices where train.vram_gb was given; or that no card is known."""
        if self.card is None and self.budget_gib is None:
            return "no GPU here: give --card N to plan for a card of N GB"
        where = self.card.describe() if self.card_budget or self.budget_gib is None else \
            f"train.vram_gb={self.budget_gib:g}"
        if not self.changes:
            return f"fits {where} as set (whole run about {self.memory.peak / GiB:.1f} GiB)"
        chose = "; ".join(f"{k} {v[1]!r}" for k, v in self.changes.items())
        return (f"{where}: {chose}; whole run about {self.memory.peak / GiB:.1f} GiB, about {self.slowdown:.2f}x "
                "the time per image of the settings as given")


def plan_run(cfg: Config, card: "Card | None" = None) -> RunPlan:
    """The whole run of `cfg` on `card` (None: no GPU known), from the model's config alone: train.vram_gb set,
    its budget's fit; else the settings as given where they fit the card's budget, or the fastest that do
    (fit_budget, the budget then set as train.vram_gb in the returned config, so the run caps itself there).
    Raises ConfigError where the settings the user set cannot fit, naming them and the nearest that fit."""
    from .model import unet_skeleton

    unet, native = unet_skeleton(cfg.model)
    components = component_bytes(cfg)
    if cfg.train.vram_gb:
        fit = fit_budget(cfg, cfg.train.vram_gb, unet, native, components)
        return RunPlan(fit.cfg, fit.planned, fit.memory, fit.changes, fit.slowdown, card, cfg.train.vram_gb)
    planned = plan_unet(cfg, unet, native)
    whole = run_memory_for(cfg, planned, components)
    if card is None or whole.peak <= card.budget_gib * GiB * BUDGET_FILL:
        return RunPlan(cfg, planned, whole, {}, 1.0, card)
    budget = card.budget_gib
    budgeted = cfg.model_copy(deep=True)
    budgeted.train.vram_gb = budget  # caching then holds only the VAE and text encoders, as the fit counts it
    try:
        fit = fit_budget(budgeted, budget, unet, native, components)
    except BudgetError:
        raise ConfigError(_refusal(cfg, card, unet, native, components)) from None
    return RunPlan(fit.cfg, fit.planned, fit.memory, fit.changes, fit.slowdown, card, budget, card_budget=True)


def _refusal(cfg: Config, card: "Card", unet: nn.Module, native: int, components: tuple[int, int]) -> str:
    """Why `cfg` cannot fit `card`: the levers the user set that hold it back, and the nearest settings that fit
    (the same run with those levers left to the planner), or what to change where nothing fits."""
    from ..core.card import left_to_planner

    held, free = left_to_planner(cfg, LEVERS)
    free.train.vram_gb = card.budget_gib
    set_ = ", ".join(f"{k}={v!r}" for k, v in held.items())
    head = f"{card.describe()} cannot hold this run"
    try:
        fit = fit_budget(free, card.budget_gib, unet, native, components)
    except BudgetError as e:
        return (f"{head}{f' with {set_} as you set' if held else ''}: even with the least memory the planner has "
                f"(an nf4 base, every block recomputed, batch 1) it needs more. Lower data.resolution, turn the "
                f"previews off (preview.prompts=''), or train on a larger card (the least this run needs is "
                f"about {e.least_gib:.1f} GiB)")
    fits = "; ".join(f"{k}={v[1]!r}" for k, v in fit.changes.items())
    return (f"{head} with {set_ or 'the settings as given'}{' as you set' if held else ''}. Settings that fit: "
            f"{fits} (whole run about {fit.memory.peak / GiB:.1f} GiB, about {fit.slowdown:.2f}x the time per "
            f"image). Set those, or leave {', '.join(held) or 'them'} unset so the planner chooses, or give a "
            "budget with --vram (train.vram_gb)")


# ---- card presets (sdxl/presets.py): each card's budget planned by fit_budget ----

@dataclass
class CardPlan:
    name: str
    about: str
    budget: float | None        # train.vram_gb; none: no budget
    memory: RunMemory | None    # the whole run as planned; none when the budget cannot be met
    fit: BudgetFit | None = None
    error: str | None = None    # why the budget cannot be met (the planner's message)

    @property
    def slowdown(self) -> float | None:
        """The time per image against the same settings without a budget (fit_budget's time model)."""
        return None if self.memory is None else self.fit.slowdown if self.fit else 1.0

    def as_dict(self) -> dict:
        return {"preset": self.name, "about": self.about, "vram_gb": self.budget,
                "peak_gib": None if self.memory is None else round(self.memory.peak / GiB, 2),
                "slowdown": self.slowdown, "choices": self.fit.choices if self.fit else {}, "error": self.error}


def with_card(cfg: Config, name: str) -> Config:
    """cfg with card preset `name`'s settings over it (the card is what varies; none: no budget)."""
    from .presets import CARDS

    c = cfg.model_copy(deep=True)
    c.card, c.train.vram_gb = name, None
    for key, value in CARDS[name].settings.items():
        section, field = key.split(".")
        setattr(getattr(c, section), field, value)
    return c


def card_plans(cfg: Config) -> list[CardPlan]:
    """Every card preset for this config's model, adapter, batch and resolution, planned from the model's config
    alone (no weights read)."""
    from ..core.config import ConfigError
    from .presets import CARDS
    from .model import unet_skeleton

    unet, native = unet_skeleton(cfg.model)
    components = component_bytes(cfg)
    out = []
    for name, preset in CARDS.items():
        c = with_card(cfg, name)
        budget = c.train.vram_gb
        if budget is None:
            out.append(CardPlan(name, preset.about, None,
                                run_memory_for(c, plan_unet(c, unet, native), components)))
            continue
        try:
            fit = fit_budget(c, budget, unet, native, components)
        except ConfigError as e:
            out.append(CardPlan(name, preset.about, budget, None, error=str(e)))
        else:
            out.append(CardPlan(name, preset.about, budget, fit.memory, fit))
    return out


def format_cards(plans: list[CardPlan]) -> str:
    lines = [f"{'preset':<10} {'budget':>7} {'peak':>9} {'time/image':>11}  what the planner chose"]
    for p in plans:
        budget = "none" if p.budget is None else f"{p.budget:g} GiB"
        if p.memory is None:
            lines.append(f"{p.name:<10} {budget:>7} {'-':>9} {'-':>11}  does not fit: {p.error}")
            continue
        chose = "; ".join(f"{k} {v[1]!r}" for k, v in p.fit.changes.items()) if p.fit else ""
        lines.append(f"{p.name:<10} {budget:>7} {p.memory.peak / GiB:>5.1f} GiB {p.slowdown:>10.2f}x  "
                     f"{chose or 'the settings as given'}")
    lines.append("(peak: the whole run's largest phase; time/image: against the same settings without a budget)")
    return "\n".join(lines)

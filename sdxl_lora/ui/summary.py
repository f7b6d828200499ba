"""The one line the Train form shows before Start: what the run will train and the memory it will need, from the
one plan entry `sdxl-lora plan` and the training task call too (sdxl/plan.py: plan_run), and the card presets'
choices with their memory and time per image (sdxl/plan.py: card_plans). Time is the planner's relative
slowdown, never minutes: it has no model of a step's time on a given GPU, so any minutes shown here would be
made up."""
from __future__ import annotations

import functools

from sdxl_lora.sdxl import presets
from sdxl_lora.core.config import Config, config_class
from sdxl_lora.core.memory import GiB


def _count(n: int) -> str:
    if n >= 10**9:
        return f"{n / 10**9:.1f} B"
    if n >= 10**6:
        return f"{n / 10**6:.0f} M" if n >= 10**7 else f"{n / 10**6:.1f} M"
    if n >= 10**3:
        return f"{n / 10**3:.0f} k"
    return str(n)


def _gib(b: int) -> str:
    return f"{b / GiB:.1f}"


# The budget's levers (sdxl/plan.py: changes) in the form's words.
def _chosen(changes: dict[str, tuple]) -> list[str]:
    words = {"model.quantize": lambda v: f"{v} base model",
             "train.batch_size": lambda v: f"batch {v}",
             "train.grad_accum": lambda v: f"{v} accumulated",
             "train.gradient_checkpointing": lambda v: "recomputing (full)" if v else "",
             "train.checkpoint_budget_gb": lambda v: "recomputing (partial)" if v else "",
             "preview.vae_tiling": lambda v: "tiled previews" if v else "",
             "model.tiled_vae_encode": lambda v: "tiled image preparation" if v else ""}
    return [w for w in (words[k](after) for k, (_, after) in changes.items()) if w]


def run_summary(cfg: Config) -> str:
    """The trainable parameters and layers, the whole run's peak (and the training and preview phases'), what the
    run will do on this machine's GPU (fits as set, or what its budget chose; train.vram_gb's where set), and the
    number of datasets where there are several. Raises ConfigError (settings the card cannot hold name the
    nearest that fit), FileNotFoundError for a model that is not there."""
    from sdxl_lora.sdxl.plan import plan_run

    card = _card()
    run = plan_run(cfg, card)
    plan, whole = run.planned.plan, run.memory
    phases = ", ".join(f"{name} {_gib(b)}" for name, b in whole.phases.items() if name in ("training", "previews"))
    line = (f"{_count(plan.trainable_params)} trainable parameters in {len(plan.targets)} layers; "
            f"whole run peak on a GPU ~{_gib(whole.peak)} GiB ({phases})")
    chosen = _chosen(run.changes)
    if run.budget_gib is not None:
        where = f"this {card.size} card" if run.card_budget else f"budget {run.budget_gib:g} GiB"
        line += f"; {where}: " + (f"chose {', '.join(chosen)}, ~{run.slowdown:.2f}x the time per image"
                                  if chosen else "fits as set")
    elif card is not None:
        line += f"; fits this {card.size} card as set"
    named = [f"{k} preset {v}" for k, v in (("card", cfg.card), ("goal", cfg.goal)) if v]
    return line + _datasets(cfg) + (f"; {', '.join(named)}" if named else "")


@functools.cache
def _card():
    """This machine's GPU, its whole memory (the UI holds no CUDA context of its own): read once."""
    from sdxl_lora.core.card import card_without_context

    return card_without_context(free=False)


def _datasets(cfg: Config) -> str:
    """"; 3 datasets (1 regularization)" where the run trains on several."""
    tables = cfg.data.datasets
    n = len(tables) or len(cfg.data.dirs)
    if n < 2:
        return ""
    regularization = sum(d.is_regularization for d in tables)
    return f"; {n} datasets" + (f" ({regularization} regularization)" if regularization else "")


# ---- the presets' dropdowns (sdxl/presets.py) -----------------------------------------------------------

# The fields a card preset's plan decides: the budget's levers (sdxl/plan.py: changes) and what a card sets.
CARD_FIELDS = ("train.vram_gb", "train.compile", "train.channels_last", "model.quantize", "model.tiled_vae_encode",
               "train.batch_size", "train.grad_accum", "train.gradient_checkpointing", "train.checkpoint_budget_gb",
               "preview.vae_tiling")


# The fields a goal preset sets (any of them).
GOAL_FIELDS = tuple(sorted({k for goal in presets.GOALS.values() for k in goal.settings}))


def _get(cfg: Config, key: str):
    section, field = key.split(".")
    return getattr(getattr(cfg, section), field)


def for_cards(cfg: Config) -> Config:
    """The form's config as a card preset starts from it. The form sets every field, so its memory levers
    would all count as the user's and no budget could choose them: they go back to unset, and the batch to
    the images per optimizer step (the planner halves it with accumulation where it must)."""
    drop: dict[str, set[str]] = {}
    for key in CARD_FIELDS:
        section, field = key.split(".")
        if key != "train.batch_size":
            drop.setdefault(section, set()).add(field)
    tree = cfg.model_dump(exclude=drop)
    tree["train"]["batch_size"] = cfg.train.batch_size * cfg.train.grad_accum
    return type(cfg).model_validate(tree)


def card_choices(cfg: Config) -> list[tuple[str, str]]:
    """The card dropdown's choices, (label, name): each card's whole-run peak and time per image for the form's
    model, adapter, batch and resolution."""
    return list(_card_choices(for_cards(cfg).model_dump_json(exclude_unset=True)))


@functools.lru_cache(maxsize=16)
def _card_choices(config_json: str) -> tuple[tuple[str, str], ...]:
    # Planning every card takes seconds; a page (re)loaded, or a form set back, asks again for the same config.
    from sdxl_lora.sdxl.plan import card_plans

    out = [("no card preset", "")]
    for p in card_plans(config_class("sdxl").model_validate_json(config_json)):
        shown = (f"{p.name} · does not fit" if p.memory is None else
                 f"{p.name} · ~{_gib(p.memory.peak)} GiB · {p.slowdown:.2f}x time per image")
        out.append((shown, p.name))
    return tuple(out)


def card_fill(cfg: Config, name: str) -> dict[str, object]:
    """The values card preset `name` ("" for none) puts in the form: its budget and what the planner chose."""
    from sdxl_lora.sdxl.plan import fit_budget, with_card

    base = for_cards(cfg)
    if name:
        base = with_card(base, name)
        if base.train.vram_gb:
            base = fit_budget(base, base.train.vram_gb).cfg
    return {key: _get(base, key) for key in CARD_FIELDS}


def goal_fill(cfg: Config, name: str) -> dict[str, object]:
    """The values goal preset `name` ("" for none) puts in the form, as a config naming it resolves them for
    the form's model (its own recommended settings first)."""
    from sdxl_lora.core.config import load_config

    resolved = load_config(None, None, {"model.path": cfg.model.path, **({"goal": name} if name else {})})
    return {key: _get(resolved, key) for key in GOAL_FIELDS}

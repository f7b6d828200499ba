"""The one line the Train form shows before Start: what the run will train and the memory it will need, from the
planner `sdxl-lora plan` uses (sdxl/plan.py: plan_config, run_memory_for, component_bytes, and fit_budget when
train.vram_gb is set). No time estimate: the planner has a model of relative slowdowns, not of a step's time
on a given GPU, so any minutes shown here would be made up."""
from __future__ import annotations

from sdxl_lora.core.config import Config
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
    """The trainable parameters and layers, the whole run's peak (and the training and preview phases'), and
    with train.vram_gb what the budget chose. Raises ConfigError (an impossible budget names the smallest
    that works), FileNotFoundError for a model that is not there."""
    from sdxl_lora.sdxl.plan import component_bytes, fit_budget, plan_config, run_memory_for

    budget = cfg.train.vram_gb
    if budget:
        fit = fit_budget(cfg, budget)
        chosen, planned, whole = _chosen(fit.changes), fit.planned, fit.memory
    else:
        chosen, planned = [], plan_config(cfg)
        whole = run_memory_for(cfg, planned, component_bytes(cfg))
    plan = planned.plan
    phases = ", ".join(f"{name} {_gib(b)}" for name, b in whole.phases.items() if name in ("training", "previews"))
    line = (f"{_count(plan.trainable_params)} trainable parameters in {len(plan.targets)} layers; "
            f"whole run peak on a GPU ~{_gib(whole.peak)} GiB ({phases})")
    if budget:
        line += f"; budget {budget:g} GiB: " + (f"chose {', '.join(chosen)}" if chosen else "fits as set")
    return line

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


def _chosen(before: Config, after: Config) -> list[str]:
    """What the budget changed, in the form's words."""
    out = []
    if after.model.quantize != before.model.quantize:
        out.append(f"{after.model.quantize} base model")
    if after.train.batch_size != before.train.batch_size:
        out.append(f"batch {after.train.batch_size} with {after.train.grad_accum} accumulated")
    if after.train.gradient_checkpointing and not before.train.gradient_checkpointing:
        out.append("recomputing (full)")
    elif after.train.checkpoint_budget_gb != before.train.checkpoint_budget_gb:
        out.append("recomputing (partial)")
    if after.preview.vae_tiling and not before.preview.vae_tiling:
        out.append("tiled previews")
    return out


def run_summary(cfg: Config) -> str:
    """E.g. "15 M trainable parameters in 560 layers; whole run peak on a GPU ~7.2 GiB (training 6.1,
    previews 7.2); budget 8 GiB: chose nf4 base model, tiled previews". Raises ConfigError (an impossible
    budget names the smallest that works), FileNotFoundError for a model that is not there."""
    from sdxl_lora.sdxl.plan import component_bytes, fit_budget, plan_config, run_memory_for

    budget = cfg.train.vram_gb
    chosen: list[str] = []
    if budget:
        fit = fit_budget(cfg, budget)
        chosen, cfg = _chosen(cfg, fit.cfg), fit.cfg
    planned = plan_config(cfg)
    whole = run_memory_for(cfg, planned, component_bytes(cfg))
    plan = planned.plan
    phases = ", ".join(f"{name} {_gib(b)}" for name, b in whole.phases.items() if name in ("training", "previews"))
    line = (f"{_count(plan.trainable_params)} trainable parameters in {len(plan.targets)} layers; "
            f"whole run peak on a GPU ~{_gib(whole.peak)} GiB ({phases})")
    if budget:
        line += f"; budget {budget:g} GiB: " + (f"chose {', '.join(chosen)}" if chosen else "fits as set")
    return line

"""The injector: classify every candidate layer of a model into a slot, turn a policy into a plan, apply it with peft.

A slot says where a layer sits in the model's topology (for the SDXL UNet: down/mid/up level, its
feature-map size, kohya's block id, self or cross attention, which projection; for a causal LM: the
layer index and q/k/v/o/gate/up/down), so a policy can say "cross-attention q and v" instead of
listing module names. The injector walks the model; no module list is typed by hand. What a model
family's layers are, and what each preset weights, is its task's Topology (sdxl/slots.py, llm/slots.py).

Policy, in order: a preset picks the layers and weights their ranks (docs/injector.md says why each
weight is what it is); the base rank scales with training resolution; glob overrides set a rank
per slot (0 leaves it out). The plan goes to peft as one LoraConfig with per-module rank_pattern and
alpha_pattern, so mixed ranks flow into training, checkpoints and exports unchanged. With a rank budget,
ranks are redistributed by each slot's measured sensitivity (calibrate, budget_plan).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from .config import AdapterConfig

PRESETS = ("attn", "cross-attn", "topology", "full", "locon")
# The adapter kinds (adapter.kind) and the prefix of their trainable tensors' names in peft's layers.
KINDS = ("lora", "dora", "loha", "lokr")
ADAPTER_PREFIXES = ("lora_", "hada_", "lokr_")


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name is an adapter's (LoRA's lora_A/B and DoRA's magnitude, LoHa's hada_*, LoKr's
    lokr_*), not the frozen base's."""
    return any(p in name for p in ADAPTER_PREFIXES)


@dataclass(frozen=True)
class Slot:
    name: str            # full module path, e.g. "down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_q"
    part: str            # "down" | "mid" | "up" | "layer" (LLM) | "other"
    index: int | None    # block index within its part (down/up), or the LLM layer index
    level: int | None    # UNet level, 0 = full latent resolution; mid = deepest
    block: str           # kohya's block id: IN00..IN08, MID, OUT00..OUT08, or "" where none
    kind: str            # "attn1" (self) | "attn2" (cross) | "ff" | "proj" | "resnet" | "embed" | "attn" | "mlp" | "other"
    proj: str            # "to_q", "to_out.0", "ff.net.0.proj", "proj_in", "conv1", "q", "gate", ...
    in_features: int
    out_features: int
    conv: bool = False
    kernel: int = 1      # a convolution's kernel positions (kh x kw); in_features includes them

    def params_at_rank(self, rank: int, bias: bool = False, kind: str = "lora", lokr_factor: int = -1) -> int:
        # LoRA A: in x r, B: r x out (for convs, A is the flattened kernel), plus B's bias with lora_bias;
        # DoRA adds a magnitude per output, LoHa has two such pairs.
        if kind == "lokr":
            return _lokr_params(self.out_features, self.in_features // self.kernel, self.kernel, rank, lokr_factor)
        pairs = 2 if kind == "loha" else 1
        return (pairs * rank * (self.in_features + self.out_features) + (self.out_features if bias else 0)
                + (self.out_features if kind == "dora" else 0))


def _lokr_params(out: int, inp: int, kernel: int, rank: int, factor: int) -> int:
    """peft's LoKr (decompose_both off) on an out x inp x kernel weight: W = w1 (a x c) kron w2 (b x d x kernel),
    out = a*b, inp = c*d by peft's own factorization; w2 is two rank-r factors when r < max(b, d) / 2."""
    from peft.tuners.lokr.layer import factorization

    (a, b), (c, d) = factorization(out, factor), factorization(inp, factor)
    w2 = b * d * kernel if rank >= max(b, d) / 2 else rank * (b + d * kernel)
    return a * c + w2


def lora_scale(alpha: float, rank: int, rslora: bool = False) -> float:
    """The factor peft applies to a LoRA/DoRA layer's B A: alpha / r, or rsLoRA's alpha / sqrt(r)."""
    return alpha / (math.sqrt(rank) if rslora else rank)


def layer_slot(name: str, module: nn.Module, **where) -> Slot | None:
    """A Linear or Conv2d as a slot (a conv's input width is its flattened kernel); None for other modules.
    `where` gives the slot's place (part, index, level, block, kind, proj); by default part and kind
    "other" and the module's own name as the projection."""
    if isinstance(module, nn.Linear):
        fin, fout, conv = module.in_features, module.out_features, False
    elif isinstance(module, nn.Conv2d):
        kernel = module.kernel_size[0] * module.kernel_size[1]
        fin, fout, conv = module.in_channels * kernel, module.out_channels, True
    else:
        return None
    place = {"part": "other", "index": None, "level": None, "block": "", "kind": "other",
             "proj": name.rsplit(".", 1)[-1], **where}
    return Slot(name, in_features=fin, out_features=fout, conv=conv, kernel=kernel if conv else 1, **place)


class Topology(Protocol):
    """A model family's layout, as the injector needs it: every candidate layer as a slot, and the rank
    multiplier each preset gives a slot (0 leaves it out)."""

    def slots(self, model: nn.Module) -> list[Slot]: ...
    def weight(self, slot: Slot, preset: str, deepest: int | None) -> float: ...


def unknown_preset(preset: str) -> ValueError:
    return ValueError(f"adapter.preset={preset!r}: must be one of {', '.join(PRESETS)}")


def scaled_rank(base: int, resolution: int | None, native: int | None, enabled: bool, lo: int, hi: int) -> int:
    """rank = base x sqrt(resolution / native), rounded, clamped to [lo, hi]. `native` is the model's
    own resolution (1024 for SDXL), so the rule is the docs' base x sqrt(resolution / 1024) there."""
    if not enabled or not resolution or not native:
        return base
    return max(lo, min(hi, round(base * math.sqrt(resolution / native))))


@dataclass
class Plan:
    targets: list[Slot]
    rank: dict[str, int] = field(default_factory=dict)
    alpha: dict[str, float] = field(default_factory=dict)
    bias: bool = False
    base_rank: int = 0
    resolution: int | None = None
    kind: str = "lora"        # adapter.kind
    rslora: bool = False      # adapter.rslora: scale alpha / sqrt(r) (lora, dora)
    lokr_factor: int = -1     # adapter.lokr_factor
    init: str = "default"     # adapter.init: peft's init_lora_weights (loftq: set after injection, llm/init.py)

    @property
    def trainable_params(self) -> int:
        return sum(s.params_at_rank(self.rank[s.name], self.bias, self.kind, self.lokr_factor) for s in self.targets)

    def lora_config(self, dropout: float = 0.0):
        """The peft config of the plan: LoraConfig (lora, dora), LoHaConfig or LoKrConfig, with one exact
        rank and alpha pattern per module whose rank or alpha differs from the most common one."""
        ranks = [self.rank[s.name] for s in self.targets]
        base_r = max(set(ranks), key=ranks.count)  # the most common rank: the fewest pattern entries
        base_alpha = next(self.alpha[s.name] for s in self.targets if self.rank[s.name] == base_r)
        names = [s.name for s in self.targets]
        rank_pattern = exact_patterns({n: self.rank[n] for n in names}, base_r)
        alpha_pattern = exact_patterns({n: self.alpha[n] for n in names}, base_alpha)
        return adapter_config(self.kind, base_r, base_alpha, [s.name for s in self.targets], dropout=dropout,
                              bias=self.bias, rslora=self.rslora, lokr_factor=self.lokr_factor,
                              rank_pattern=rank_pattern, alpha_pattern=alpha_pattern, init=self.init)

    def groups(self) -> list[dict]:
        """Rows for a table: slots grouped by part, level, block, kind and projection."""
        rows: dict[tuple, dict] = {}
        for s in self.targets:
            key = (s.part, s.index if s.part == "layer" else s.level, s.block if s.part != "layer" else "",
                   s.kind, s.proj, self.rank[s.name], self.alpha[s.name])
            row = rows.setdefault(key, {"part": s.part, "level": key[1], "block": key[2], "kind": s.kind,
                                        "proj": s.proj, "rank": self.rank[s.name], "alpha": self.alpha[s.name],
                                        "modules": 0, "params": 0})
            row["modules"] += 1
            row["params"] += s.params_at_rank(self.rank[s.name], self.bias, self.kind, self.lokr_factor)
        return list(rows.values())


_EVERY = object()


def exact_patterns(values: dict[str, object], default: object = _EVERY) -> dict[str, object]:
    """peft rank_pattern / alpha_pattern entries that give each module path its value: one anchored
    alternation of full paths per distinct value (modules at `default`, the config's own r or alpha, left
    out). Anchored, because peft matches a pattern by suffix, which could catch a deeper module of the same
    tail. One pattern per value, not per module, because peft tries every pattern against every module,
    twice, at every injection (benchmarks/inject_time.py)."""
    by_value: dict[object, list[str]] = {}
    for name, v in values.items():
        if default is _EVERY or v != default:
            by_value.setdefault(v, []).append(name)
    return {"^(?:" + "|".join(re.escape(n) for n in sorted(names)) + ")$": v for v, names in by_value.items()}


def adapter_config(kind: str, r: int, alpha: float, targets: list[str], *, dropout: float = 0.0, bias: bool = False,
                   rslora: bool = False, lokr_factor: int = -1, rank_pattern: dict | None = None,
                   alpha_pattern: dict | None = None, init: str = "default"):
    """peft's config for an adapter `kind` on `targets` (module paths or names): LoraConfig with use_dora for
    dora, LoHaConfig, LoKrConfig. LoHa's and LoKr's convolutions keep their update as one flattened matrix
    (use_effective_conv2d off), the shape LyCORIS files hold without a Tucker core."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    patterns = dict(rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {})
    if kind in ("lora", "dora"):
        # gaussian A (diffusers' training examples); peft allows lora_bias only with its default init.
        # pissa/olora: peft's own; loftq starts at the default and is set after injection (llm/init.py).
        start = init if init in ("pissa", "olora") else True if bias else "gaussian"
        return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, init_lora_weights=start,
                          target_modules=targets, lora_bias=bias, use_dora=kind == "dora", use_rslora=rslora,
                          **patterns)
    if kind == "loha":
        return LoHaConfig(r=r, alpha=alpha, target_modules=targets, **patterns)
    if kind == "lokr":
        # decompose_both off: the first factor stays one small full matrix (LyCORIS' default).
        return LoKrConfig(r=r, alpha=alpha, target_modules=targets, decompose_factor=lokr_factor, **patterns)
    raise ValueError(f"adapter.kind={kind!r}: must be one of {', '.join(KINDS)}")


def slot_override(s: Slot, overrides: dict[str, float]) -> float | None:
    """The value of the last glob that matches the slot's module path or its kohya block id (rank
    overrides, and train.lr_multipliers); None when none matches."""
    hit = None
    for pattern, rank in overrides.items():
        if fnmatch.fnmatchcase(s.name, pattern) or (s.block and fnmatch.fnmatchcase(s.block, pattern)):
            hit = rank
    return hit


def make_plan(model: nn.Module, cfg: AdapterConfig, topology: Topology, resolution: int | None = None,
              native: int | None = None, *, scale_with_resolution: bool = True, conv_rank: int | None = None,
              conv_alpha: float | None = None, init: str = "default") -> Plan:
    """The plan for `model` under the adapter config: the topology's slots weighted by the preset, the base
    rank scaled with `resolution` (against the model's `native` one), the overrides applied. The keywords are
    a task's own adapter settings (SDXL's adapter.scale_rank_with_resolution, conv_rank and conv_alpha; the
    causal LM's adapter.init), which the core's section does not hold."""
    all_slots = topology.slots(model)
    deepest = max((s.level for s in all_slots if s.level is not None), default=None)
    base = scaled_rank(cfg.rank, resolution, native, scale_with_resolution, cfg.min_rank, cfg.max_rank)
    scale = (cfg.alpha if cfg.alpha is not None else cfg.rank) / cfg.rank  # alpha/rank, the same on every slot
    # Convolutions (locon) at adapter.conv_rank, scaled the same way, with their own alpha/rank ratio.
    conv_rank = conv_rank or cfg.rank
    conv_base = scaled_rank(conv_rank, resolution, native, scale_with_resolution, cfg.min_rank, cfg.max_rank)
    conv_scale = conv_alpha / conv_rank if conv_alpha is not None else scale
    targets, rank, alpha = [], {}, {}
    for s in all_slots:
        w = topology.weight(s, cfg.preset, deepest)
        r = max(cfg.min_rank, round((conv_base if s.conv else base) * w)) if w > 0 else 0
        o = slot_override(s, cfg.overrides)
        if o is not None:
            r = o
        if r <= 0:
            continue
        targets.append(s)
        rank[s.name] = r
        if cfg.rslora:  # one alpha for every rank: the scale alpha / sqrt(r) is rsLoRA's rule across ranks
            alpha[s.name] = float((conv_alpha if s.conv and conv_alpha else cfg.alpha) or cfg.rank)
        else:
            alpha[s.name] = float(r * (conv_scale if s.conv else scale))
    if not targets:
        raise ValueError(f"adapter.preset={cfg.preset!r} with adapter.overrides={cfg.overrides} selects no layer "
                         f"of {type(model).__name__}")
    return Plan(targets, rank, alpha, cfg.lora_bias, base, resolution, kind=cfg.kind, rslora=cfg.rslora,
                lokr_factor=-1 if cfg.lokr_factor is None else cfg.lokr_factor, init=init)


def budget_plan(plan: Plan, sensitivity: dict[str, float], budget: int, lo: int, hi: int) -> Plan:
    """Redistribute ranks to fit `budget` trainable parameters: each slot's rank is proportional to its
    planned rank times its measured sensitivity (normalised to mean 1), rounded and clamped to
    [lo, hi]; the common factor is the largest that fits, found by bisection. Deterministic."""
    mean = sum(sensitivity[s.name] for s in plan.targets) / len(plan.targets)
    weight = {s.name: plan.rank[s.name] * (sensitivity[s.name] / mean if mean > 0 else 1.0) for s in plan.targets}

    def ranks(c: float) -> dict[str, int]:
        return {n: max(lo, min(hi, round(c * w))) for n, w in weight.items()}

    def cost(r: dict[str, int]) -> int:
        return sum(s.params_at_rank(r[s.name], plan.bias, plan.kind) for s in plan.targets)

    floor = cost(ranks(0.0))
    if floor > budget:
        raise ValueError(f"adapter.rank_budget={budget:,} parameters is below what these {len(plan.targets)} "
                         f"modules need at min_rank={lo} ({floor:,}); raise the budget or pick fewer slots")
    a, b = 0.0, 1.0
    while cost(ranks(b)) <= budget and b < 1e6:
        a, b = b, b * 2
    for _ in range(60):
        mid = (a + b) / 2
        a, b = (mid, b) if cost(ranks(mid)) <= budget else (a, mid)
    chosen = ranks(a)
    if plan.rslora:  # alpha stays: rsLoRA's scale alpha / sqrt(r) follows the rank by itself
        return dataclasses.replace(plan, rank=chosen)
    scale = {n: plan.alpha[n] / plan.rank[n] for n in plan.rank}
    return dataclasses.replace(plan, rank=chosen, alpha={n: float(chosen[n] * scale[n]) for n in chosen})


def apply_plan(model: nn.Module, plan: Plan, dropout: float = 0.0, adapter_name: str = "default") -> None:
    """Freeze the model and add the planned LoRA layers (through diffusers' peft integration when the
    model has it, so diffusers' own save/load helpers understand the result)."""
    model.requires_grad_(False)
    lcfg = plan.lora_config(dropout)
    # Only diffusers' integration: transformers' add_adapter pins its own peft versions; peft's
    # inject_adapter_in_model does the same for a causal LM and leaves model.peft_config for saving.
    if _diffusers_model(model):
        model.add_adapter(lcfg, adapter_name=adapter_name)
    else:
        from peft import inject_adapter_in_model
        inject_adapter_in_model(lcfg, model, adapter_name=adapter_name)
    # Adapters train in fp32 whatever the base's dtype: bf16 LoRA weights lose small updates.
    for n, p in model.named_parameters():
        if is_adapter_param(n):
            p.data = p.data.float()
            p.requires_grad_(True)


def adapters_take_autocast_inputs(model: nn.Module) -> int:
    """Stop peft's adapter layers casting their input to their fp32 weights' dtype, for a model whose every
    forward runs under autocast: there the cast is a copy per layer that autocast casts back for the matmul,
    and that copy is what the layer keeps for its backward, so q, k and v each keep a copy of one input
    (benchmarks/llm_layer_memory.py). Autocast casts the weights instead; the same products. Returns how many.
    Not peft.helpers.disable_input_dtype_casting: it holds for a with-block only, and a checkpointed layer is
    recomputed in the backward, outside it (with other saved tensors, which checkpointing refuses)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.cast_input_dtype_enabled = False
    return len(layers)


def scheduled_ranks(plan: Plan, original: Plan, target_base: int, lo: int) -> dict[str, int]:
    """Each slot's rank when the base rank shrinks to `target_base`: its rank in the original plan times
    target_base / original base, rounded, at least `lo`, and never above its current rank."""
    ratio = target_base / original.base_rank
    return {n: min(plan.rank[n], max(lo, round(r * ratio))) for n, r in original.rank.items()}


@torch.no_grad()
def shrink_adapters(model: nn.Module, plan: Plan, new_rank: dict[str, int], adapter_name: str = "default",
                    dropout: float = 0.0) -> Plan:
    """Truncate each LoRA layer to its new rank by SVD of its product up @ down: the best rank-r
    approximation of the update it makes. The scale alpha/rank stays the same (alpha shrinks with the
    rank), so the layer's output changes only by the discarded singular values. The new factors share
    the singular values evenly (sqrt each). Returns the plan with the new ranks and alphas; peft's config
    on the model is updated to match, so exports carry the final ranks."""
    modules = dict(model.named_modules())
    rank, alpha = dict(plan.rank), dict(plan.alpha)
    for slot in plan.targets:
        r_new = new_rank.get(slot.name, plan.rank[slot.name])
        layer = modules[slot.name]
        down, up = layer.lora_A[adapter_name], layer.lora_B[adapter_name]
        r_old = down.weight.shape[0]
        if r_new >= r_old:
            continue
        a = down.weight.float().reshape(r_old, -1)       # [r, in * kh * kw]
        b = up.weight.float().reshape(up.weight.shape[0], r_old)  # [out, r]
        u, sv, vh = torch.linalg.svd(b @ a, full_matrices=False)
        root = sv[:r_new].sqrt()
        new_up = (u[:, :r_new] * root).reshape(up.weight.shape[0], r_new, *up.weight.shape[2:])
        new_down = (root[:, None] * vh[:r_new]).reshape(r_new, *down.weight.shape[1:])
        layer.lora_A[adapter_name] = _resized(down, out_features=r_new, weight=new_down)
        layer.lora_B[adapter_name] = _resized(up, in_features=r_new, weight=new_up)
        # The layer's scaling stays: alpha follows the rank (rsLoRA: its square root) so alpha's rule gives it.
        scale = layer.scaling[adapter_name]
        new_alpha = float(scale * (math.sqrt(r_new) if plan.rslora else r_new))
        layer.r[adapter_name] = r_new
        layer.lora_alpha[adapter_name] = new_alpha
        rank[slot.name], alpha[slot.name] = r_new, new_alpha
    shrunk = dataclasses.replace(plan, rank=rank, alpha=alpha)
    if adapter_name in (getattr(model, "peft_config", None) or {}):
        model.peft_config[adapter_name] = shrunk.lora_config(dropout)
    return shrunk


def _resized(old: nn.Module, *, weight: torch.Tensor, in_features: int | None = None,
             out_features: int | None = None) -> nn.Module:
    """A copy of a LoRA factor (Linear or Conv) with one side resized, holding `weight`, trainable, fp32."""
    if isinstance(old, nn.Linear):
        new = nn.Linear(in_features or old.in_features, out_features or old.out_features, bias=old.bias is not None)
    else:
        new = type(old)(in_features or old.in_channels, out_features or old.out_channels, old.kernel_size,
                        stride=old.stride, padding=old.padding, bias=old.bias is not None)
    new = new.to(device=old.weight.device, dtype=torch.float32)
    new.weight.copy_(weight)
    if old.bias is not None:
        new.bias.copy_(old.bias)
    new.requires_grad_(old.weight.requires_grad)
    return new


def trainable_parameters(model: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def format_plan(plan: Plan) -> str:
    """The plan as a table, with totals; sizes are of the fp32 adapter file."""
    head = f"{'part':5} {'lvl':>3} {'block':6} {'kind':6} {'proj':14} {'mods':>5} {'rank':>5} {'alpha':>6} {'params':>12} {'MB':>8}"
    lines = [head, "-" * len(head)]
    for r in plan.groups():
        lvl = "" if r["level"] is None else str(r["level"])
        lines.append(f"{r['part']:5} {lvl:>3} {r['block']:6} {r['kind']:6} {r['proj']:14} {r['modules']:>5} "
                     f"{r['rank']:>5} {r['alpha']:>6g} {r['params']:>12,} {r['params'] * 4 / 2**20:>8.2f}")
    lines.append("-" * len(head))
    lines.append(f"total: {plan_summary(plan)}")
    return "\n".join(lines)


def plan_summary(plan: Plan) -> str:
    """The plan in one line: modules, kind, trainable parameters, the fp32 file's size, the base rank."""
    n = plan.trainable_params
    kind = f"{plan.kind}{' (rsLoRA)' if plan.rslora else ''}"
    return (f"{len(plan.targets)} modules of {kind}, {n:,} trainable parameters, {n * 4 / 2**20:.2f} MB (fp32)"
            + (f"; base rank {plan.base_rank} at resolution {plan.resolution}" if plan.resolution else ""))


def rank_budget(cfg: AdapterConfig) -> int | None:
    """adapter.rank_budget in trainable parameters (adapter.rank_budget_mb converted: fp32 bytes), or None."""
    if cfg.rank_budget:
        return cfg.rank_budget
    return round(cfg.rank_budget_mb * 2**20 / 4) if cfg.rank_budget_mb else None


def calibrate(model: nn.Module, plan: Plan, batches: Callable[[], Iterator], loss: Callable[[object], torch.Tensor],
              n_batches: int, devices: list, seed: int | None = None, show: bool = True) -> dict[str, float]:
    """Sensitivity of each planned slot: the norm of a throwaway rank-4 adapter's gradient on that slot,
    summed over `n_batches` batches (from `batches()`, started again when it runs out), `loss(batch)` each.
    The RNG is forked (and seeded with `seed`), so the run after it is the same as without it; the probe
    is removed and the model left frozen."""
    probe = Plan(plan.targets, {s.name: 4 for s in plan.targets}, {s.name: 4.0 for s in plan.targets})
    apply_plan(model, probe, adapter_name="calibration")
    modules = dict(model.named_modules())
    weights = [modules[s.name].lora_B["calibration"].weight for s in plan.targets]
    norms = {s.name: 0.0 for s in plan.targets}
    with torch.random.fork_rng(devices=devices):
        if seed is not None:
            torch.manual_seed(seed)
        it = batches()
        for _ in tqdm(range(n_batches), desc="calibrating ranks", unit="batch", disable=not show):
            try:
                batch = next(it)
            except StopIteration:
                it = batches()
                batch = next(it)
            grads = torch.autograd.grad(loss(batch), weights)
            for name, g in zip(norms, grads):
                norms[name] += g.float().norm().item()
    remove_adapter(model, "calibration")
    model.requires_grad_(False)
    return norms


def _diffusers_model(model: nn.Module) -> bool:
    # diffusers' models carry peft's integration (add_adapter/delete_adapters); transformers' pin their own
    # peft versions, so causal LMs go through peft's functions directly.
    return hasattr(model, "add_adapter") and type(model).__module__.startswith("diffusers")


def remove_adapter(model: nn.Module, adapter_name: str) -> None:
    """Take the named adapter's layers out of the model (and its entry out of peft_config)."""
    if _diffusers_model(model):
        model.delete_adapters(adapter_name)
        return
    from peft.functional import delete_adapter

    delete_adapter(model, adapter_name, prefix="lora_")
    configs = getattr(model, "peft_config", None)
    if configs is not None:
        configs.pop(adapter_name, None)
        if not configs:
            del model.peft_config


def _room_for_copies(device: torch.device, need: float = 0.0) -> float:
    """Bytes of copies for inference the GPU's free memory holds with room to spare (0.8 of it), within a share
    capped by torch.cuda.set_per_process_memory_fraction (train.vram_gb, a card's budget); unbounded off a GPU (the
    host's memory is not checked). Where that is less than `need`, torch's cache of blocks it holds unused is handed
    back first: mid-run it holds about the training step's peak, which the copies may take."""
    if device.type != "cuda":
        return math.inf

    def room() -> float:
        free, total = torch.cuda.mem_get_info(device)
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(device)
        if fraction < 1.0:  # a capped share: what the allocator may still reserve under its cap
            free = min(free, fraction * total - torch.cuda.memory_reserved(device))
        return max(0.0, free * 0.8)

    if room() < need:
        torch.cuda.empty_cache()
    return room()


def _copies_fit(need: int, device: torch.device) -> bool:
    """Whether `need` bytes of copies for inference fit in the GPU's free memory, with room to spare."""
    return need <= _room_for_copies(device, need)


def dequantized_bytes(model: nn.Module) -> int:
    """What dequantized_for_inference holds: every quantized layer's weight in its compute dtype."""
    from .quantize import quantized_classes

    def size(mod) -> int:
        dtype = getattr(mod, "compute_dtype", None) or torch.float32
        shape = (mod.out_channels, mod.in_channels // mod.groups, *mod.kernel_size) if isinstance(mod, nn.Conv2d) \
            else (mod.out_features, mod.in_features)
        return math.prod(shape) * torch.empty((), dtype=dtype).element_size()

    return sum(size(m) for m in model.modules() if isinstance(m, quantized_classes()))


@contextlib.contextmanager
def dequantized_for_inference(model: nn.Module, budget: int | None = None):
    """For the duration of a no-grad use (previews), each quantized layer of the frozen base (model.quantize,
    quantize_convs) replaced by a plain Linear or Conv2d holding its weight dequantized to the compute dtype, with
    a plain LoRA on it folded in: the model runs as a 16-bit one with its adapter merged, one product a layer,
    where a quantized layer dequantizes its weight at every call and its adapter adds products and Python calls
    of its own. The quantized weights stay as they are (training resumes on exactly them), and the same modules
    are put back afterwards. DoRA keeps its path (its merge rescales by the weight's norm), and so do adapters
    with a bias. The copies cost the dequantized weights' memory (dequantized_bytes): at most `budget` bytes of them
    (None: no limit but the device's) and no more than the device's free memory holds, the smallest layers first up
    to the first that does not fit: a replaced layer saves a dequantization and its adapter's own products and
    Python calls at every call whatever its size, so the small ones save the most per byte. Yields how many layers
    are replaced."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    from .quantize import dequantize_weight, plain_layer, quantized_classes

    classes = quantized_classes()
    swaps = []  # (parent, name, module in the model, its quantized layer, the adapters folded in)
    for parent in model.modules():
        if isinstance(parent, BaseTunerLayer):
            continue  # a LoRA layer's own base layer: replaced with the LoRA layer, below
        for name, child in parent._modules.items():
            if isinstance(child, classes):
                swaps.append((parent, name, child, child, []))
            elif isinstance(child, LoraLayer) and isinstance(child.get_base_layer(), classes) and not child.merged:
                active = [] if child.disable_adapters else [a for a in child.active_adapters if a in child.lora_A]
                if any(child.use_dora.get(a, False) or child.lora_bias.get(a, False) for a in active):
                    continue
                swaps.append((parent, name, child, child.get_base_layer(), active))
    # Ties in the model's order: an attention's projections together.
    order = {id(m): i for i, m in enumerate(model.modules())}
    sized = sorted(((dequantized_bytes(s[3]), s) for s in swaps), key=lambda t: (t[0], order[id(t[1][2])]))
    want = sum(size for size, _ in sized) if budget is None else min(budget, sum(size for size, _ in sized))
    room = min(want, _room_for_copies(swaps[0][3].weight.device, want)) if swaps else 0
    chosen, held = [], 0
    for size, swap in sized:
        held += size
        if held > room:
            break
        chosen.append(swap)
    done = []
    try:
        with torch.no_grad():
            for parent, name, child, layer, adapters in chosen:
                weight = dequantize_weight(layer)
                for adapter in adapters:
                    weight += child.get_delta_weight(adapter).float()
                parent._modules[name] = plain_layer(layer, weight)
                done.append((parent, name, child))
        yield len(done)
    finally:
        for parent, name, child in reversed(done):
            parent._modules[name] = child


@contextlib.contextmanager
def merged_for_inference(model: nn.Module, unwrap: bool = False):
    """The adapters folded into copies of their frozen base weights for the duration of a no-grad use (previews):
    each adapted layer then runs one product, as ComfyUI and AUTOMATIC1111 run a LoRA, instead of the base's and
    the adapter's with a Python call per layer, which costs about as much as the base's whole forward at full
    size (benchmarks/RESULTS.md#previews-and-evaluation). peft merges (each kind its own way, DoRA's rescaling
    included) into a copy; the layer's own weight tensor is put back afterwards untouched, so training resumes on
    exactly the weights it had. Layers over quantized weights keep their adapter path (a 4-bit merge is lossy). Where the copies do not
    fit in the device's free memory nothing is merged. Yields how many layers are merged.

    unwrap: each merged layer also leaves the model for the duration, its base layer (holding the merged copy) in
    its place, so the model runs as the bare one with no adapter code at all: peft's forward of a merged layer
    still costs a Python call or more per layer and UNet call. The same modules are put back afterwards. Whatever
    else reads the adapted layers (a fused attention processor) must not run meanwhile."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = []
    for layer in model.modules():
        if not isinstance(layer, BaseTunerLayer) or layer.merged or layer.disable_adapters or not layer.active_adapters:
            continue
        base = layer.get_base_layer()
        if type(base) in (nn.Linear, nn.Conv2d) and base.weight.is_floating_point():
            layers.append((layer, base))
    if layers and not _copies_fit(sum(base.weight.numel() * base.weight.element_size() for _, base in layers),
                                  layers[0][1].weight.device):
        layers = []
    swapped, unwrapped = [], []
    try:
        with torch.no_grad():
            for layer, base in layers:
                kept = {name: getattr(base, name).data for name in ("weight", "bias") if getattr(base, name) is not None}
                for name, tensor in kept.items():
                    getattr(base, name).data = tensor.clone()
                swapped.append((layer, base, kept))
                layer.merge()
        if unwrap:
            merged = {id(layer) for layer, _, _ in swapped}
            for parent in list(model.modules()):
                for name, child in parent._modules.items():
                    if id(child) in merged:
                        unwrapped.append((parent, name, child))
            for parent, name, child in unwrapped:
                parent._modules[name] = child.get_base_layer()
        yield len(swapped)
    finally:
        for parent, name, child in reversed(unwrapped):
            parent._modules[name] = child
        with torch.no_grad():
            for layer, base, kept in reversed(swapped):
                if layer.merged:
                    layer.unmerge()  # peft's bookkeeping (merged_adapters, DoRA's cached norms), on the copy
                for name, tensor in kept.items():
                    getattr(base, name).data = tensor

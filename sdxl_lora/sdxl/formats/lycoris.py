"""LoHa and LoKr layers in memory, in the LyCORIS file format (what ComfyUI, AUTOMATIC1111/Forge and kohya load),
and back into peft's layers.

Each layer holds its factors as a LyCORIS file stores them, with the loaders' weight rule (ComfyUI
comfy/weight_adapter/loha.py and lokr.py, A1111 extensions-builtin/Lora/network_hada.py and network_lokr.py):

  loha  `hada_w1_a` (out, r), `hada_w1_b` (r, in[*kh*kw]), `hada_w2_a`, `hada_w2_b`, `alpha`:
        delta = (w1_a @ w1_b) * (w2_a @ w2_b) * alpha / r, reshaped to the weight
  lokr  `lokr_w1` (a, c) or `lokr_w1_a`/`lokr_w1_b`; `lokr_w2` (b, d[, kh, kw]) or `lokr_w2_a` (b, r) /
        `lokr_w2_b` (r, d[*kh*kw]); `alpha`: delta = kron(w1, w2) * alpha / r, reshaped to the weight, where
        r is the rank of a factored w1 or w2; with neither factored the loaders take the scale as 1, so a
        trained layer's alpha / r is folded into w1 before it is written.

peft trains the same layers (its LoHa and LoKr tuners follow LyCORIS, use_effective_conv2d off: a
convolution's update is one flattened matrix, no Tucker core), so writing is a copy of its tensors, with each
layer's alpha / r folded into its factors (`at_unit_scale`): LyCORIS' merge path applies alpha / r twice, so only
a file with alpha = r merges right there, and every other loader applies the same update either way.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

LOHA_KEYS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
LOKR_KEYS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
# Parts of LyCORIS files these layers do not hold (Tucker cores): a file with them is refused by name.
TUCKER_KEYS = ("hada_t1", "hada_t2", "lokr_t2")


@dataclass
class LohaLayer:
    w1_a: torch.Tensor
    w1_b: torch.Tensor
    w2_a: torch.Tensor
    w2_b: torch.Tensor
    alpha: float
    shape: tuple[int, ...]          # the adapted weight's shape
    kind: str = field(default="loha", init=False)
    magnitude = None                # no DoRA on these kinds
    bias = None

    @property
    def rank(self) -> int:
        return int(self.w1_b.shape[0])

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def update_shape(self) -> tuple[int, ...]:
        return tuple(self.shape)

    def update_numel(self) -> int:
        return int(self.w1_a.shape[0] * self.w1_b.shape[1])

    def delta(self) -> torch.Tensor:
        w = (self.w1_a.float() @ self.w1_b.float()) * (self.w2_a.float() @ self.w2_b.float())
        return (w * self.scale).reshape(self.shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(zip(LOHA_KEYS, (self.w1_a, self.w1_b, self.w2_a, self.w2_b)))

    def scaled(self, factor: float) -> "LohaLayer":
        """The layer whose update is `factor` times this one's: its alpha scaled (the loaders scale by alpha / r)."""
        return dataclasses.replace(self, alpha=self.alpha * factor)

    def at_unit_scale(self) -> "LohaLayer":
        """The same update with alpha = rank: the square root of alpha / rank folded into each half of the
        Hadamard product. Every loader then scales by 1, LyCORIS' merge too (it applies alpha / rank twice)."""
        if self.alpha == self.rank:
            return self
        s = math.sqrt(self.scale)
        return dataclasses.replace(self, w1_a=self.w1_a.float() * s, w2_a=self.w2_a.float() * s, alpha=float(self.rank))

    def finite(self) -> bool:
        return all(torch.isfinite(t).all() for t in self.tensors().values())


@dataclass
class LokrLayer:
    w1: torch.Tensor | None
    w1_a: torch.Tensor | None
    w1_b: torch.Tensor | None
    w2: torch.Tensor | None
    w2_a: torch.Tensor | None
    w2_b: torch.Tensor | None
    alpha: float
    shape: tuple[int, ...]
    kind: str = field(default="lokr", init=False)
    magnitude = None
    bias = None

    @property
    def rank(self) -> int | None:
        """The rank of the factored part (w2's, else w1's), as the loaders read it; None when neither is factored."""
        for t in (self.w2_b, self.w1_b):
            if t is not None:
                return int(t.shape[0])
        return None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 1.0

    @property
    def update_shape(self) -> tuple[int, ...]:
        return tuple(self.shape)

    def update_numel(self) -> int:
        def n(w, a, b):
            return w.numel() if w is not None else a.shape[0] * b.shape[1]
        return int(n(self.w1, self.w1_a, self.w1_b) * n(self.w2, self.w2_a, self.w2_b))

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        w1 = self.w1.float() if self.w1 is not None else self.w1_a.float() @ self.w1_b.float()
        w2 = self.w2.float() if self.w2 is not None else self.w2_a.float() @ self.w2_b.float()
        return w1, w2

    def delta(self) -> torch.Tensor:
        w1, w2 = self.factors()
        if w2.dim() == 4:
            w1 = w1[:, :, None, None]
        return (torch.kron(w1, w2) * self.scale).reshape(self.shape)

    def scaled(self, factor: float) -> "LokrLayer":
        """The layer whose update is `factor` times this one's: its alpha scaled where a factored part gives the
        loaders a rank to scale by, else its first factor (they take an unfactored layer's scale as 1)."""
        if self.rank:
            return dataclasses.replace(self, alpha=self.alpha * factor)
        return dataclasses.replace(self, w1=self.w1 * factor)

    def at_unit_scale(self) -> "LokrLayer":
        """The same update with alpha = rank: alpha / rank folded into the first factor (w1, or w1_a where it is
        split). Every loader then scales by 1, LyCORIS' merge too (it applies alpha / rank twice where w2 is split);
        a layer with no factored part already has scale 1."""
        if not self.rank or self.alpha == self.rank:
            return self
        if self.w1 is not None:
            return dataclasses.replace(self, w1=self.w1.float() * self.scale, alpha=float(self.rank))
        return dataclasses.replace(self, w1_a=self.w1_a.float() * self.scale, alpha=float(self.rank))

    def tensors(self) -> dict[str, torch.Tensor]:
        parts = (self.w1, self.w1_a, self.w1_b, self.w2, self.w2_a, self.w2_b)
        return {k: t for k, t in zip(LOKR_KEYS, parts) if t is not None}

    def finite(self) -> bool:
        return all(torch.isfinite(t).all() for t in self.tensors().values())


def from_peft(mod: torch.nn.Module, adapter_name: str = "default") -> LohaLayer | LokrLayer | None:
    """The LoHa/LoKr layer peft put in `mod` (detached), None when it holds neither."""
    from peft.tuners.loha import LoHaLayer as PeftLoha
    from peft.tuners.lokr import LoKrLayer as PeftLokr

    if not isinstance(mod, (PeftLoha, PeftLokr)):
        return None
    shape = tuple(mod.get_base_layer().weight.shape)
    if isinstance(mod, PeftLoha) and adapter_name in mod.hada_w1_a:
        if adapter_name in mod.hada_t1:
            raise ValueError("LoHa with a Tucker core (use_effective_conv2d) has no file form here")
        w = [getattr(mod, k)[adapter_name].detach() for k in LOHA_KEYS]
        return LohaLayer(*w, alpha=float(mod.alpha[adapter_name]), shape=shape)
    if isinstance(mod, PeftLokr) and adapter_name in mod._available_adapters:
        if adapter_name in mod.lokr_t2:
            raise ValueError("LoKr with a Tucker core (use_effective_conv2d) has no file form here")
        w = {k: getattr(mod, k)[adapter_name].detach() if adapter_name in getattr(mod, k) else None
             for k in LOKR_KEYS}
        layer = LokrLayer(**{k.removeprefix("lokr_"): v for k, v in w.items()}, alpha=float(mod.alpha[adapter_name]),
                          shape=shape)
        if layer.rank is None:  # neither factored: the loaders scale by 1, so peft's alpha / r goes into w1
            layer.w1 = layer.w1.float() * mod.scaling[adapter_name]
            layer.alpha = float(mod.r[adapter_name])
        return layer
    return None


def from_keys(parts: dict[str, torch.Tensor], alpha: float | None, shape: tuple[int, ...] | None):
    """A layer from one module's LyCORIS tensors (suffix -> tensor, e.g. "hada_w1_a"); `shape` is the adapted
    weight's (None: the update's own 2-D shape). Without an alpha the loaders take alpha = rank (scale 1)."""
    if any(k in parts for k in TUCKER_KEYS):
        raise ValueError(f"a Tucker core ({', '.join(k for k in TUCKER_KEYS if k in parts)}) is not read")
    if "hada_w1_a" in parts:
        if missing := [k for k in LOHA_KEYS if k not in parts]:
            raise ValueError(f"a LoHa layer without {', '.join(missing)}")
        w = [parts[k] for k in LOHA_KEYS]
        shape = shape or (w[0].shape[0], w[1].shape[1])
        return LohaLayer(*w, alpha=float(alpha if alpha is not None else w[1].shape[0]), shape=tuple(shape))
    w = {k.removeprefix("lokr_"): parts.get(k) for k in LOKR_KEYS}
    layer = LokrLayer(**w, alpha=0.0, shape=())
    if (layer.w1 is None and layer.w1_a is None) or (layer.w2 is None and layer.w2_a is None):
        raise ValueError("a LoKr layer needs lokr_w1 (or lokr_w1_a/_b) and lokr_w2 (or lokr_w2_a/_b)")
    layer.alpha = float(alpha if alpha is not None else (layer.rank or 1))
    if shape is None:
        w1, w2 = layer.factors()
        shape = (w1.shape[0] * w2.shape[0], w1.shape[1] * w2[0].numel())
    layer.shape = tuple(shape)
    return layer


def peft_config(kind: str, layers: dict[str, LohaLayer | LokrLayer]):
    """A peft LoHaConfig/LoKrConfig that recreates these layers' shapes (module paths as exact patterns), with
    each layer's r and alpha; raises ValueError where peft's layers cannot hold one."""
    from peft import LoHaConfig, LoKrConfig

    from ...core.inject import exact_patterns

    if kind == "loha":
        return LoHaConfig(r=1, alpha=1.0, target_modules=sorted(layers),
                          rank_pattern=exact_patterns({m: lay.rank for m, lay in layers.items()}),
                          alpha_pattern=exact_patterns({m: lay.alpha for m, lay in layers.items()}))
    factor = _lokr_factor(layers)
    ranks, alphas = {}, {}
    for m, lay in layers.items():
        if lay.w1 is None:
            raise ValueError(f"{m}: a factored lokr_w1 (decompose_both) is not rebuilt here")
        w2 = lay.w2 if lay.w2 is not None else lay.w2_a
        b, d = w2.shape[0], (lay.w2.shape[1] if lay.w2 is not None else lay.w2_b.shape[1] // _kernel(lay.shape))
        if lay.rank is None:  # peft keeps w2 whole from r >= max(b, d) / 2; the scale is 1 (folded, see from_peft)
            ranks[m], alphas[m] = max(b, d), float(max(b, d))
        elif lay.rank < max(b, d) / 2:
            ranks[m], alphas[m] = lay.rank, lay.alpha
        else:
            raise ValueError(f"{m}: lokr_w2 is factored at rank {lay.rank}, where peft keeps it whole")
    return LoKrConfig(r=1, alpha=1.0, target_modules=sorted(layers), decompose_factor=factor,
                      rank_pattern=exact_patterns(ranks), alpha_pattern=exact_patterns(alphas))


def _kernel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape[2:]).numel()) if len(shape) > 2 else 1


def _lokr_factor(layers: dict[str, LokrLayer]) -> int:
    """The decompose_factor under which peft factors every layer's dimensions as the file's w1 does."""
    from peft.tuners.lokr.layer import factorization

    candidates = [-1] + sorted({int(s) for lay in layers.values() for s in lay.w1.shape})
    for f in candidates:
        if all(factorization(lay.shape[0], f)[0] == lay.w1.shape[0]
               and factorization(lay.shape[1], f)[0] == lay.w1.shape[1] for lay in layers.values()):
            return f
    raise ValueError("the LoKr layers' factor shapes come from no single decompose_factor peft knows")


@torch.no_grad()
def load_into(mod: torch.nn.Module, layer: LohaLayer | LokrLayer, adapter_name: str = "default") -> None:
    """Copy a layer's factors into the peft layer `mod` made from `peft_config` (shapes checked)."""
    for key, value in layer.tensors().items():
        target = getattr(mod, key)[adapter_name]
        if target.shape != value.shape:
            raise ValueError(f"{key} has shape {list(value.shape)}, the layer expects {list(target.shape)}")
        target.copy_(value)

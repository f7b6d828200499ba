"""Resize a trained adapter's ranks: each layer's update is factored again by SVD and cut to a smaller rank.

A fixed rank, or per layer the fewest singular values that keep a given share of its update (the dynamic
methods kohya's resize script offers: `sv_fro`, `sv_cumulative`, `sv_ratio`, with the meanings users know).
The result is plain LoRA in every layer: LoHa and LoKr layers come out as LoRA too, so a loader that reads
LoRA only can load them. DoRA layers keep their magnitudes (the direction's update is what is cut). The
file is smaller, and the update it applies is the closest one of that rank (Eckart-Young).

Several adapters, each at a strength, resize into one (kohya_ss's "merge LoRA" with a new rank): each layer's
update is the strengths' weighted sum of theirs, cut the same way, so one file applies the blend."""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass

import torch

from .export import Adapter, AdapterError, AnyLayer, LoraLayer

METHODS = ("sv_fro", "sv_cumulative", "sv_ratio")


@dataclass
class LayerResize:
    name: str
    rank_before: int  # the update's rank (a LoHa/LoKr layer's can exceed its factors' rank)
    rank_after: int
    kept: float  # share of the update's Frobenius norm the new rank keeps (1.0: all of it)


@dataclass
class Resized:
    adapter: Adapter
    layers: list[LayerResize]

    def summary(self) -> str:
        """One paragraph for the CLI: ranks before and after, what share of the updates was kept, the worst layer."""
        before = sorted(r.rank_before for r in self.layers)
        after = sorted(r.rank_after for r in self.layers)
        worst = min(self.layers, key=lambda r: r.kept)
        span = (lambda v: str(v[0]) if v[0] == v[-1] else f"{v[0]}-{v[-1]} (median {statistics.median(v):g})")
        return (f"{len(self.layers)} layers: update rank {span(before)} -> {span(after)}; kept "
                f"{100 * statistics.fmean(r.kept for r in self.layers):.1f}% of each update's Frobenius norm on "
                f"average, the least {100 * worst.kept:.1f}% ({worst.name})")


def _factors(layer: AnyLayer, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """U, S, Vh of the layer's update flattened to (out, in * kernel), in fp32 on `device`.

    A LoRA update up @ down has rank at most r, so it is factored through QR of each side and the SVD of an
    r x r core: exact, and far cheaper than an SVD of the full (out, in) matrix. LoHa/LoKr updates can be of
    any rank, so those take the full SVD."""
    if isinstance(layer, LoraLayer):
        up = layer.up.float().to(device).flatten(1)                   # (out, r)
        down = layer.down.float().to(device).flatten(1)               # (r, in * k)
        qu, ru = torch.linalg.qr(up)
        qd, rd = torch.linalg.qr(down.T)
        u, s, vh = torch.linalg.svd(ru @ rd.T * layer.scale)
        return qu @ u, s, vh @ qd.T
    delta = layer.delta().float().to(device)
    return torch.linalg.svd(delta.flatten(1), full_matrices=False)


def _nonzero(s: torch.Tensor, dims: tuple[int, ...]) -> int:
    """The rank of an update of shape `dims` with singular values `s` (descending): those above fp32 rounding of
    the largest (torch.linalg.matrix_rank's tolerance, max(dims) x eps x the largest)."""
    if not s.numel() or s[0] <= 0:
        return 0
    return int((s > s[0] * max(dims) * torch.finfo(torch.float32).eps).sum())


def new_rank(s: torch.Tensor, rank: int, method: str | None = None, param: float | None = None,
             dims: tuple[int, ...] = (1,)) -> int:
    """How many of the singular values `s` (descending) to keep: at most `rank`, and with a method the fewest
    that keep `param` of the Frobenius norm (sv_fro), of the singular values' sum (sv_cumulative), or all
    within a factor `param` of the largest (sv_ratio). `dims`, the update's (out, in), sets the rounding
    tolerance below which a singular value counts as zero. An update of zeros keeps one."""
    s = s.double()
    nonzero = _nonzero(s, dims)
    keep = min(rank, nonzero)
    if method is not None and nonzero:
        if method == "sv_fro":
            share = (s.square().cumsum(0) / s.square().sum()).sqrt()
            need = int(torch.searchsorted(share, torch.tensor(param, dtype=share.dtype) - 1e-12)) + 1
        elif method == "sv_cumulative":
            share = s.cumsum(0) / s.sum()
            need = int(torch.searchsorted(share, torch.tensor(param, dtype=share.dtype) - 1e-12)) + 1
        elif method == "sv_ratio":
            need = int((s >= s[0] / param).sum())
        else:
            raise AdapterError(f"dynamic method {method!r}: must be one of {', '.join(METHODS)}")
        keep = min(keep, need)
    return max(1, keep)


def truncated(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor, shape: tuple[int, ...], rank: int,
              method: str | None = None, param: float | None = None,
              dtype: torch.dtype = torch.float32) -> tuple[LoraLayer, LayerResize]:
    """A LoRA layer (alpha = rank, scale 1) for the update U diag(S) Vh of a weight of `shape`, cut to the rank
    `new_rank` chooses, and what the cut did (LayerResize, unnamed). The singular values are split evenly between
    up and down (each gets their square root); convolutions get down (k, in, kh, kw) and a 1x1 up."""
    dims = (shape[0], math.prod(shape[1:]))
    k = new_rank(s, rank, method, param, dims)
    total = float(s.square().sum())
    kept = 1.0 if total == 0 else float(s[:k].square().sum() / total) ** 0.5
    root = s[:k].sqrt()
    up = (u[:, :k] * root).to("cpu", dtype)
    down = (root[:, None] * vh[:k]).to("cpu", dtype).reshape(k, *shape[1:])
    if len(shape) == 4:
        up = up.reshape(shape[0], k, 1, 1)
    row = LayerResize("", _nonzero(s, dims), k, kept)
    return LoraLayer(down=down.contiguous(), up=up.contiguous(), alpha=float(k)), row


def resize_layer(layer: AnyLayer, rank: int, method: str | None = None, param: float | None = None,
                 device: str | torch.device = "cpu") -> tuple[LoraLayer, LayerResize]:
    """The layer as LoRA at the new rank (see `truncated`), the weights in the dtype they had, a DoRA layer's
    magnitude and a LoRA-Bias layer's bias kept."""
    u, s, vh = _factors(layer, torch.device(device))
    out, row = truncated(u, s, vh, layer.update_shape, rank, method, param, _dtype(layer))
    bias = None if layer.bias is None else layer.bias * layer.scale  # scale 1 from here on
    return dataclasses.replace(out, magnitude=layer.magnitude, bias=bias), row


def check_method(method: str | None, param: float | None) -> None:
    """A dynamic method's name and parameter, refused with what to give instead."""
    if method is None:
        return
    if method not in METHODS:
        raise AdapterError(f"dynamic method {method!r}: must be one of {', '.join(METHODS)}")
    if param is None:
        raise AdapterError(f"dynamic method {method}: give its parameter (--dynamic-param)")
    if method in ("sv_fro", "sv_cumulative") and not 0 < param <= 1:
        raise AdapterError(f"{method} keeps a share of the update: its parameter must be in (0, 1], not {param}")
    if method == "sv_ratio" and param < 1:
        raise AdapterError(f"sv_ratio keeps singular values within a factor of the largest: its parameter "
                           f"must be 1 or more, not {param}")


def provenance(source: str, rank: int, method: str | None = None, param: float | None = None) -> dict[str, str]:
    """The metadata a resized file carries: what it was resized from, and how."""
    return {"sdxl_lora.resized": json.dumps({"from": source, "rank": rank, "method": method, "param": param})}


def _dtype(layer: AnyLayer) -> torch.dtype:
    return layer.down.dtype if isinstance(layer, LoraLayer) else next(iter(layer.tensors().values())).dtype


def resize_sum(parts: list[tuple[AnyLayer, float]], name: str, rank: int, method: str | None = None,
               param: float | None = None, device: str | torch.device = "cpu") -> tuple[LoraLayer, LayerResize]:
    """One LoRA layer for the sum of each part's update times its strength, cut as `resize_layer` cuts one
    (the weights in the first part's dtype). LoRA parts stay low-rank: their halves are stacked, so the sum is
    factored through QR as one layer is; any LoHa or LoKr part makes it the full SVD of the summed update. A DoRA
    layer is refused: its magnitude rescales the whole weight, so two of them do not add."""
    if len(parts) == 1 and parts[0][1] == 1.0:
        return resize_layer(parts[0][0], rank, method, param, device)
    if any(layer.magnitude is not None for layer, _ in parts):
        raise AdapterError(f"layer {name}: a DoRA layer's update does not add to another's or scale with a "
                           "strength (its magnitude rescales the whole weight); merge DoRA adapters into a "
                           "checkpoint instead (sdxl-lora merge), or resize one alone at strength 1")
    dtype = _dtype(parts[0][0])
    bias = None
    for layer, strength in parts:
        if layer.bias is not None:
            part = strength * layer.scale * layer.bias.float()
            bias = part if bias is None else bias + part
    shapes = {layer.update_shape for layer, _ in parts}
    if len(shapes) > 1:
        raise AdapterError(f"layer {name}: the adapters' updates have different shapes ({', '.join(map(str, shapes))})"
                           ": they were made for different models")
    if all(isinstance(layer, LoraLayer) for layer, _ in parts):
        down = torch.cat([layer.down.float() for layer, _ in parts], 0)
        up = torch.cat([layer.up.float() * (strength * layer.scale) for layer, strength in parts], 1)
        u, s, vh = _factors(LoraLayer(down=down, up=up, alpha=float(down.shape[0])), torch.device(device))
    else:
        delta = sum(layer.delta().float().to(device) * strength for layer, strength in parts)
        u, s, vh = torch.linalg.svd(delta.flatten(1), full_matrices=False)
    out, row = truncated(u, s, vh, next(iter(shapes)), rank, method, param, dtype)
    return dataclasses.replace(out, bias=None if bias is None else bias.to(dtype)), row


def resize_adapter(adapter: Adapter, rank: int, method: str | None = None, param: float | None = None,
                   device: str | torch.device = "cpu", progress=None) -> Resized:
    """Every layer of `adapter` resized (see `resize_layer`); the metadata is carried over. `progress(i, n)` is
    called after each layer."""
    return resize_adapters([(adapter, 1.0)], rank, method, param, device, progress)


def resize_adapters(adapters: list[tuple[Adapter, float]], rank: int, method: str | None = None,
                    param: float | None = None, device: str | torch.device = "cpu", progress=None) -> Resized:
    """The adapters, each at its strength, as one resized adapter: each layer (of any of them) gets the sum of
    their updates, cut to the rank (`resize_sum`). One adapter at strength 1 keeps its metadata; a blend keeps
    none of theirs (the caller says what it was made from)."""
    if rank < 1:
        raise AdapterError(f"rank={rank}: must be 1 or more")
    check_method(method, param)
    if not adapters:
        raise AdapterError("no adapter to resize")
    groups: dict[str, list[tuple[AnyLayer, float]]] = {}
    for adapter, strength in adapters:
        for name, layer in adapter.layers.items():
            if not layer.finite():
                raise AdapterError(f"layer {name} holds NaN or infinite weights: there is nothing to resize")
            groups.setdefault(name, []).append((layer, float(strength)))
    layers, rows = {}, []
    for i, (name, parts) in enumerate(sorted(groups.items())):
        layers[name], row = resize_sum(parts, name, rank, method, param, device)
        rows.append(dataclasses.replace(row, name=name))
        if progress is not None:
            progress(i + 1, len(groups))
    first = adapters[0][0]
    single = len(adapters) == 1 and adapters[0][1] == 1.0
    out = dataclasses.replace(first, layers=layers, format="memory", unknown=[], problems=[],
                              metadata=dict(first.metadata) if single else {})
    return Resized(out, rows)

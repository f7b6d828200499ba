"""Exponential moving average of the trainable (adapter) weights, for any task.

After each optimizer step: ema = decay * ema + (1 - decay) * weight, in fp32 on the weights' device.
`applied()` swaps the averages into the model for a while (export, previews, evaluation) and puts
the trained weights back bit for bit, so training goes on as if nothing happened.

Written here rather than with torch's AveragedModel or diffusers' EMAModel: AveragedModel deep-copies
the whole module (the frozen base included: gigabytes for a LoRA of megabytes), and EMAModel bends
the decay with its own warm-up formula and keeps its averages in a list by position, not by name,
which a checkpoint of named adapter tensors cannot check.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch


class EMA:
    def __init__(self, params: Mapping[str, torch.nn.Parameter], decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"train.ema_decay={decay} must be between 0 and 1 (e.g. 0.999)")
        self.decay = decay
        self.params = dict(params)
        self.shadow = {n: p.detach().float().clone() for n, p in self.params.items()}
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        names = list(self.params)
        averages = [self.shadow[n] for n in names]
        weights = [self.params[n].detach().float() for n in names]
        # lerp: ema + (1 - decay) * (w - ema), one fused kernel for all tensors.
        torch._foreach_lerp_(averages, weights, 1.0 - self.decay)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates,
                "shadow": {n: t.detach().cpu().clone() for n, t in self.shadow.items()}}

    def load_state_dict(self, state: Mapping) -> None:
        shadow = state["shadow"]
        if shadow.keys() != self.shadow.keys():
            missing = sorted(self.shadow.keys() - shadow.keys())
            raise KeyError(f"the saved EMA does not match this model's adapter ({len(shadow)} tensors saved, "
                           f"{len(self.shadow)} expected{', e.g. missing ' + missing[0] if missing else ''})")
        with torch.no_grad():
            for n, t in shadow.items():
                self.shadow[n].copy_(t)
        self.updates = int(state["updates"])

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The averaged weights in the model inside the block; the trained ones restored after."""
        backup = {n: p.detach().clone() for n, p in self.params.items()}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.shadow[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(backup[n])

"""The causal-LM loss on answer tokens, without materialising the full logits.

transformers' own loss takes logits for every position (tokens x vocabulary; in fp32 that is 2 GB
for 4k tokens of Llama-3's 128k vocabulary) and keeps them for the backward pass. Here the model runs
with its lm_head swapped for an identity, so its forward returns the final hidden states; the head and
the cross-entropy then run over chunks of llm.loss_chunk tokens, each chunk recomputed in the backward
pass (activation checkpointing), so at most one chunk's fp32 logits exist at a time. The forward still
goes through the (possibly DDP-wrapped) model's own __call__, so gradient sync works as usual.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .data import IGNORE


@contextlib.contextmanager
def _hidden_only(lm):
    head = lm.get_output_embeddings()
    lm.set_output_embeddings(nn.Identity())
    try:
        yield head
    finally:
        lm.set_output_embeddings(head)


def _chunk_ce(head: nn.Module, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(h).float(), y, ignore_index=IGNORE, reduction="none")


def token_losses(model: nn.Module, lm: nn.Module, batch: dict[str, torch.Tensor], chunk: int = 1024) -> torch.Tensor:
    """Per-position losses, shape (batch, length - 1): position t scores the prediction of token t+1
    (0 where token t+1 carries no label). `model` is what to call (the prepared model), `lm` the
    transformers model inside it."""
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    # Logit soft-capping (Gemma 2) happens after the head inside forward: there the plain path is right.
    if getattr(lm.config, "final_logit_softcapping", None):
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[:, :-1]
        y = labels[:, 1:]
        return F.cross_entropy(logits.float().transpose(1, 2), y, ignore_index=IGNORE, reduction="none")
    with _hidden_only(lm) as head:
        hidden = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    y = labels[:, 1:].reshape(-1)
    parts = []
    for start in range(0, h.shape[0], chunk):
        hc, yc = h[start:start + chunk], y[start:start + chunk]
        if torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_ce, head, hc, yc, use_reentrant=False))
        else:
            parts.append(_chunk_ce(head, hc, yc))
    return torch.cat(parts).view(ids.shape[0], -1)


def response_loss(model: nn.Module, lm: nn.Module, batch: dict[str, torch.Tensor], chunk: int = 1024) -> torch.Tensor:
    """Mean cross-entropy over the batch's answer tokens (no host sync: the count stays on the device)."""
    losses = token_losses(model, lm, batch, chunk)
    n = (batch["labels"][:, 1:] != IGNORE).sum().clamp(min=1)
    return losses.sum() / n


def example_losses(losses: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[int, float]:
    """Mean loss of each example in the batch, by example index (for reports and tests)."""
    ex, labelled = batch["example"][:, 1:], batch["labels"][:, 1:] != IGNORE
    out = {}
    for i in ex[labelled].unique().tolist():
        sel = labelled & (ex == i)
        out[int(i)] = float(losses[sel].sum() / sel.sum())
    return out

"""The causal-LM loss on answer tokens, without materialising the full logits.

transformers' own loss takes logits for every position (tokens x vocabulary; in fp32 that is 2 GB
for 4k tokens of Llama-3's 128k vocabulary) and keeps them for the backward pass. Here the model runs
with its lm_head swapped for an identity, so its forward returns the final hidden states; the head and
the cross-entropy then run over chunks of llm.loss_chunk tokens, so at most one chunk's logits exist at a
time. A frozen head (the usual case: the adapter leaves it alone) goes through `head_cross_entropy`, which
takes each chunk's gradient with respect to the hidden states in the forward pass, while its logits exist,
and keeps only that; a head with trainable weights (an override put an adapter on it) runs each chunk under
activation checkpointing instead, recomputed in the backward pass. Logit soft-capping (Gemma 2) is applied
by the loss, chunk by chunk, not by the model. The forward still goes through the (possibly DDP-wrapped)
model's own __call__, so gradient sync works as usual.
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
    """The model's forward returning its final hidden states: the head an identity, and logit soft-capping
    (Gemma 2 caps the logits after the head, inside forward) left to the loss."""
    head = lm.get_output_embeddings()
    cap = getattr(lm.config, "final_logit_softcapping", None)
    lm.set_output_embeddings(nn.Identity())
    if cap:
        lm.config.final_logit_softcapping = None
    try:
        yield head, cap
    finally:
        lm.set_output_embeddings(head)
        if cap:
            lm.config.final_logit_softcapping = cap


def _chunk_ce(head: nn.Module, h: torch.Tensor, y: torch.Tensor, cap: float | None = None) -> torch.Tensor:
    logits = head(h).float()
    if cap:  # Gemma 2's soft-capping: cap * tanh(logits / cap)
        logits = torch.tanh(logits / cap) * cap
    return F.cross_entropy(logits, y, ignore_index=IGNORE, reduction="none")


class _HeadCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of a frozen linear head over hidden states h (tokens x hidden), a chunk of
    tokens at a time. The loss of token t depends on h[t] alone, so its gradient is (softmax - one-hot) @ W
    times the loss's incoming gradient at t: the forward computes the first factor while the chunk's fp32
    logits exist, in place in them, and saves it (tokens x hidden, h's dtype); the backward only scales it.
    Against checkpointed chunks (`_chunk_ce`) this holds one fp32 logits buffer per chunk, not the logits,
    their log-softmax and its gradient, and skips the head's second forward in the backward pass. With
    soft-capping (`cap`: logits = cap * tanh(z / cap)), a second buffer holds tanh(z / cap) for the chain rule.
    Written here because torch and transformers have no loss that leaves the logits unsaved (Liger's and
    cut-cross-entropy's are Triton kernels outside the stack)."""

    @staticmethod
    def forward(ctx, h, weight, bias, y, chunk, cap):
        losses = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        grad = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        for start in range(0, h.shape[0], chunk):
            end = min(start + chunk, h.shape[0])
            out = F.linear(h[start:end], weight, bias)
            out_dtype, logits = out.dtype, out.float()
            del out
            slope = None
            if cap:
                slope = logits.div_(cap).tanh_()                  # in place: tanh(z / cap)
                logits = slope * cap
            yc = y[start:end]
            kept = yc != IGNORE
            target = yc.clamp(min=0)[:, None]
            picked = logits.gather(1, target)[:, 0]
            # log-sum-exp by hand, in the logits' buffer: torch.logsumexp holds two more buffers of their size.
            top = logits.amax(dim=-1, keepdim=True)
            probs = logits.sub_(top).exp_()
            total = probs.sum(dim=-1, keepdim=True)
            losses[start:end] = torch.where(kept, (top + total.log())[:, 0] - picked, 0.0)
            if grad is not None:
                probs.div_(total)                                 # softmax
                probs.scatter_add_(1, target, torch.full_like(target, -1, dtype=probs.dtype))
                probs.mul_(kept[:, None])                         # ignored positions: no gradient
                if slope is not None:                             # through the cap: d/dz = 1 - tanh^2
                    probs.mul_(slope.mul_(slope).neg_().add_(1))
                # In the head output's dtype, as autograd would take the logits' gradient through it (under
                # autocast the matmul casts the weight as F.linear did).
                grad[start:end] = probs.to(out_dtype) @ weight
            del logits, probs, slope
        ctx.save_for_backward(grad)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        (grad,) = ctx.saved_tensors
        return grad * grad_losses[:, None].to(grad.dtype), None, None, None, None, None


def head_cross_entropy(h: torch.Tensor, head: nn.Linear, y: torch.Tensor, chunk: int,
                       cap: float | None = None) -> torch.Tensor:
    """Per-token cross-entropy (0 where y is IGNORE) of `head` (a frozen nn.Linear) on hidden states
    h (tokens x hidden), `chunk` tokens at a time, the logits soft-capped at `cap` if given; see
    _HeadCrossEntropy."""
    return _HeadCrossEntropy.apply(h, head.weight, head.bias, y, chunk, cap)


def _frozen_linear(head: nn.Module) -> bool:
    return type(head) is nn.Linear and not any(p.requires_grad for p in head.parameters())


def token_losses(model: nn.Module, lm: nn.Module, batch: dict[str, torch.Tensor], chunk: int = 256) -> torch.Tensor:
    """Per-position losses, shape (batch, length - 1): position t scores the prediction of token t+1
    (0 where token t+1 carries no label). `model` is what to call (the prepared model), `lm` the
    transformers model inside it."""
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    with _hidden_only(lm) as (head, cap):
        hidden = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    y = labels[:, 1:].reshape(-1)
    if _frozen_linear(head):
        return head_cross_entropy(h, head, y, chunk, cap).view(ids.shape[0], -1)
    parts = []
    for start in range(0, h.shape[0], chunk):
        hc, yc = h[start:start + chunk], y[start:start + chunk]
        if torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_ce, head, hc, yc, cap, use_reentrant=False))
        else:
            parts.append(_chunk_ce(head, hc, yc, cap))
    return torch.cat(parts).view(ids.shape[0], -1)


def response_loss(model: nn.Module, lm: nn.Module, batch: dict[str, torch.Tensor], chunk: int = 256) -> torch.Tensor:
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

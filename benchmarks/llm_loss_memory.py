"""The LLM loss's memory: the tensors each way of computing the chunked cross-entropy holds at its peak,
counted by torch's MemTracker on this machine's CPU (what the allocator would be asked for on a GPU, less its
rounding and workspaces). Frozen head: llm/loss.py's head_cross_entropy (the gradient taken in the forward
pass). Trained head: the checkpointed chunks (an adapter on the head). Full: transformers' way, the whole
fp32 logits. The hidden size only sets the matmuls' cost, not the logits' bytes: keep it small on a CPU.

    python3 benchmarks/llm_loss_memory.py --vocab 128256 --tokens 8192 --chunks 256 1024
    python3 benchmarks/llm_loss_memory.py --vocab 256000 --tokens 8192 --chunks 256 --cap 30   # Gemma 2
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import checkpoint

from sdxl_lora.llm.loss import _chunk_ce, head_cross_entropy

GiB = 2**30


def peak(fn) -> int:
    tracker = MemTracker()
    with tracker:
        fn().sum().backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens in the step (batch x length)")
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--chunks", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--full", action="store_true", help="also transformers' full fp32 logits")
    ap.add_argument("--cap", type=float, default=None, help="logit soft-capping (Gemma 2: 30)")
    a = ap.parse_args()
    torch.manual_seed(0)
    weight = torch.randn(a.vocab, a.hidden, dtype=torch.bfloat16) * 0.02
    h = torch.randn(a.tokens, a.hidden, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, a.vocab, (a.tokens,))
    frozen = torch.nn.Linear(a.hidden, a.vocab, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    frozen.weight.copy_(weight)
    trained = weight.clone().requires_grad_(True)

    def linear(x):  # a function, not a module: MemTracker follows each module call, one per chunk here
        return F.linear(x, trained)

    print(f"vocab {a.vocab:,}, {a.tokens:,} tokens, bf16 head{f', logits soft-capped at {a.cap:g}' if a.cap else ''}; "
          "peak tensor bytes of the loss's forward and backward")
    print(f"{'loss':32} {'chunk':>6} {'GiB':>8} {'bytes/(chunk x vocab)':>22}")
    for c in a.chunks:
        for name, fn in (("frozen head (gradient in forward)", lambda: head_cross_entropy(h, frozen, y, c, a.cap)),
                         ("trained head (checkpointed)", lambda: torch.cat(
                             [checkpoint(_chunk_ce, linear, h[s:s + c], y[s:s + c], a.cap, use_reentrant=False)
                              for s in range(0, a.tokens, c)]))):
            p = peak(fn)
            print(f"{name:32} {c:>6} {p / GiB:>8.3f} {p / (min(c, a.tokens) * a.vocab):>22.2f}", flush=True)
    if a.full:
        def full():  # as transformers' causal LMs do it: Gemma 2 caps its logits in their own dtype
            z = linear(h)
            if a.cap:
                z = torch.tanh(z / a.cap) * a.cap
            return F.cross_entropy(z.float(), y, reduction="none")

        p = peak(full)
        print(f"{'full fp32 logits (transformers)':32} {a.tokens:>6} {p / GiB:>8.3f} {p / (a.tokens * a.vocab):>22.2f}")


if __name__ == "__main__":
    main()

"""The activation model of a causal LM's training step, so `sdxl-lora llm plan` can say whether a run fits:
what the decoder layers save for backward per token, with and without gradient checkpointing, and the
chunked loss's logits. From the model's config alone (no weights read)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.memory import DTYPE_NAMES, GiB

WORKSPACE = int(0.14 * GiB)  # cuBLAS and attention workspaces


def _dims(config) -> tuple[int, int, int, int, int, int]:
    """(hidden, query width, key/value width, MLP width, layers, vocabulary) of a decoder config."""
    h = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads) * head_dim
    mlp = int(getattr(config, "intermediate_size", None) or 4 * h)
    return h, heads * head_dim, kv, mlp, int(config.num_hidden_layers), int(config.vocab_size)


def layer_bytes_per_token(config, elt: int) -> int:
    """What one decoder layer saves for backward per token (SDPA attention, a gated MLP, RMSNorm in fp32):
    both norms' fp32 input copies and their outputs, q/k/v and the attention output, the MLP's gate, up,
    activation and product. The LoRA factors' own inputs are these same tensors; their rank-wide outputs
    are left out (small)."""
    h, q, kv, mlp, _, _ = _dims(config)
    return elt * (2 * h + q + 2 * kv + q + 4 * mlp) + 4 * 2 * h


@dataclass
class LLMActivations:
    saved: int        # kept for backward across the layers
    recompute: int    # one layer's activations rebuilt in backward (checkpointing), else 0
    loss: int         # the chunked loss's logits, their fp32 copy and gradient, one chunk at a time
    tokens: int

    @property
    def total(self) -> int:
        return self.saved + self.recompute + self.loss


def activation_bytes(config, batch_size: int, max_length: int, checkpointing: bool,
                     compute_dtype: torch.dtype = torch.bfloat16, loss_chunk: int = 1024) -> LLMActivations:
    """The step's activations for rows padded to max_length. Checkpointed: each layer keeps its input,
    and one layer at a time is recomputed whole in backward."""
    elt = torch.empty((), dtype=compute_dtype).element_size()
    h, _, _, _, layers, vocab = _dims(config)
    tokens = batch_size * max_length
    per_layer = layer_bytes_per_token(config, elt) * tokens
    head_input = tokens * h * (elt + 4)  # the final norm's output and its fp32 copy
    if checkpointing:
        saved, recompute = layers * tokens * h * elt + head_input, per_layer
    else:
        saved, recompute = layers * per_layer + head_input, 0
    loss = min(loss_chunk, tokens) * vocab * (elt + 4 + 4)
    return LLMActivations(saved, recompute, loss, tokens)


def format_activations(a: LLMActivations, checkpointing: bool, compute_dtype: torch.dtype) -> list[str]:
    how = "checkpointed: layer inputs, one layer recomputed" if checkpointing else "every layer's kept"
    return [f"  activations    {a.total / GiB:8.2f} GiB  ({a.tokens:,} tokens, {DTYPE_NAMES.get(compute_dtype)}; {how}"
            f" {(a.saved + a.recompute) / GiB:.2f}, loss chunk {a.loss / GiB:.2f})",
            f"  workspace      {WORKSPACE / GiB:8.2f} GiB"]


def step_estimate(config, *, weights: int, trainable_params: int, optimizer: str, batch_size: int,
                  max_length: int, checkpointing: bool, compute_dtype: torch.dtype,
                  loss_chunk: int) -> tuple[dict[str, int], LLMActivations]:
    """The step's expected peak on the accelerator by part (bytes), and the activations' detail."""
    from ..core.memory import state_bytes

    acts = activation_bytes(config, batch_size, max_length, checkpointing, compute_dtype, loss_chunk)
    adapter = state_bytes(trainable_params, optimizer)
    return ({"frozen weights": weights, "adapter (fp32)": adapter["adapter"], "gradients": adapter["gradients"],
             "optimizer": adapter["optimizer"], "activations": acts.total, "workspace": WORKSPACE}, acts)

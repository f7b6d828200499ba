"""What one decoder layer with LoRA on every linear keeps for its backward, per token: eager (torch's
saved_tensors_hooks, each storage counted once) and compiled (the tensors the forward graph hands its backward
after AOTAutograd's min-cut partition, what inductor's partitioner also keeps; counted from the graph), beside
`llm plan`'s count (llm/memory.py: layer_bytes_per_token). With checkpointing this is what one layer's
recomputation holds during the backward, the step's peak at batch 4 x 2048 on Llama-3-8B.

    python3 benchmarks/llm_layer_memory.py --shape 8b --tokens 2048 --budgets 1.0 0.8 0.6 0.4
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

SHAPES = {
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=1,
               num_attention_heads=32, num_key_value_heads=8),
    "small": dict(vocab_size=1024, hidden_size=512, intermediate_size=1792, num_hidden_layers=1,
                  num_attention_heads=8, num_key_value_heads=2),
}


def build(shape: str, dtype: torch.dtype):
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(**SHAPES[shape])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, 0).to(dtype)
    holder = nn.Module()
    holder.layer = layer
    inject_adapter_in_model(LoraConfig(r=16, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]), holder)
    for n, p in holder.named_parameters():
        p.requires_grad_("lora_" in n)
        if "lora_" in n:
            p.data = p.data.float()
    return config, holder.layer, LlamaRotaryEmbedding(config)


def eager_saved(layer, x, pos) -> int:
    seen: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def pack(t):
        st = t.untyped_storage()
        # per token: tensors with a token dim (not the frozen weights, nor the adapter's weight casts)
        if st.data_ptr() not in weights and x.shape[1] in t.shape:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
        out = layer(x, position_embeddings=pos)
    out = out[0] if isinstance(out, tuple) else out
    seen.pop(x.untyped_storage().data_ptr(), None)  # the layer's input: kept by checkpointing anyway
    return sum(seen.values())


class _Partitioned(Exception):
    """Raised by the backward's compiler once both graphs are known: nothing needs to run."""


def compiled_saved(layer, x, pos, budget: float = 1.0) -> tuple[int, int, bool]:
    """(bytes per token the forward graph hands its backward, the backward's matmul FLOPs per token, whether
    the backward runs the attention's forward again) for the layer compiled at `budget`. Only the partition is made (the
    partitioner's choices depend on the sequence length, so this runs at the real one without executing it):
    saved tensors with a token dim count; the weights and the layer's input are graph inputs and do not."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    tokens = x.shape[1]
    got: dict[str, object] = {}

    def partition(joint, inputs, **kwargs):
        fw_module, bw_module = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        got["flops"] = _matmul_flops(bw_module)
        # attention's forward run again in the backward (its own backward op is another)
        got["attention_again"] = any("_scaled_dot_product" in str(n.target) and "backward" not in str(n.target)
                                     for n in bw_module.graph.nodes if n.op == "call_function")
        out = next(n for n in fw_module.graph.nodes if n.op == "output")
        saved = 0
        for node in out.args[0][1:]:  # the layer's output first, then what the backward needs
            v = node.meta.get("val")
            if isinstance(v, torch.Tensor) and node.op != "placeholder" and tokens in v.shape:
                saved += v.numel() * v.element_size()
        got["saved"] = saved
        raise _Partitioned()

    torch._dynamo.reset()
    torch._functorch.config.activation_memory_budget = budget  # train.compile_activation_budget's knob
    backend = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm, partition_fn=partition)
    compiled = torch.compile(layer, backend=backend, fullgraph=False)
    try:
        with torch.autocast("cpu", torch.bfloat16):
            compiled(x, position_embeddings=pos)
    except Exception:  # dynamo wraps the partition's _Partitioned
        if "saved" not in got:
            raise
    return got["saved"] // tokens, got["flops"] // tokens, got["attention_again"]


def _matmul_flops(gm) -> int:
    """The matmuls' FLOPs in a graph (from the nodes' fake values): the backward's own plus what it recomputes."""
    total = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and str(node.target) in ("aten.mm.default", "aten.addmm.default"):
            a, b = (x.meta["val"] for x in node.args[-2:])
            total += 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--tokens", type=int, default=2048, help="the sequence length (one row)")
    ap.add_argument("--budgets", type=float, nargs="+", default=[1.0], help="compiled: activation memory budgets")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager count (it runs the layer)")
    a = ap.parse_args()
    from sdxl_lora.llm.memory import layer_bytes_per_token

    config, layer, rope = build(a.shape, torch.bfloat16)
    x = torch.randn(1, a.tokens, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    pos = rope(x, torch.arange(a.tokens)[None])
    print(f"{a.shape}: hidden {config.hidden_size}, MLP {config.intermediate_size}, {a.tokens} tokens, bf16 autocast, "
          f"LoRA r16 on all 7 linears; KiB per token kept for the backward")
    print(f"  planned (llm plan)               {layer_bytes_per_token(config, 2) / 1024:8.1f}")
    if not a.no_eager:
        from sdxl_lora.core.inject import adapters_take_autocast_inputs

        print(f"  eager, peft casting each input   {eager_saved(layer, x, pos) / a.tokens / 1024:8.1f}")
        adapters_take_autocast_inputs(layer)
        print(f"  eager, autocast casting (now)    {eager_saved(layer, x, pos) / a.tokens / 1024:8.1f}")
    base = None
    for b in a.budgets:
        saved, flops, again = compiled_saved(layer, x, pos, b)
        base = flops if base is None else base
        print(f"  compiled, activation budget {b:<4g} {saved / 1024:8.1f}   backward matmuls {flops / 1e6:6.1f} MFLOP "
              f"per token ({(flops - base) / 1e6:+.1f} against the first budget)"
              f"{'; the attention recomputed' if again else ''}", flush=True)

if __name__ == "__main__":
    main()

"""What one decoder layer with LoRA on every linear keeps for its backward, per token: eager (torch's
saved_tensors_hooks, each storage counted once) and compiled (the tensors the forward graph hands its backward
after AOTAutograd's min-cut partition, what inductor's partitioner also keeps; counted from the graph), beside
`llm plan`'s count (llm/memory.py: layer_bytes_per_token). With checkpointing this is what one layer's
recomputation holds during the backward, the step's peak at batch 4 x 2048 on Llama-3-8B.

    python3 benchmarks/llm_layer_memory.py --shape 8b --tokens 64
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
        if st.data_ptr() not in weights:  # the frozen weights are kept for the input's gradient, not activations
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
        out = layer(x, position_embeddings=pos)
    out = out[0] if isinstance(out, tuple) else out
    seen.pop(x.untyped_storage().data_ptr(), None)  # the layer's input: kept by checkpointing anyway
    return sum(seen.values())


def compiled_saved(layer, x, pos, budget: float = 1.0) -> tuple[int, int]:
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    counted = []

    def fw(gm, example_inputs):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        results = out.args[0]
        # The forward returns the layer's outputs first, then what the backward needs.
        saved = results[1:] if len(results) > 1 else []
        total = 0
        for node in saved:
            v = node.meta.get("val") if hasattr(node, "meta") else None
            # graph inputs handed on (the weights, the layer's input, the rotary tables) are not activations
            if isinstance(v, torch.Tensor) and node.op != "placeholder":
                total += v.numel() * v.element_size()
        counted.append((total, gm))
        return gm

    torch._dynamo.reset()
    torch._functorch.config.activation_memory_budget = budget  # train.compile_activation_budget's knob
    def bw(gm, example_inputs):
        flops.append(_matmul_flops(gm))
        return gm

    flops: list[int] = []
    backend = aot_autograd(fw_compiler=fw, bw_compiler=bw, partition_fn=min_cut_rematerialization_partition)
    compiled = torch.compile(layer, backend=backend, fullgraph=False)
    with torch.autocast("cpu", torch.bfloat16):
        out = compiled(x, position_embeddings=pos)
    out = out[0] if isinstance(out, tuple) else out
    out.float().sum().backward()
    return sum(t for t, _ in counted), sum(flops)


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
    ap.add_argument("--tokens", type=int, default=64, help="measured at this many tokens and twice as many: the "
                    "difference is per token (the adapter's weight casts, the same at any length, drop out)")
    ap.add_argument("--budgets", type=float, nargs="+", default=[1.0], help="compiled: activation memory budgets")
    a = ap.parse_args()
    from sdxl_lora.llm.memory import layer_bytes_per_token

    config, layer, rope = build(a.shape, torch.bfloat16)

    def inputs(n):
        x = torch.randn(1, n, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        return x, rope(x, torch.arange(n)[None])

    def per_token(measure) -> float:
        lo, hi = measure(*inputs(a.tokens)), measure(*inputs(2 * a.tokens))
        return (hi - lo) / a.tokens

    print(f"{a.shape}: hidden {config.hidden_size}, MLP {config.intermediate_size}, bf16 autocast, "
          f"LoRA r16 on all 7 linears; KiB per token kept for the backward")
    print(f"  planned (llm plan)               {layer_bytes_per_token(config, 2) / 1024:8.1f}")
    print(f"  eager                            {per_token(lambda x, p: eager_saved(layer, x, p)) / 1024:8.1f}")
    for b in a.budgets:
        got = per_token(lambda x, p: compiled_saved(layer, x, p, b)[0])
        flops = per_token(lambda x, p: compiled_saved(layer, x, p, b)[1])
        print(f"  compiled, activation budget {b:<4g} {got / 1024:8.1f}   (backward matmuls {flops / 1e6:.1f} MFLOP per token)")


if __name__ == "__main__":
    main()

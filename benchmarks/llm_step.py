"""LoRA training step on a Llama-3-8B-architecture model: our LLM path against a plain transformers + peft
loop, measured in the same process. Prints a markdown table of tokens/s and peak memory.

  python benchmarks/llm_step.py                 # H200: 8B shapes, seq 2048, rank 16 on all linears,
                                                # bf16 and nf4, batch 1 and 4 (about 5 minutes)
  python benchmarks/llm_step.py --tiny          # CPU smoke test: a 2-layer model, seq 128

The weights are random (no download): the model is built on the meta device, then each decoder layer
is materialised on the GPU, initialised, and (for nf4) quantized before the next, so peak memory during
the build stays one layer above the quantized model.

Both paths share: the same base weights, LoRA rank 16 (alpha 16) on q/k/v/o/gate/up/down, SDPA,
non-reentrant gradient checkpointing, AdamW, bf16, random token batches with every token labelled.
  baseline  peft.get_peft_model, the model's own loss (labels=...: full logits, upcast to fp32),
            torch.optim.AdamW defaults, loss.item() every step (what a typical loop logs).
  ours      sdxl_lora's injector (inject.make_plan/apply_plan, fp32 adapter under bf16 autocast),
            sdxl_lora.llm.loss.response_loss (the head and cross-entropy over chunks, never the full
            fp32 logits), fused AdamW, no host sync in the step, and (--compile, default on CUDA) each
            decoder layer compiled by torch.compile.
"""
from __future__ import annotations

import argparse
import gc
import math
import time

import torch

from sdxl_lora.core import inject
from sdxl_lora.llm import slots as llm_slots
from sdxl_lora.llm.config import AdapterConfig
from sdxl_lora.llm.loss import response_loss

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rope_theta=500000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=False)


def _init_(module: torch.nn.Module, std: float = 0.02) -> None:
    for name, p in module.named_parameters(recurse=False):
        with torch.no_grad():
            if name == "weight" and p.dim() == 1:  # RMSNorm
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)


def build_model(shape: dict, device: torch.device, quant: str, seed: int = 0, attention: str = "sdpa"):
    """Random-weight Llama from its config: meta -> per-layer materialise + init (+ nf4) on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(**shape, attn_implementation=attention, use_cache=False)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    for name, child in [("embed", model.model.embed_tokens), *[(f"layer{i}", layer) for i, layer in
                                                              enumerate(model.model.layers)],
                        ("norm", model.model.norm), ("head", model.lm_head)]:
        child.to_empty(device=device)
        for m in child.modules():
            _init_(m)
        if quant == "nf4" and name.startswith("layer"):
            quantize_nf4(child, device)
    # Rotary frequencies are a non-persistent buffer: computed again, not left uninitialised by to_empty.
    model.model.rotary_emb = LlamaRotaryEmbedding(config).to(device)
    if quant == "nf4":  # as quantize_model sets it on a whole model: peft picks its 4-bit LoRA layers by it
        model.is_loaded_in_4bit = True
    model.requires_grad_(False)
    return model


def quantize_nf4(module: torch.nn.Module, device: torch.device) -> None:
    """NF4 (double quant, bf16 compute) for a module's linears, with the product's own quantizer."""
    from sdxl_lora.core.quantize import quantize_model

    quantize_model(module, "nf4", compute_dtype=torch.bfloat16, double_quant=True, device=device)


LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def baseline_setup(model, rank: int):
    from peft import LoraConfig, get_peft_model

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=rank, target_modules=LINEARS,
                                                  lora_dropout=0.0, task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-4)

    def step(batch):
        loss = peft_model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def ours_setup(model, rank: int, compile_layers: bool, chunk: int):
    plan = llm_slots.make_plan(model, AdapterConfig(preset="full", rank=rank))
    inject.apply_plan(model, plan)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compile_layers:  # as train.compile="regional" does in the LLM task
        from sdxl_lora.core import speed

        speed.compile_regions(model, classes=("LlamaDecoderLayer",))
    params = inject.trainable_parameters(model)
    fused = all(p.is_cuda for p in params)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=fused)
    device_type = params[0].device.type

    def step(batch):
        with torch.autocast(device_type, dtype=torch.bfloat16):
            loss = response_loss(model, model, batch, chunk)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def batches(n: int, batch: int, seq: int, vocab: int, device):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        yield {"input_ids": ids, "labels": ids.clone(),
               "position_ids": torch.arange(seq, device=device).expand(batch, -1)}


def measure(path: str, shape: dict, quant: str, batch: int, seq: int, steps: int, warmup: int,
            device: torch.device, compile_layers: bool, chunk: int) -> dict:
    cuda = device.type == "cuda"
    model = build_model(shape, device, quant)
    step = baseline_setup(model, 16) if path == "baseline" else ours_setup(model, 16, compile_layers, chunk)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    data = batches(warmup + steps, batch, seq, shape["vocab_size"], device)
    for _ in range(warmup):
        step(next(data))
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    last = None
    for _ in range(steps):
        last = step(next(data))
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    loss = float(last)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else math.nan
    del model, step
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {"tokens_s": batch * seq * steps / dt, "peak_gib": peak, "loss": loss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: 2 small layers, seq 128")
    ap.add_argument("--seq", type=int)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--quant", nargs="+", default=["bf16", "nf4"], choices=["bf16", "nf4"])
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=1024, help="tokens per cross-entropy chunk (ours)")
    ap.add_argument("--no-compile", action="store_true", help="ours without torch.compile of the decoder layers")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    shape = TINY if args.tiny else LLAMA3_8B
    seq = args.seq or (128 if args.tiny else 2048)
    steps = args.steps or (2 if args.tiny else 6)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    quants = args.quant
    compile_layers = device.type == "cuda" and not args.no_compile
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"# LoRA step, {'tiny Llama' if args.tiny else 'Llama-3-8B architecture'} (random weights), seq {seq}, "
          f"rank 16 on all linear layers, {name}; {steps} timed steps after {warmup} warm-up")
    print()
    print("| base | batch | baseline tok/s | ours tok/s | speed-up | baseline peak GiB | ours peak GiB | memory ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for quant in quants:
        for b in args.batch:
            base = measure("baseline", shape, quant, b, seq, steps, warmup, device, False, args.chunk)
            note = ""
            try:
                ours = measure("ours", shape, quant, b, seq, steps, warmup, device, compile_layers, args.chunk)
            except Exception as e:  # noqa: BLE001 - said in the table, and measured again without it
                if not compile_layers:
                    raise
                torch.compiler.reset()
                note = " (compile failed: " + type(e).__name__ + "; eager)"
                print(f"<!-- {quant} batch {b}: torch.compile failed ({e!r:.300}); measured without it -->")
                ours = measure("ours", shape, quant, b, seq, steps, warmup, device, False, args.chunk)
            ratio = ours["peak_gib"] / base["peak_gib"] if device.type == "cuda" else math.nan
            print(f"| {quant} | {b} | {base['tokens_s']:,.0f} | {ours['tokens_s']:,.0f} | "
                  f"{ours['tokens_s'] / base['tokens_s']:.2f}x | {base['peak_gib']:.1f} | {ours['peak_gib']:.1f} | "
                  f"{ratio:.2f}x{note} |", flush=True)
            if not (math.isfinite(base["loss"]) and math.isfinite(ours["loss"])):
                raise SystemExit(f"non-finite loss: baseline {base['loss']}, ours {ours['loss']}")
    print()
    print("ours: sdxl_lora injector + chunked cross-entropy (no full fp32 logits) + fused AdamW + no host sync"
          + (" + per-layer torch.compile" if compile_layers else "") + "; both: SDPA, non-reentrant checkpointing")


if __name__ == "__main__":
    main()

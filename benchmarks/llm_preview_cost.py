"""What an LLM run's preview answers cost: the default preview prompts answered greedily (llm/preview.py: answer)
by a model with the default adapter plan injected (rank 16 on every linear, its B factors made non-zero as after
training), three ways: through peft's layers, with the adapter merged into copies of the weights it adapts
(inject.merged_for_inference), and merged with its layers out of the model (unwrap=True: how the trainer's
previews answer). Each way twice, in turn; the answers must agree.

    python3 benchmarks/llm_compare.py --work /tmp/llmc --only ours --batches 1 --steps 1   # builds the folder once
    python3 benchmarks/llm_preview_cost.py --model /tmp/llmc/llama-llama3-8b-random [--quantize nf4]

--device cpu with the tiny model (--model tiny-llm) is this script's smoke test.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantize", default="none", choices=("none", "nf4"))
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    from sdxl_lora.core import inject
    from sdxl_lora.core.config import load_config
    from sdxl_lora.llm.model import load_llm
    from sdxl_lora.llm.preview import answer
    from sdxl_lora.llm.slots import make_plan

    cuda = args.device == "cuda"
    cfg = load_config(extra={"task": "llm", "model.path": args.model, "model.quantize": args.quantize,
                             "adapter.preset": "full", "adapter.rank": 16})
    mp = "bf16" if cuda else "no"
    lm, tokenizer, _ = load_llm(cfg, torch.device(args.device), mp)
    inject.apply_plan(lm, make_plan(lm, cfg.adapter), dropout=0.0)
    if cuda:  # as the trainer sets its adapters up under autocast
        inject.adapters_take_autocast_inputs(lm)
    torch.manual_seed(0)
    for name, p in lm.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.01)
    template = tokenizer.chat_template
    prompts = cfg.llm.preview_prompts
    autocast = torch.autocast(args.device, dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ways = {"peft's layers": lambda: contextlib.nullcontext(),
            "merged": lambda: inject.merged_for_inference(lm, unwrap=False),
            "merged, the adapter's layers out (the trainer's previews)": lambda: inject.merged_for_inference(
                lm, unwrap=True)}
    with autocast:
        reference = answer(lm, tokenizer, template, prompts, cfg.llm.max_new_tokens)  # warm-up
    for turn in (1, 2):
        for name, way in ways.items():
            sync()
            t = time.perf_counter()
            with autocast, way():
                got = answer(lm, tokenizer, template, prompts, cfg.llm.max_new_tokens)
            sync()
            print(json.dumps({"way": name, "turn": turn, "seconds": round(time.perf_counter() - t, 2),
                              "prompts": len(prompts), "max_new_tokens": cfg.llm.max_new_tokens,
                              "tokens": sum(len(tokenizer(a)["input_ids"]) for a in got),
                              "same_answers": got == reference, "quantize": args.quantize}), flush=True)


if __name__ == "__main__":
    main()

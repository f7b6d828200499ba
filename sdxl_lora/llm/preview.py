"""Preview answers: fixed prompts answered greedily (no sampling), so two runs, or before and after
training, compare like for like. Written to the run's samples/ as answers-step<N>.txt and .json."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..core.fsutil import atomic_write_text


@torch.no_grad()
def answer(model, tokenizer, template: str, prompts: list[str], max_new_tokens: int,
           system_prompt: str | None = None) -> list[str]:
    """Greedy answers, one prompt at a time (no padding to get wrong), special tokens dropped."""
    device = next(p for p in model.parameters()).device
    # The model's generation config knows its stop tokens (chat models often have several); the
    # tokenizer's EOS only where it names none.
    eos = {} if getattr(model.generation_config, "eos_token_id", None) is not None else {
        "eos_token_id": tokenizer.eos_token_id}
    was_training = model.training
    model.eval()
    out = []
    try:
        for prompt in prompts:
            msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
                {"role": "user", "content": prompt}]
            text = tokenizer.apply_chat_template(msgs, chat_template=template, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, use_cache=True, pad_token_id=tokenizer.pad_token_id, **eos)
            out.append(tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).strip())
    finally:
        model.train(was_training)
    return out


def write_answers(folder: Path, step: int, prompts: list[str], answers: list[str]) -> Path:
    text = "".join(f"### {p}\n{a}\n\n" for p, a in zip(prompts, answers))
    atomic_write_text(folder / f"answers-step{step:06d}.json",
                      json.dumps([{"prompt": p, "answer": a} for p, a in zip(prompts, answers)], indent=1))
    return atomic_write_text(folder / f"answers-step{step:06d}.txt", text)


def read_answers(path: Path) -> list[dict]:
    return json.loads(Path(path).with_suffix(".json").read_text(encoding="utf-8"))

"""The embedded tiny LLM: a Llama-architecture causal LM built in-process, deterministic from a seed.

It has Llama's topology (RMSNorm, rotary positions, grouped-query attention with q/k/v/o, a gated
MLP with gate/up/down, an untied lm_head) at small widths, so every LLM code path (injector slots,
packing masks, chat templates, PEFT export, merge) runs on a CPU in seconds. Its tokenizer is a
byte-level BPE learned offline (the `tokenizers` library) from the bundled instruction set, with a
ChatML chat template. Materialised once as a standard transformers folder: any transformers or
peft tool can load it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..core.config import SAMPLE_DATA
from ..core.fsutil import build_folder_once
from .config import TINY_LLM

# Bump when the architecture, the tokenizer or the build changes, so old copies are not reused.
TINY_VERSION = 2

SPECIAL = {"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<pad>", "unk_token": "<unk>"}
IM_START = "<|im_start|>"
# ChatML: each turn is <|im_start|>role\ncontent<|im_end|>\n; the end-of-turn token is the EOS, so
# generation stops where an answer ends.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _corpus() -> list[str]:
    """The texts the tokenizer learns its merges from: every string of the bundled instruction set."""
    texts = []
    for f in sorted((SAMPLE_DATA / "llm").glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            texts += [row.get(k, "") for k in ("instruction", "input", "output")]
            texts += [m["content"] for m in row.get("messages", [])]
    texts += ["system", "user", "assistant", "You are a helpful assistant."]
    return [t for t in texts if t]


def build_tokenizer(folder: Path, vocab_size: int = 512):
    """Learn a byte-level BPE and save it as a transformers tokenizer folder with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=SPECIAL["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False,
        special_tokens=[SPECIAL["pad_token"], SPECIAL["bos_token"], SPECIAL["unk_token"], IM_START, SPECIAL["eos_token"]],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL, additional_special_tokens=[IM_START])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1024
    fast.save_pretrained(str(folder))
    return fast


def build_tiny_llm(tokenizer, seed: int = 0):
    """The tiny Llama in memory (random weights, deterministic from `seed`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=320, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
        tie_word_embeddings=False, initializer_range=0.1, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    # initializer_range 0.1 (Llama's is 0.02): the head and final norm stay frozen under LoRA, and at 0.02
    # their logits cannot exceed about +-2.5 at this width, which would floor the loss near 4 nats.
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def materialize_tiny_llm(cache_dir: str | Path, seed: int = 0) -> Path:
    """Return the tiny LLM's transformers folder, building it once (temp folder, then rename)."""
    def build(scratch: Path, out: Path) -> None:
        # The build reseeds torch's RNG: forked, so a run that builds the model trains the same adapter
        # as one that finds it built.
        with torch.random.fork_rng(devices=[]):
            tokenizer = build_tokenizer(out)
            build_tiny_llm(tokenizer, seed).save_pretrained(str(out), safe_serialization=True)

    return build_folder_once(Path(cache_dir) / f"{TINY_LLM}-v{TINY_VERSION}-seed{seed}", build, "config.json")

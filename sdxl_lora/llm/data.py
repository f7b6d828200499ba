"""Instruction and chat data for the causal-LM task: JSONL in, token rows with loss masks out.

  - Two line formats, told apart per line: alpaca ({"instruction", "input", "output", "system"?}) and
    chat ({"messages": [{"role", "content"}, ...]}); alpaca lines become a user turn and an answer.
  - The conversation is rendered with the tokenizer's chat template (or llm.chat_template, or the
    ChatML default below when the tokenizer has none) and tokenized once; labels are -100 everywhere
    except the assistant turns (found as character spans of the rendered text), so the loss is on
    responses only.
  - Examples longer than llm.max_length are cut at the end; how many and how many tokens is reported.
  - Packing: short examples share a row; each restarts its position ids at 0, and transformers turns
    restarting position ids (with no 2-D attention mask) into a block-diagonal causal mask on SDPA and
    eager, and into variable-length sequences on flash-attention, so no token attends across examples.
    Padding is its own segment at the end of a row, with label -100.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import LLMConfig

log = logging.getLogger(__name__)

IGNORE = -100

# For tokenizers without a chat template (base models): ChatML-style turns, closed by the EOS token
# so generation stops at the end of an answer. docs/llm.md shows it.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


class DataError(ValueError):
    """The instruction data is wrong; the message names the file and line."""


@dataclass
class Example:
    source: str            # "file.jsonl:12"
    input_ids: list[int]
    labels: list[int]      # IGNORE on prompt tokens


@dataclass
class DataReport:
    files: dict[str, int] = field(default_factory=dict)   # examples read per file
    examples: int = 0
    tokens: int = 0
    label_tokens: int = 0
    truncated: int = 0          # examples cut at max_length
    truncated_tokens: int = 0   # tokens cut off
    dropped: list[str] = field(default_factory=list)  # examples left with no answer token after the cut
    rows: int = 0
    max_length: int = 0
    packing: bool = False

    def text(self) -> str:
        lines = [f"{n:5d} examples from {f}" for f, n in self.files.items()]
        fill = self.tokens / max(1, self.rows * self.max_length)
        lines.append(f"{self.examples} examples, {self.tokens:,} tokens ({self.label_tokens:,} in answers, "
                     f"the only ones with loss) in {self.rows} rows of up to {self.max_length} tokens"
                     + (f", packed ({fill:.0%} full)" if self.packing and self.rows else ""))
        if self.truncated:
            lines.append(f"truncated: {self.truncated} example(s) longer than llm.max_length={self.max_length} "
                         f"lost {self.truncated_tokens:,} token(s) at their end; raise llm.max_length to keep them")
        if self.dropped:
            lines.append(f"dropped: {len(self.dropped)} example(s) had no answer token left after the cut: "
                         + ", ".join(self.dropped[:5]) + (" ..." if len(self.dropped) > 5 else ""))
        return "\n".join(lines)


def chat_template(cfg: LLMConfig, tokenizer) -> str:
    """The template to render with: llm.chat_template (text or .jinja file), the tokenizer's, or the default."""
    if cfg.chat_template:
        p = Path(cfg.chat_template)
        if p.suffix == ".jinja":
            if not p.is_file():
                raise DataError(f"llm.chat_template={cfg.chat_template!r}: no such file")
            return p.read_text(encoding="utf-8")
        return cfg.chat_template
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    log.info("the tokenizer has no chat template: using the ChatML-style default (docs/llm.md)")
    return DEFAULT_CHAT_TEMPLATE


# The roles a chat line may use: what chat templates render (tool results count as context, like the user's).
ROLES = ("system", "user", "assistant", "tool")


def to_messages(row: dict, fmt: str, where: str, system_prompt: str | None) -> list[dict]:
    """One JSONL line as chat messages, with the system prompt added when the line has none."""
    kind = fmt if fmt != "auto" else ("chat" if "messages" in row else "alpaca" if "instruction" in row else None)
    if kind == "chat":
        msgs = row.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs):
            raise DataError(f"{where}: 'messages' must be a list of {{\"role\": ..., \"content\": ...}} objects")
        msgs = [{"role": m["role"], "content": m["content"]} for m in msgs]
    elif kind == "alpaca":
        if not isinstance(row.get("instruction"), str) or not isinstance(row.get("output"), str):
            raise DataError(f"{where}: an alpaca line needs string fields 'instruction' and 'output'")
        user = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]
        if row.get("system"):
            msgs.insert(0, {"role": "system", "content": row["system"]})
    else:
        raise DataError(f"{where}: neither a chat line ('messages') nor an alpaca line ('instruction', 'output'); "
                        f"keys are {sorted(row)}")
    unknown = sorted({m["role"] for m in msgs} - set(ROLES))
    if unknown:
        raise DataError(f"{where}: unknown role(s) {', '.join(map(repr, unknown))}; a message's role is one of "
                        f"{', '.join(ROLES)}")
    if not any(m["role"] == "assistant" for m in msgs):
        raise DataError(f"{where}: no assistant turn, so nothing to learn")
    if any(m["role"] == "assistant" and not m["content"].strip() for m in msgs):
        raise DataError(f"{where}: an empty answer (it would teach the model to say nothing); fill it in or "
                        "remove the line")
    if system_prompt and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": system_prompt})
    return msgs


def render(tokenizer, template: str, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def encode(tokenizer, template: str, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and labels that keep only the assistant turns' tokens.

    Why character spans: tokenizing prompt and answer apart can merge differently at the seam than the
    whole text does; here the text is tokenized once and a token is labelled when it starts inside an
    assistant span (the text an assistant turn adds, end-of-turn token included)."""
    full = render(tokenizer, template, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, template, messages[:i], add_generation_prompt=True)
        through = render(tokenizer, template, messages[:i + 1])
        if not (through.startswith(before) and full.startswith(through)):
            raise DataError(f"{where}: the chat template does not render this conversation turn by turn as a "
                            "prefix of the whole, so answers cannot be told from prompts; set llm.chat_template")
        spans.append((len(before), len(through)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    labels = [IGNORE] * len(ids)
    for t, (start, end) in enumerate(enc["offset_mapping"]):
        if end > start and any(a <= start < b for a, b in spans):
            labels[t] = ids[t]
    return ids, labels


def read_examples(cfg: LLMConfig, tokenizer) -> tuple[list[Example], DataReport]:
    """Every line of every llm.data file, tokenized, masked and cut to llm.max_length."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("the tokenizer is not a fast (tokenizers-backed) one; answer masking needs its offsets")
    template = chat_template(cfg, tokenizer)
    report = DataReport(max_length=cfg.max_length, packing=cfg.packing)
    examples: list[Example] = []
    for name in cfg.data:
        path = Path(name).expanduser()
        if not path.is_file():
            raise DataError(f"llm.data: {path} does not exist (give JSONL files of alpaca or chat lines)")
        n = 0
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}:{lineno} is not UTF-8 text (byte {e.start + 1} of the line is "
                                    f"{raw[e.start:e.start + 1]!r}); save the file as UTF-8") from None
                if not line.strip():
                    continue
                where = f"{path.name}:{lineno}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno} is not valid JSON: {e}") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{lineno}: expected a JSON object per line")
                ids, labels = encode(tokenizer, template, to_messages(row, cfg.format, where, cfg.system_prompt), where)
                n += 1
                if len(ids) > cfg.max_length:
                    report.truncated += 1
                    report.truncated_tokens += len(ids) - cfg.max_length
                    ids, labels = ids[:cfg.max_length], labels[:cfg.max_length]
                # The first token is never predicted, so a label there teaches nothing.
                if all(lab == IGNORE for lab in labels[1:]):
                    report.dropped.append(where)
                    continue
                examples.append(Example(where, ids, labels))
        report.files[str(path)] = n
    if not examples:
        raise DataError(f"llm.data {cfg.data}: no example with an answer to learn from")
    report.examples = len(examples)
    report.tokens = sum(len(e.input_ids) for e in examples)
    report.label_tokens = sum(sum(lab != IGNORE for lab in e.labels[1:]) for e in examples)
    return examples, report


def split(examples: list[Example], fraction: float) -> tuple[list[Example], list[Example]]:
    """Hold out round(fraction * n) examples (at least 1 when fraction > 0, never all), chosen by a hash
    of their file and line: the same ones whatever the seed."""
    if fraction <= 0 or len(examples) < 2:
        return list(examples), []
    n_val = min(len(examples) - 1, max(1, round(fraction * len(examples))))
    ranked = sorted(examples, key=lambda e: hashlib.sha256(e.source.encode()).hexdigest())
    held = {id(e) for e in ranked[:n_val]}
    return [e for e in examples if id(e) not in held], [e for e in examples if id(e) in held]


def pack(lengths: list[int], max_length: int) -> list[list[int]]:
    """Rows of example indices, each row's total length <= max_length: first-fit decreasing (longest
    first, each into the first row with room). Deterministic; examples keep no order across rows."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(max_length - lengths[i])
    return rows


class RowDataset(torch.utils.data.Dataset):
    """Training rows: one example each, or several packed. Items carry ids, labels, position ids and the
    example index of every token (`example`, -1 for padding), so losses can be told apart per example."""

    def __init__(self, examples: list[Example], max_length: int, packing: bool):
        self.examples = examples
        lengths = [len(e.input_ids) for e in examples]
        self.rows = pack(lengths, max_length) if packing else [[i] for i in range(len(examples))]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, r: int) -> dict[str, torch.Tensor]:
        ids, labels, pos, ex = [], [], [], []
        for i in self.rows[r]:
            e = self.examples[i]
            ids += e.input_ids
            # An example's first token is predicted from the example before it in the row: no label.
            labels += [IGNORE] + e.labels[1:]
            pos += range(len(e.input_ids))
            ex += [i] * len(e.input_ids)
        return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels),
                "position_ids": torch.tensor(pos), "example": torch.tensor(ex)}


# Compiled decoder layers compile once per row width they meet. Unpacked rows vary in length: padding each batch
# to the smallest of a few widths (llm.max_length halved up to this many times) that holds its longest row keeps
# the compilations to a few, where padding every row to llm.max_length would run a short row's batch at full width.
WIDTH_HALVINGS = 3


def row_widths(max_length: int) -> tuple[int, ...]:
    """The widths a compiled run pads unpacked batches to, narrowest first: max_length, halved up to
    WIDTH_HALVINGS times."""
    return tuple(sorted({max(1, max_length >> k) for k in range(WIDTH_HALVINGS + 1)}))


def collate(items: list[dict[str, torch.Tensor]], pad_id: int,
            width: int | tuple[int, ...] | None = None) -> dict[str, torch.Tensor]:
    """Pad rows to the longest in the batch; with `width`, to that width (one shape for compiled layers), or,
    given several, to the narrowest that holds the longest row. Padding restarts the position ids, so it is a
    segment of its own that no real token attends to, and carries no loss."""
    longest = max(len(it["input_ids"]) for it in items)
    if isinstance(width, tuple):
        width = next((w for w in width if w >= longest), longest)
    width = max(longest, width or 0)
    out = {k: torch.full((len(items), width), v, dtype=torch.long)
           for k, v in (("input_ids", pad_id), ("labels", IGNORE), ("example", -1))}
    out["position_ids"] = torch.arange(width).repeat(len(items), 1)
    for b, it in enumerate(items):
        n = len(it["input_ids"])
        for k in ("input_ids", "labels", "example", "position_ids"):
            out[k][b, :n] = it[k]
        out["position_ids"][b, n:] = torch.arange(width - n)
    return out


class RowBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Batches of row indices, shuffled per epoch from (seed, epoch) alone, so a resumed run sees the same
    batches; `skip_next` leaves out the first batches of the next pass (resuming mid-epoch)."""

    def __init__(self, n_rows: int, batch_size: int, seed: int):
        if n_rows < 1:
            raise DataError("no training rows")
        self.n_rows, self.batch_size, self.seed = n_rows, batch_size, seed
        self.epoch = self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip_next(self, batches: int) -> None:
        self.skip = batches

    def __len__(self) -> int:
        return -(-self.n_rows // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        order = list(range(self.n_rows))
        random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
        batches = [order[i:i + self.batch_size] for i in range(0, self.n_rows, self.batch_size)]
        skip, self.skip = self.skip, 0
        yield from batches[skip:]

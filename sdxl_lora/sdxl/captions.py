"""The caption an image trains with: its own or the fallback, with kohya's caption processing (dropout, prefix
and suffix, wildcards, kept, dropped and shuffled tags, the trigger word first), and whether it changes from one
use to the next (then its text is encoded per sample, not cached)."""
from __future__ import annotations

import random
import re

from sdxl_lora.sdxl.config import DataConfig

from .dataset import Item

# kohya's wildcard: {a|b|c}, one choice each time; {{ and }} are braces themselves.
_WILDCARD = re.compile(r"\{([^{}]*\|[^{}]*)\}")


def fallback_caption(cfg: DataConfig) -> str:
    """What an image without a caption trains with: "<trigger_word> <class_token>" (either may be empty)."""
    return " ".join(part for part in (cfg.trigger_word.strip(), cfg.class_token.strip()) if part)


def live_text(cfg: DataConfig) -> bool:
    """Whether some dataset's captions change from one use to the next (tag shuffle or tag dropout), so its
    text embeddings are encoded per sample and the text encoders stay on the device."""
    return any(_live(s) for s in [cfg, *(d.settings(cfg) for d in cfg.datasets)])


def _live(settings: DataConfig) -> bool:
    return settings.shuffle_tags or settings.tag_dropout > 0 or settings.wildcards


def live_caption(item: Item, cfg: DataConfig) -> bool:
    """Whether this image's caption changes from one use to the next, so it is encoded per sample."""
    s = item.settings if item.settings is not None else cfg
    return s.shuffle_tags or s.tag_dropout > 0 or (s.wildcards and _WILDCARD.search(item.caption) is not None)


def has_word(text: str, word: str) -> bool:
    """Whether `word` stands in `text` as a word of its own (not inside a longer one)."""
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text) is not None


def _tags(text: str, settings: DataConfig) -> tuple[list[str], list[str], list[str]]:
    """A caption's comma-separated tags as (kept first, free, kept last): data.keep_tokens_separator marks the
    kept parts when the caption has it (kohya's 'a, b ||| c, d ||| e'), else the first keep_tokens are kept."""
    def split(part: str) -> list[str]:
        return [t.strip() for t in part.split(",") if t.strip()]
    sep = settings.keep_tokens_separator
    if sep and sep in text:
        head, rest = text.split(sep, 1)
        rest, _, tail = rest.partition(sep)
        return split(head), split(rest), split(tail)
    tags = split(text)
    keep = max(0, settings.keep_tokens)
    return tags[:keep], tags[keep:], []


def _wildcards(text: str, rng: random.Random | None) -> str:
    """Each {a|b|c} replaced by one of its choices (rng None: the first, for the text cache)."""
    text = text.replace("{{", "\0").replace("}}", "\1")
    text = _WILDCARD.sub(lambda m: (rng.choice if rng else (lambda c: c[0]))(m.group(1).split("|")).strip(), text)
    return text.replace("\0", "{").replace("\1", "}")


def make_caption(item: Item, cfg: DataConfig, rng: random.Random, fixed: bool = False) -> str:
    """The caption an image trains with this time, by its dataset's settings (item.settings; `cfg` for an item
    made without them). In order, as kohya's sd-scripts process a caption:

    - caption dropout: with probability caption_dropout the caption is "" (for classifier-free guidance);
    - no caption: "<trigger_word> <class_token>";
    - caption_prefix and caption_suffix around it;
    - wildcards: each {a|b|c} becomes one of its choices;
    - tags: the kept ones (keep_tokens, or keep_tokens_separator) stay in place, each other tag is left out with
      probability tag_dropout, and with shuffle_tags the rest are shuffled;
    - a trigger word missing from the caption is put first, so every image teaches it (a regularization
      dataset has none).

    fixed=True: the caption without its random parts (no dropout, no shuffle), as the text cache holds it.
    """
    s = item.settings if item.settings is not None else cfg
    if not fixed and s.caption_dropout > 0 and rng.random() < s.caption_dropout:
        return ""
    text = item.caption if item.has_caption else fallback_caption(s)
    text = " ".join(part for part in (s.caption_prefix.strip(), text, s.caption_suffix.strip()) if part)
    if s.wildcards:
        text = _wildcards(text, None if fixed else rng)
    tagged = s.keep_tokens_separator and s.keep_tokens_separator in text
    if tagged or (not fixed and _live(s)):
        head, rest, tail = _tags(text, s)
        if not fixed and s.tag_dropout > 0:
            rest = [t for t in rest if rng.random() >= s.tag_dropout]
        if not fixed and s.shuffle_tags:
            rng.shuffle(rest)
        text = ", ".join(head + rest + tail)
    trigger = s.trigger_word.strip()
    if trigger and not has_word(text, trigger):
        text = f"{trigger}, {text}" if text else trigger
    return text

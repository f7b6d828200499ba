"""Presets: the recommended settings one switch away (`--preset 8gb,style`, `card = "8gb"`, `goal = "style"`).

A card preset names the GPU memory the run may use; the planner (sdxl/plan.py: fit_budget) then picks the
levers that fit, so a card preset holds a budget, never a table of levers. The "-fast" cards also compile
the UNet's blocks: compiled blocks keep fewer activations, so the planner fits a larger batch, and the
first minutes go to compiling (docs/speed.md). A goal preset holds the training settings the peers
recommend for what is trained (docs/training.md, "Presets", names the sources).

A preset fills only what the config leaves unset: a config file, --set, a flag or the form wins, and a
model's own recommended settings (config.RECOMMENDED_SETTINGS) win over a goal preset, being made for that
model. Card and goal names are distinct, so one list names both."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Preset:
    about: str                                            # when to use it, in a user's words
    settings: dict[str, object] = field(default_factory=dict)   # dotted field -> value


_FAST = {"train.compile": "regional", "train.channels_last": True}

CARDS: dict[str, Preset] = {
    "6gb": Preset("6 GB cards: a compressed base model and the least memory; the slowest", {"train.vram_gb": 6}),
    "8gb": Preset("8 GB cards", {"train.vram_gb": 8}),
    "12gb": Preset("12 GB cards", {"train.vram_gb": 12}),
    "16gb": Preset("16 GB cards", {"train.vram_gb": 16}),
    "16gb-fast": Preset("16 GB cards, long runs: compiled blocks, so a larger batch fits", {"train.vram_gb": 16,
                                                                                           **_FAST}),
    "24gb": Preset("24 GB cards", {"train.vram_gb": 24}),
    "24gb-fast": Preset("24 GB cards, long runs: compiled blocks, so a larger batch fits", {"train.vram_gb": 24,
                                                                                           **_FAST}),
    "48gb": Preset("48 GB cards and larger", {"train.vram_gb": 48}),
    "none": Preset("no memory budget: the settings as given", {}),
}

GOALS: dict[str, Preset] = {
    "character": Preset("a person or character: likeness from the attention and feed-forward layers", {
        "adapter.preset": "full", "adapter.rank": 32, "adapter.alpha": 16.0, "train.lr": 1e-4,
        "data.caption_dropout": 0.05, "data.flip": False, "train.min_snr_gamma": 5.0}),
    "style": Preset("an art style: texture lives in the convolutions too, so they train as well", {
        "adapter.preset": "locon", "adapter.rank": 32, "adapter.alpha": 16.0, "adapter.conv_rank": 16,
        "train.lr": 1e-4, "data.caption_dropout": 0.1, "data.flip": True, "train.min_snr_gamma": 5.0}),
    "concept": Preset("an object or concept: attention, ranks weighted by layer", {
        "adapter.preset": "topology", "adapter.rank": 16, "adapter.alpha": 8.0, "train.lr": 1e-4,
        "data.caption_dropout": 0.05, "data.flip": False, "train.min_snr_gamma": 5.0}),
}

KINDS = {"card": CARDS, "goal": GOALS}


def choices() -> str:
    return f"card presets: {', '.join(CARDS)}; goal presets: {', '.join(GOALS)}"


def split_names(names: list[str], source: str = "--preset") -> dict[str, str]:
    """`["8gb,style"]` (or `["8gb", "style"]`) as {"card": "8gb", "goal": "style"}. Raises ValueError naming
    the choices for an unknown name or two of one kind."""
    out: dict[str, str] = {}
    for name in (n.strip().lower() for item in names for n in item.split(",")):
        if not name:
            continue
        kind = next((k for k, table in KINDS.items() if name in table), None)
        if kind is None:
            raise ValueError(f"{source} {name!r}: no such preset; {choices()} (one of each, e.g. 8gb,style)")
        if kind in out and out[kind] != name:
            raise ValueError(f"{source} names two {kind} presets, {out[kind]!r} and {name!r}: give one {kind} "
                             "preset (and at most one of the other kind)")
        out[kind] = name
    return out


def settings(card: str | None, goal: str | None) -> dict[str, object]:
    """The dotted settings of a card and a goal preset together (their fields do not overlap)."""
    out: dict[str, object] = {}
    for kind, name in (("card", card), ("goal", goal)):
        if name is None:
            continue
        table = KINDS[kind]
        if name not in table:
            raise ValueError(f"{kind}={name!r}: no such {kind} preset; {choices()}")
        out.update(table[name].settings)
    return out

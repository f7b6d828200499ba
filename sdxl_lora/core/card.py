"""The GPU a run finds at start, and the memory budget a run with no train.vram_gb plans to: the card's own.

A task plans its whole run against `Card.budget_gib` before any weight is read (docs/speed.md, "Every card, by
default"): a run that fits changes nothing; one that does not gets the levers the planner picks (a budget, as
train.vram_gb does), or is refused at start with the settings that would fit."""
from __future__ import annotations

import math
import shutil
import subprocess
from dataclasses import dataclass

from .memory import CAP_CONTEXT, GiB

# What a run leaves of the card's free memory for everything else on it: a desktop's compositor and browser,
# which take and give back memory while the run starts. Named in the log beside the budget.
CARD_MARGIN_GIB = 0.5
# The budget is rounded down to this step, so that two launches on the same card plan the same levers (a
# resume then keeps its batch) although the free memory moves by a few MiB between them.
BUDGET_STEP_GIB = 0.5


@dataclass(frozen=True)
class Card:
    """A GPU's memory as a run sees it at start, in bytes. `free` is what is free for this process (less where
    whoever started it capped its share with torch.cuda.set_per_process_memory_fraction)."""
    name: str
    total: int
    free: int
    pretend: bool = False  # a card size given by the user (`plan --card N`), not a GPU found here

    @property
    def budget_gib(self) -> float:
        """The budget a run plans to: the free memory less CARD_MARGIN_GIB, in BUDGET_STEP_GIB steps."""
        gib = self.free / GiB - CARD_MARGIN_GIB
        return max(0.0, math.floor(gib / BUDGET_STEP_GIB) * BUDGET_STEP_GIB)

    @property
    def size(self) -> str:
        """The card as people name it: "24 GB"."""
        return f"{round(self.total / GiB):g} GB"

    def describe(self) -> str:
        """The card as the log names it: its size, name, free memory and the budget that leaves."""
        if self.pretend:
            return f"a {self.size} card (budget {self.budget_gib:g} GiB)"
        return (f"this {self.size} card ({self.name}, {self.free / GiB:.1f} GiB free; budget {self.budget_gib:g} GiB "
                f"after a {CARD_MARGIN_GIB:g} GiB margin)")


def pretend_card(gb: float) -> Card:
    """A card of `gb` GB, all of it free: what `sdxl-lora plan --card N` plans for on a machine without it."""
    if not gb > 0:
        raise ValueError(f"--card {gb:g}: a card's memory in GB, e.g. --card 12")
    return Card(f"{gb:g} GB", int(gb * GiB), int(gb * GiB), pretend=True)


def this_card(index: int = 0, free: bool = True) -> Card | None:
    """The CUDA GPU `index` as this process finds it (None without one). `free=False`: its whole memory, the
    same on every GPU of a kind, for launches of several processes that must plan alike. A share capped by
    torch.cuda.set_per_process_memory_fraction before the run counts as the card (a card emulated on a bigger
    one: benchmarks/train_e2e.py --card)."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(index)
    available, total = torch.cuda.mem_get_info(index)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda i: 1.0)(index)
    if fraction < 1.0:
        # The cap covers torch's allocator; the CUDA context lies outside it (core/memory.py: cap_process_memory).
        total = min(total, int(fraction * total) + CAP_CONTEXT)
        available = min(available, total)
    return Card(name, total, available if free else total)


def card_without_context(free: bool = True) -> Card | None:
    """The first GPU's memory from nvidia-smi, for a process that must not hold a CUDA context of its own (the
    UI, `sdxl-lora plan`): None where there is no NVIDIA GPU or no nvidia-smi. `free=False`: its whole memory
    (the UI's summary: its own runs take the free memory while it shows the next one's plan)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        name, total, available = (s.strip() for s in out.splitlines()[0].rsplit(",", 2))
        total_bytes = int(float(total) * 2**20)
        return Card(name, total_bytes, int(float(available) * 2**20) if free else total_bytes)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None  # a driver that does not answer: the plan is shown without a card


def left_to_planner(cfg, levers: tuple[tuple[str, str], ...]) -> tuple[dict[str, object], object]:
    """For a refusal that names the nearest settings that fit: the memory levers among `levers` ((section,
    field) pairs) that the config sets itself, dotted name -> value, and a copy of `cfg` with each of them back
    at its default and unset, so that a task's planner chooses them."""
    held = {f"{s}.{f}": getattr(getattr(cfg, s), f) for s, f in levers if f in getattr(cfg, s).model_fields_set}
    free = cfg.model_copy(deep=True)
    for s, f in levers:
        section = getattr(free, s)
        setattr(section, f, type(section).model_fields[f].default)
        section.model_fields_set.discard(f)
    return held, free

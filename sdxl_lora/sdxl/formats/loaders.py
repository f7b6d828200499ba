"""What the tools people load SDXL adapters with do with a kohya/LyCORIS file of each kind, in one table: the
docs' table (docs/export.md, held to it by a test), the line per kind that `sdxl-lora inspect`, the end of a run,
`sdxl-lora export` and the UI's Export tab print, all come from `TABLE`.

Each cell says what the tool applies against the adapter's own weights (peft's layers): exact, close, exact only
when generating, wrong with no message, nothing at all, or a refusal, with the workaround where there is one. Two cells hold only for some
files, so the line for a file reads its facts first (`file_facts`, from the header and the alphas):
  - LyCORIS' merge path (merge_to, what baking into a checkpoint runs) multiplies a LoHa layer's, and a LoKr layer's
    with a split `lokr_w2`, by alpha / rank twice: such layers merge right only where alpha = rank, which is how
    this project writes them (sdxl/formats/export.py: `kohya_layers`);
  - InvokeAI's model probe reads the base model from the input width of a UNet cross-attention `to_k`/`to_v`
    layer; a LoKr layer gives it that width only where `lokr_w1` and `lokr_w2` are both whole, so a file without
    such a layer is refused as of an unknown base.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

KINDS = ("lora", "dora", "loha", "lokr")
NAMES = {"lora": "LoRA", "dora": "DoRA", "loha": "LoHa", "lokr": "LoKr"}
# kohya layer-name prefixes (sdxl/formats/kohya.py's, with SD 1.x's lora_te_).
PREFIXES = ("lora_unet_", "lora_te1_", "lora_te2_", "lora_te_")


@dataclass(frozen=True)
class Tool:
    name: str
    version: str = ""   # the release the facts were read from, where they come from one
    source: str = ""    # else the code they were read from


TOOLS = (
    Tool("ComfyUI", source="comfy/weight_adapter: lora.py @6fd406f, loha.py @183b377, lokr.py @e8f3bc5, "
                           "base.py @9c0cf36"),
    Tool("Forge", source="backend/patcher/lora.py @dfdcbab"),
    Tool("AUTOMATIC1111", "1.10.1"),
    Tool("kohya sd-scripts", source="networks/lora.py @48d368f"),
    Tool("LyCORIS", "4.1.3"),
    Tool("InvokeAI", "6.14.2"),
    Tool("diffusers", "0.42.1"),
)

# What a tool applies, best first; the line per kind names the tools of each in this order.
EXACT, CLOSE, MERGE, WRONG, NOTHING, REFUSED = "exact", "close", "merge", "wrong", "nothing", "refused"
STATUSES = (EXACT, CLOSE, MERGE, WRONG, NOTHING, REFUSED)
# The docs' cell word and the line's phrase for each ({tools}: "A, B and C").
WORDS = {EXACT: "exact", CLOSE: "approximate", MERGE: "exact when generating, wrong when merged",
         WRONG: "wrong, no message", NOTHING: "loads nothing, no error", REFUSED: "refused"}
PHRASES = {EXACT: "exact in {tools}", CLOSE: "approximately right in {tools}",
           MERGE: "only generation exact in {tools}",
           WRONG: "wrong in {tools}, with no message", NOTHING: "nothing loaded by {tools}, with no error",
           REFUSED: "refused by {tools}"}


@dataclass(frozen=True)
class FileFacts:
    """What of a kohya/LyCORIS file decides a conditional cell."""
    kinds: tuple[str, ...]
    merged_twice: int = 0            # LoHa layers, and LoKr layers with a split lokr_w2, whose alpha != rank
    no_invokeai_base: bool = False   # no layer InvokeAI's probe reads the base model from


# The conditions' labels in the docs' cells (docs/export.md explains each).
CONDITIONS = {"merged_twice": "layers with alpha ≠ rank", "no_invokeai_base": "no layer its probe reads SDXL from"}


@dataclass(frozen=True)
class Cell:
    status: str
    what: str = ""     # what the tool does, for the docs' cell, where the status alone does not say it
    short: str = ""    # the same in a few words, for the line per kind
    fix: str = ""      # the workaround, where there is one
    when: str = ""     # a FileFacts field: files where it holds get `then`
    then: "Cell | None" = None


_LYCORIS_KOHYA = "with --network_module lycoris.kohya it loads as LyCORIS does"
_ON_INPUT_AXIS = Cell(WRONG, "loads every key and reads `dora_scale` on the input axis",
                      "dora_scale read on the input axis")
_CLOSE_DORA = Cell(CLOSE, "normalises by the base weight's norm, not the adapted one's (Comfy-Org/ComfyUI#15458)",
                   "the base weight's norm")
_MERGED_TWICE = Cell(MERGE, "`merge_to` multiplies by alpha / rank twice", "its merge applies alpha / rank twice",
                     "sdxl-lora export rewrites it with alpha = rank")
_NOT_SDXL = ("its model probe finds no base model: \"Unsupported LoRA base model: Unknown\"",
             "\"Unsupported LoRA base model: Unknown\"")


def _invokeai(cell: Cell, fix: str) -> Cell:
    return Cell(cell.status, cell.what, cell.short, cell.fix, when="no_invokeai_base",
                then=Cell(REFUSED, *_NOT_SDXL, fix=fix))


_KEEP_CROSS_KV = "keep cross-attention to_k/to_v in the plan (every preset has them)"
_LYCORIS_NOTHING = Cell(NOTHING, "its own `networks.lora` reads only `lora_down`/`lora_up` layers", "",
                        _LYCORIS_KOHYA)
_DIFFUSERS_REFUSES = Cell(REFUSED, "`load_lora_weights` raises: the keys are not renamed", "",
                          "sdxl-lora resize makes a LoRA of it")

TABLE: dict[str, dict[str, Cell]] = {
    "lora": {
        "ComfyUI": Cell(EXACT), "Forge": Cell(EXACT), "AUTOMATIC1111": Cell(EXACT), "kohya sd-scripts": Cell(EXACT),
        "LyCORIS": Cell(EXACT), "InvokeAI": _invokeai(Cell(EXACT), _KEEP_CROSS_KV),
        "diffusers": Cell(EXACT, "either file"),
    },
    "dora": {
        "ComfyUI": _CLOSE_DORA, "Forge": _CLOSE_DORA, "AUTOMATIC1111": _ON_INPUT_AXIS,
        "kohya sd-scripts": Cell(WRONG, "loads it as plain LoRA, `dora_scale` ignored", "loaded as plain LoRA",
                                 _LYCORIS_KOHYA),
        "LyCORIS": Cell(EXACT), "InvokeAI": _invokeai(_ON_INPUT_AXIS, _KEEP_CROSS_KV),
        "diffusers": Cell(EXACT, "the `.diffusers.safetensors` file (`--format diffusers`); the kohya file loads with "
                                 "`dora_scale` dropped, with a warning", "the .diffusers file"),
    },
    "loha": {
        "ComfyUI": Cell(EXACT), "Forge": Cell(EXACT), "AUTOMATIC1111": Cell(EXACT),
        "kohya sd-scripts": _LYCORIS_NOTHING,
        "LyCORIS": Cell(EXACT, when="merged_twice", then=_MERGED_TWICE),
        "InvokeAI": _invokeai(Cell(EXACT), _KEEP_CROSS_KV), "diffusers": _DIFFUSERS_REFUSES,
    },
    "lokr": {
        "ComfyUI": Cell(EXACT), "Forge": Cell(EXACT), "AUTOMATIC1111": Cell(EXACT),
        "kohya sd-scripts": _LYCORIS_NOTHING,
        "LyCORIS": Cell(EXACT, when="merged_twice", then=_MERGED_TWICE),
        "InvokeAI": _invokeai(Cell(EXACT), "give a cross-attention to_v a rank that keeps its lokr_w2 whole, "
                                           "on SDXL adapter.overrides {\"*.attn2.to_v\" = 32}"),
        "diffusers": _DIFFUSERS_REFUSES,
    },
}


def cell(kind: str, tool: str, facts: FileFacts | None = None) -> Cell:
    """What `tool` does with a file of `kind`: this project's file, or the file `facts` describe."""
    c = TABLE[kind][tool]
    if c.when and facts is not None and getattr(facts, c.when):
        return c.then
    return c


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def note(kind: str, facts: FileFacts | None = None) -> str:
    """One line: which tools apply a file of `kind` exactly, which wrongly or not at all, and the workarounds."""
    groups: dict[str, dict[str, list[str]]] = {}  # status -> what is said of the tools -> the tools
    for tool in TOOLS:
        c = cell(kind, tool.name, facts)
        said = "; ".join(x for x in (c.short, c.fix) if x)
        groups.setdefault(c.status, {}).setdefault(said, []).append(tool.name)
    phrases = []
    for status in (s for s in STATUSES if s in groups):
        tools = [f"{_and(names)} ({said})" if said else _and(names) for said, names in groups[status].items()]
        # "A and B (x), and C (y)": the comma keeps the pairs apart
        last = ", and " if len(tools) > 1 and any(len(n) > 1 for n in groups[status].values()) else " and "
        phrases.append(PHRASES[status].format(tools=last.join([", ".join(tools[:-1]), tools[-1]]) if len(tools) > 1
                                              else tools[0]))
    return f"{NAMES[kind]}: " + "; ".join(phrases)


# ---- a file's facts


def _kind(parts: dict[str, list[int]]) -> str | None:
    if "dora_scale" in parts:
        return "dora"
    if "lora_down.weight" in parts:
        return "lora"
    if "hada_w1_a" in parts:
        return "loha"
    if any(p.startswith("lokr_") for p in parts):
        return "lokr"
    return None


def _gives_width(parts: dict[str, list[int]]) -> bool:
    # The tensors InvokeAI's probe reads an input width from: a LoRA's down, a LoHa's w1_b/w2_b, a LoKr's w1 and
    # w2 when both are whole (it finds no split factor).
    return ("lora_down.weight" in parts or "hada_w1_b" in parts or "hada_w2_b" in parts
            or ("lokr_w1" in parts and "lokr_w2" in parts))


def file_facts(path: str | Path) -> FileFacts | None:
    """The facts of a kohya/LyCORIS `.safetensors` file that the conditional cells depend on (only scalars are
    read); None for a file with no kohya layer (diffusers or PEFT format)."""
    from safetensors import safe_open

    layers: dict[str, dict[str, list[int]]] = {}
    with safe_open(str(path), "pt") as fh:
        for key in fh.keys():
            if key.startswith(PREFIXES) and "." in key:
                name, part = key.split(".", 1)
                layers.setdefault(name, {})[part] = list(fh.get_slice(key).get_shape())
        kinds = {name: _kind(parts) for name, parts in layers.items()}
        twice = 0
        for name, parts in layers.items():
            rank = (parts["hada_w1_b"][0] if kinds[name] == "loha" else
                    parts["lokr_w2_b"][0] if kinds[name] == "lokr" and "lokr_w2_b" in parts else None)
            if rank and "alpha" in parts and not math.isclose(float(fh.get_tensor(f"{name}.alpha")), rank,
                                                              rel_tol=1e-6):
                twice += 1
    found = tuple(k for k in KINDS if k in kinds.values())
    if not found:
        return None

    # InvokeAI's probe: a UNet cross-attention to_k/to_v layer it reads a width from, or a LoRA's time_emb_proj.
    # It also reads both text encoders' self-attention, but there the last key it reads decides (an alpha or an up
    # weight gives no width), so those are not counted on.
    found_base = any(
        name.startswith("lora_unet_") and (name.endswith(("_attn2_to_k", "_attn2_to_v")) and _gives_width(parts)
                                           or name.endswith("time_emb_proj") and "lora_down.weight" in parts)
        for name, parts in layers.items())
    return FileFacts(found, merged_twice=twice, no_invokeai_base=not found_base)


def file_notes(path: str | Path) -> list[str]:
    """The line per kind for a kohya/LyCORIS file (`note` with its facts); none for another format."""
    facts = file_facts(path)
    return [] if facts is None else [note(k, facts) for k in facts.kinds]


# ---- the docs' table


def _cell_md(c: Cell) -> str:
    fix = c.fix.replace("*", "\\*")  # a glob's star, not emphasis
    text = f"**{WORDS[c.status]}**" + (f": {c.what}" if c.what else "") + (f"; {fix}" if fix else "")
    if c.when:
        text += f". With {CONDITIONS[c.when]}: {_cell_md(c.then)}"
    return text


def docs_table() -> str:
    """docs/export.md's table of the kinds in each tool, and the line saying what it was read from."""
    head = [f"{t.name} {t.version}".strip() for t in TOOLS]
    rows = ["| kind | " + " | ".join(head) + " |", "|---" * (len(TOOLS) + 1) + "|"]
    for kind in KINDS:
        rows.append(f"| `{kind}` | " + " | ".join(_cell_md(TABLE[kind][t.name]) for t in TOOLS) + " |")
    read = "; ".join(f"{t.name} {t.source}" for t in TOOLS if t.source)
    return "\n".join(rows) + f"\n\nRead from the releases in the header; {read}."


if __name__ == "__main__":  # the table for docs/export.md
    print(docs_table())

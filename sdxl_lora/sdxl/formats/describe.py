"""An adapter described in plain text (`sdxl-lora inspect`): format, kind, the tools that load it, the base
model it was trained on, rank and alpha per block, metadata and problems."""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from . import kohya
from .adapter import Adapter, LoraLayer, _mixed_attention_alphas, _num
from .read import layer_table, load_adapter

_BLOCK = re.compile(r"^((?:down_blocks|up_blocks)\.\d+\.[a-z_]+\.\d+|mid_block\.[a-z_]+\.\d+|[^.]+)")
_CROSS_WIDTHS = {2048: "SDXL", 768: "SD 1.x", 1024: "SD 2.x"}


def _base_model(adapter: Adapter, table: kohya.LayerTable | None = None) -> tuple[str, list[str]]:
    """What the adapter says and shows it was trained on, and its problems for the model of `table` (SDXL
    base when none): cross-attention layers of another width will not load onto that model."""
    meta, problems = adapter.metadata, []
    want = int((table.unet_config if table is not None else {}).get("cross_attention_dim") or 2048)
    said = [f"{k}={meta[k]}" for k in ("ss_base_model_version", "modelspec.architecture") if meta.get(k)]
    widths = sorted({int(lay.update_shape[1]) for k, lay in adapter.layers.items()
                     if k.startswith("unet.") and k.endswith(".attn2.to_k")})
    from_shapes = ", ".join(f"{_CROSS_WIDTHS.get(w, 'unknown')} (cross-attention width {w})" for w in widths)
    if not said and adapter.format.startswith("kohya"):
        problems.append("no ss_base_model_version or modelspec.architecture: AUTOMATIC1111/Forge cannot tell it "
                        "is an SDXL LoRA and may hide it")
    elif said and not any("sdxl" in s or "stable-diffusion-xl" in s for s in said):
        problems.append(f"its metadata says {', '.join(said)}, not SDXL")
    if widths and widths != [want]:
        model, onto = ("SDXL", "SDXL base") if want == 2048 else ("the model it is checked against", "that model")
        problems.append(f"its cross-attention layers take {'/'.join(map(str, widths))}-wide text embeddings; "
                        f"{model}'s take {want}: it will not load onto {onto}")
    text = "; ".join(x for x in (", ".join(said), f"from the layer shapes: {from_shapes}" if from_shapes else "") if x)
    return text or "unknown", problems


def _span(values) -> str:
    # LoKr layers with no factored part have no rank: "full"
    vals = sorted({"full" if v is None else v for v in values}, key=lambda v: (isinstance(v, str), v))
    return ", ".join(v if isinstance(v, str) else _num(v) for v in vals)


# What each kind is called where users meet it; which tools read a file of it right is sdxl/formats/loaders.py's table.
KIND_NAMES = {"lora": "LoRA", "dora": "DoRA (LoRA + magnitude)", "loha": "LoHa (LyCORIS)", "lokr": "LoKr (LyCORIS)"}
# For a file in diffusers' or PEFT's format, which the tools' table (about kohya files) does not cover.
OTHER_FORMAT_TOOLS = ("diffusers' load_lora_weights and peft read this format; for ComfyUI, AUTOMATIC1111/Forge, "
                      "kohya, LyCORIS and InvokeAI export it with --format kohya (LoRA and DoRA only)")


def describe_adapter(adapter: Adapter, table: kohya.LayerTable | None = None, title: str = "",
                     tools: Sequence[str] = ()) -> str:
    """A plain-text report: format, kind, the tools that load it (`tools`: sdxl/formats/loaders.py's line per kind),
    base model, per-block rank and alpha, metadata, problems."""
    from .single_file import unet_diffusers_to_sgm

    table = table or kohya.LayerTable.from_config_dir(None)
    unet_map = unet_diffusers_to_sgm(table.unet_config)
    base, problems = _base_model(adapter, table)
    problems = list(adapter.problems) + problems
    if adapter.format.startswith("kohya") and _mixed_attention_alphas(adapter):
        problems.append("its attention layers have different alphas: right in AUTOMATIC1111/Forge, ComfyUI and "
                        "kohya, but diffusers' kohya loader applies one alpha to all of them (re-export it with "
                        "`sdxl-lora export --format kohya` for diffusers)")
    counts = Counter(k.split(".", 1)[0] for k in adapter.layers)
    lines = [f"adapter    : {title}" if title else None,
             f"format     : {adapter.format}",
             f"kind       : {', '.join(KIND_NAMES[k] for k in adapter.kinds())}",
             *(f"tools      : {line}" for line in tools),
             f"base model : {base}",
             f"layers     : {len(adapter.layers)} ({', '.join(f'{c} {n}' for c, n in sorted(counts.items()))})",
             f"rank       : {_span(lay.rank for lay in adapter.layers.values())}",
             f"alpha      : {_span(lay.alpha for lay in adapter.layers.values())}"]
    if any(lay.magnitude is not None for lay in adapter.layers.values()):
        lines.append("dora       : yes (magnitude vectors present)")
    if any(lay.bias is not None for lay in adapter.layers.values()):
        lines.append("lora bias  : yes (up projections have a bias)")
    blocks: dict[tuple[str, str], list[LoraLayer]] = {}
    order: dict[tuple[str, str], int] = {}
    for key, layer in adapter.layers.items():
        comp, module = key.split(".", 1)
        if comp == "unet":
            block = _BLOCK.match(module).group(1)
            sgm = unet_map.get(block, "?")
        else:
            block, sgm = comp, kohya.PREFIX[comp].strip("_")
        blocks.setdefault((sgm, block), []).append(layer)
    sgm_order = ["time_embed", "label_emb", "input_blocks", "middle_block", "output_blocks", "out", "lora_te"]
    for i, name in enumerate(sgm_order):
        for b in blocks:
            if b[0].startswith(name) and b not in order:
                order[b] = i

    def sort_key(b):
        return (order.get(b, 99), [int(p) if p.isdigit() else 0 for p in b[0].split(".")], b)
    lines.append("blocks (sgm name / diffusers name: layers, rank, alpha):")
    w = max((len(s) for s, _ in blocks), default=0)
    w2 = max((len(d) for _, d in blocks), default=0)
    for b in sorted(blocks, key=sort_key):
        ls = blocks[b]
        lines.append(f"  {b[0]:<{w}}  {b[1]:<{w2}}  {len(ls):>4} layers  rank {_span(x.rank for x in ls)}  "
                     f"alpha {_span(x.alpha for x in ls)}")
    lines.append("metadata:" if adapter.metadata else "metadata   : none")
    for k in sorted(adapter.metadata):
        v = adapter.metadata[k].replace("\n", " ")
        lines.append(f"  {k} = {v if len(v) <= 160 else v[:157] + '...'}")
    lines.append("problems   : none" if not problems else "problems:")
    lines.extend(f"  - {p}" for p in problems)
    return "\n".join(x for x in lines if x is not None)


def inspect_adapter(path: str | Path, model=None) -> tuple[Adapter, str]:
    """Read an adapter (see `load_adapter`) and describe it."""
    from .loaders import file_notes

    table = layer_table(model)
    adapter = load_adapter(path, table)
    path = Path(path)
    tools = file_notes(path) if path.is_file() and adapter.format.startswith("kohya") else [OTHER_FORMAT_TOOLS]
    return adapter, describe_adapter(adapter, table, title=path.name, tools=tools)

"""Choosing a run's result by eye: each saved checkpoint's fixed-seed renders at a few strengths as one XY
grid (rows the checkpoints, columns the strengths), cached in the run folder, with the losses logged at each
checkpoint's step; and the chosen checkpoint written out at the chosen strength (kohya or diffusers).

A run's checkpoints are its saved training states (checkpoints/step-N/adapter.safetensors: the trained
weights by parameter name, without their alphas) and its final adapter. A state's alphas are the final
adapter's (the same layers; each layer keeps its scale alpha / rank), or the planner's where the run has no
final adapter yet.

Cache: RUN/compare/ holds one PNG per cell, named by a digest of what decides the image (the checkpoint's
weights, the strength, the prompt with its kohya options, seed, steps, size, guidance, the base model), the
grids, and each state's adapter converted to a diffusers file (so the pipeline loads it as any LoRA).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

from ..core.checkpoint import CheckpointError, complete_states, file_sha256, verify
from ..core.config import Config, load_config
from ..core.runs import read_events
from .export import Adapter, AdapterError, LoraLayer, export_adapter, load_adapter, save_diffusers_lora
from .preview import PreviewPrompt, grid, parse_prompt_line, render, save_png

log = logging.getLogger(__name__)

STRENGTHS = (0.5, 0.75, 1.0)
CACHE_DIR = "compare"
GRID_CELL = 192  # px: the smallest cell side in a grid image
ADAPTER_NAME = "compare"
_STATE_KEY = re.compile(r"^(?:(unet|text_encoder|text_encoder_2)\.)?(?:base_model\.model\.)?(.*)\."
                        r"(lora_A|lora_B|lora_magnitude_vector)\.default\.weight$")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path       # a state folder (checkpoints/step-N) or the run's adapter file
    final: bool      # the adapter the run wrote at its end
    digest: str      # what its weights are: the state's checksum, or the file's

    @property
    def label(self) -> str:
        return f"step {self.step}" + (" (final)" if self.final else "")


def final_adapter(run_dir: Path) -> Path | None:
    """The run's own adapter file: the diffusers one (it keeps each layer's alpha), else the kohya one."""
    for p in (run_dir / f"{run_dir.name}.diffusers.safetensors", run_dir / f"{run_dir.name}.safetensors"):
        if p.is_file():
            return p
    return None


def run_checkpoints(run_dir: Path, events: list[dict] | None = None) -> list[Checkpoint]:
    """The run's complete saved states and its final adapter, by step (a state at the final step is left
    out: the final adapter is the same weights)."""
    events = read_events(run_dir / "events.jsonl") if events is None else events
    out = []
    for state in complete_states(run_dir / "checkpoints"):
        try:
            manifest = verify(state)
        except CheckpointError as e:
            log.warning("compare: skipping %s: %s", state.name, e)
            continue
        out.append(Checkpoint(int(state.name.split("-", 1)[1]), state, False,
                              manifest["files"]["adapter.safetensors"]))
    final = final_adapter(run_dir)
    if final is not None:
        step = next((e.get("step", 0) for e in reversed(events) if e.get("event") == "adapter"), None)
        step = step if step is not None else max((c.step for c in out), default=0)
        out = [c for c in out if c.step != step]
        out.append(Checkpoint(int(step), final, True, file_sha256(final)))
    return sorted(out, key=lambda c: (c.step, c.final))


def checkpoint_losses(events: list[dict], steps: list[int]) -> dict[int, dict[str, float]]:
    """Per step: the eval and validation losses logged at it (where a preview ran there), and the training
    loss last logged at or before it."""
    out: dict[int, dict[str, float]] = {s: {} for s in steps}
    train: list[tuple[int, float]] = []
    for e in events:
        kind, step, loss = e.get("event"), e.get("step"), e.get("loss")
        if not isinstance(loss, (int, float)) or not math.isfinite(loss):
            continue
        if kind in ("eval", "validation") and step in out:
            out[step][kind] = float(loss)
        elif kind == "step":
            train.append((step, float(loss)))
    for s in steps:
        before = [v for st, v in train if st <= s]
        if before:
            out[s]["train"] = before[-1]
    return out


def _scales(run_dir: Path, cfg: Config, table) -> dict[str, float]:
    """Each layer's alpha / rank: the final adapter's, else the planner's for the run's config."""
    final = run_dir / f"{run_dir.name}.diffusers.safetensors"
    if final.is_file():
        return {k: lay.alpha / lay.rank for k, lay in load_adapter(final, table).layers.items()
                if isinstance(lay, LoraLayer)}
    from .plan import plan_config

    plan = plan_config(cfg).plan
    return {f"unet.{n}": plan.alpha[n] / plan.rank[n] for n in plan.rank}


def state_adapter(ck: Checkpoint, run_dir: Path, cfg: Config, table) -> Adapter:
    """A saved state's trained weights as an `Adapter` (LoRA and DoRA layers)."""
    from safetensors.torch import load_file

    tensors = load_file(str(ck.path / "adapter.safetensors"))
    parts: dict[str, dict[str, object]] = {}
    for name, t in tensors.items():
        m = _STATE_KEY.match(name)
        if m:
            parts.setdefault(f"{m.group(1) or 'unet'}.{m.group(2)}", {})[m.group(3)] = t
    if not parts:
        raise AdapterError(f"{ck.path.name}: no LoRA weights in its adapter.safetensors (a {cfg.adapter.kind} run); "
                           "compare its final adapter instead")
    scales = _scales(run_dir, cfg, table)
    layers = {}
    for key, p in parts.items():
        down, up = p["lora_A"], p["lora_B"]
        if key not in scales:
            raise AdapterError(f"{ck.path.name}: layer {key} is not in the run's adapter plan; was the state saved by "
                               "another run?")
        mag = p.get("lora_magnitude_vector")  # DoRA's
        layers[key] = LoraLayer(down, up, scales[key] * down.shape[0], None if mag is None else mag.reshape(-1))
    return Adapter(layers, format="state")


def adapter_of(ck: Checkpoint, run_dir: Path, cfg: Config, table) -> Adapter:
    return load_adapter(ck.path, table) if ck.final else state_adapter(ck, run_dir, cfg, table)


def at_strength(adapter: Adapter, strength: float) -> Adapter:
    """The adapter whose update is `strength` times this one's (alpha scaled), as a tool applies it at that
    strength."""
    if strength == 1:
        return adapter
    layers = {}
    for key, lay in adapter.layers.items():
        if not isinstance(lay, LoraLayer) or lay.magnitude is not None:
            raise AdapterError(f"strength {strength:g}: a {lay.kind} layer ({key}) does not scale by its alpha; "
                               "export at strength 1 and set the strength where you load it")
        layers[key] = dataclasses.replace(lay, alpha=lay.alpha * strength)
    return dataclasses.replace(adapter, layers=layers)


def parse_strengths(text: str) -> list[float]:
    """'0.5, 0.75, 1' -> [0.5, 0.75, 1.0]; an error naming the field otherwise."""
    out = []
    for part in re.split(r"[,\s]+", (text or "").strip()):
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"strengths: {part!r} is not a number; give numbers separated by commas, e.g. "
                             "0.5, 0.75, 1.0") from None
        if not math.isfinite(value) or not -2 <= value <= 2:
            raise ValueError(f"strengths: {part} is outside -2 to 2")
        out.append(value)
    if not out:
        raise ValueError("strengths: give at least one, e.g. 0.5, 0.75, 1.0")
    return out


def parse_prompts(text: str) -> list[PreviewPrompt]:
    """One prompt a line in kohya's syntax (`a cat --n blurry --w 512 --h 512 --s 8 --l 5 --d 42`)."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise ValueError("prompts: write at least one prompt (kohya's options: --n --w --h --s --l --d)")
    return [parse_prompt_line(ln, f"prompts line {n}: ") for n, ln in enumerate(lines, 1)]


@dataclass
class Settings:
    """What a prompt without its own options renders with: the run's preview settings."""
    seed: int
    steps: int
    guidance: float
    size: int

    @classmethod
    def of_run(cls, cfg: Config, native: int) -> "Settings":
        return cls(cfg.preview.seed, cfg.preview.steps, cfg.preview.guidance, cfg.data.resolution or native)

    def resolve(self, p: PreviewPrompt) -> PreviewPrompt:
        return PreviewPrompt(p.prompt, p.negative or "", int(p.width or self.size), int(p.height or self.size),
                             int(p.steps or self.steps), float(self.guidance if p.guidance is None else p.guidance),
                             int(self.seed if p.seed is None else p.seed))


@dataclass
class Grid:
    path: Path                 # the XY grid image of one prompt
    prompt: str
    cached: int                # cells read from the cache
    rendered: int              # cells rendered now


def _cell_key(ck: Checkpoint, strength: float, p: PreviewPrompt, model: str) -> str:
    what = {"weights": ck.digest, "strength": strength, "prompt": dataclasses.asdict(p), "model": model}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]


def _loadable(ck: Checkpoint, run_dir: Path, cfg: Config, table) -> Path:
    """A file the pipeline loads with load_lora_weights: the final adapter, or the state converted (cached)."""
    if ck.final:
        return ck.path
    path = run_dir / CACHE_DIR / "adapters" / f"{ck.digest[:24]}.diffusers.safetensors"
    if not path.is_file():
        save_diffusers_lora(state_adapter(ck, run_dir, cfg, table), path, overwrite=True)
    return path


def compare_grids(pipe, run_dir: Path, checkpoints: list[Checkpoint], prompts: list[PreviewPrompt],
                  strengths: list[float], settings: Settings, model: str, table,
                  losses: dict[int, dict[str, float]] | None = None, progress=None) -> list[Grid]:
    """One XY grid per prompt: a row per checkpoint, a column per strength. Cells already in RUN/compare/
    are read from there; the others are rendered (one checkpoint loaded at a time) and stored."""
    from PIL import Image

    cfg = load_config(run_dir / "config.toml")
    cache = run_dir / CACHE_DIR
    resolved = [settings.resolve(p) for p in prompts]
    cells = {(c, s, i): cache / f"{_cell_key(c, s, p, model)}.png" for c in checkpoints for s in strengths
             for i, p in enumerate(resolved)}
    todo = [k for k, path in cells.items() if not path.is_file()]
    done = 0
    for ck in checkpoints:
        mine = [k for k in todo if k[0] == ck]
        if not mine:
            continue
        pipe.load_lora_weights(str(_loadable(ck, run_dir, cfg, table)), adapter_name=ADAPTER_NAME)
        try:
            for _, s, i in mine:
                pipe.set_adapters([ADAPTER_NAME], adapter_weights=[s])
                p = resolved[i]
                image = render(pipe, [p], seed=p.seed, steps=p.steps, guidance=p.guidance, width=p.width,
                               height=p.height, negative=p.negative or None)[0]
                save_png(image, cells[(ck, s, i)])
                done += 1
                if progress is not None:
                    progress(done / len(todo), f"{ck.label} at strength {s:g}")
        finally:
            pipe.unload_lora_weights()
    out = []
    for i, p in enumerate(resolved):
        images, labels = [], []
        columns = "strength " + " | ".join(f"{s:g}" for s in strengths)
        for ck in checkpoints:
            loss = (losses or {}).get(ck.step, {})
            shown = next((f"{k} loss {loss[k]:.4f}" for k in ("validation", "eval", "train") if k in loss), "")
            for s in strengths:
                im = Image.open(cells[(ck, s, i)]).convert("RGB")
                if min(im.size) < GRID_CELL:  # small renders are enlarged, so the labels above them fit
                    f = GRID_CELL / min(im.size)
                    im = im.resize((round(im.size[0] * f), round(im.size[1] * f)), Image.Resampling.NEAREST)
                images.append(im)
                # One label across each row (grid() writes a row's shared label once).
                labels.append(" · ".join(filter(None, [ck.label, shown, columns])))
        keys = "".join(cells[(c, s, i)].stem for c in checkpoints for s in strengths)
        path = cache / f"grid-{hashlib.sha256(keys.encode()).hexdigest()[:24]}.png"
        if not path.is_file():
            save_png(grid(images, cols=len(strengths), labels=labels), path)
        n = len(checkpoints) * len(strengths)
        fresh = sum(1 for k in todo if k[2] == i)
        out.append(Grid(path, p.prompt, n - fresh, fresh))
    return out


def export_checkpoint(run_dir: Path, ck: Checkpoint, strength: float, fmt: str, out: Path, table, *,
                      title: str | None = None, overwrite: bool = False) -> Path:
    """Write checkpoint `ck` at `strength` as kohya or diffusers; never over an existing file unless asked."""
    if fmt not in ("kohya", "diffusers"):
        raise AdapterError(f"format {fmt!r}: kohya or diffusers")
    cfg = load_config(run_dir / "config.toml")
    adapter = at_strength(adapter_of(ck, run_dir, cfg, table), strength)
    final = final_adapter(run_dir)
    carried = dict(load_adapter(final, table).metadata) if final is not None and not ck.final else {}
    title = title or out.name.split(".")[0]
    meta = {**carried, **adapter.metadata, "modelspec.title": title, "ss_output_name": title,
            "sdxl_lora.steps": str(ck.step),
            "sdxl_lora.strength": f"{strength:g}"}
    if "ss_steps" in meta:
        meta["ss_steps"] = str(ck.step)
    return export_adapter(adapter, out, fmt, metadata=meta, unet_config=table.unet_config, overwrite=overwrite)

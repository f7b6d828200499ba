"""Choosing a run's result by eye: each saved checkpoint's fixed-seed renders at a few strengths as one XY
grid (rows the checkpoints, columns the strengths), cached in the run folder, with the losses logged at each
checkpoint's step; and the chosen checkpoint written out at the chosen strength (kohya or diffusers).

A run's checkpoints are its saved training states (checkpoints/step-N/adapter.safetensors: the trained
weights by parameter name, without their alphas) and its final adapter. A state's scales (alpha / rank) are
a LoRA or DoRA run's final diffusers adapter's (the same layers), else the planner's for the run's config.

A strength s multiplies a layer's update as the loaders apply it: LoRA's, LoHa's and LoKr's are W + s * delta,
so an export at s is the layer with its update scaled (`at_strength`); DoRA's blends the base and the trained
weight (export.weight_with), which no DoRA file holds at another strength. Every kind renders merged into the
pipeline's weights at each strength, as `sdxl-lora merge` does, and taken out again; with the run's preview
sampler (preview.Sampler), a prompt's unset negative prompt left unset: a cell is the image the run's previews,
the Generate tab and `sdxl-lora generate` draw for the same checkpoint and settings.

Cache: RUN/compare/ holds one PNG per cell, named by a digest of what decides the image (the checkpoint's
weights, the strength, the prompt with its kohya options, seed, steps, size, guidance, the sampler, the base
model) and the grids.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..core.checkpoint import CheckpointError, complete_states, file_sha256, verify
from ..core.config import Config, load_config
from ..core.inject import lora_scale
from ..core.runs import read_events
from .formats import lycoris
from .formats.export import Adapter, AdapterError, LoraLayer, export_adapter, load_adapter, peft_key_groups
from .formats.merge import merged
from .preview import PreviewPrompt, Sampler, grid, parse_prompt_line, render, save_png

log = logging.getLogger(__name__)

STRENGTHS = (0.5, 0.75, 1.0)
CACHE_DIR = "compare"
GRID_CELL = 192  # px: the smallest cell side in a grid image
# A state's parameter names: the UNet's bare (a run that trains only the UNet) or each model's under its name.
_STATE_PREFIXES = {"": "unet", "unet.": "unet", "text_encoder.": "text_encoder", "text_encoder_2.": "text_encoder_2"}


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
    """Each layer's alpha / rank as training scaled it: a LoRA or DoRA run's final diffusers adapter's, else the
    planner's for the run's config (the text encoders' at the UNet's ratio). LoHa and LoKr runs have no
    diffusers file, and their kohya file folds an unfactored LoKr layer's scale into its factor: the planner's."""
    final = run_dir / f"{run_dir.name}.diffusers.safetensors"
    if final.is_file():
        return {k: lay.alpha / lay.rank for k, lay in load_adapter(final, table).layers.items()
                if isinstance(lay, LoraLayer)}
    from .plan import plan_config, text_encoder_rank_alpha

    plan = plan_config(cfg).plan
    out = {f"unet.{n}": lora_scale(plan.alpha[n], plan.rank[n], cfg.adapter.rslora) for n in plan.rank}
    rank, alpha = text_encoder_rank_alpha(cfg.adapter)
    for comp in ("text_encoder", "text_encoder_2"):
        out.update({f"{comp}.{m}": lora_scale(alpha, rank, cfg.adapter.rslora) for m in table.layers.get(comp, {})})
    return out


def state_adapter(ck: Checkpoint, run_dir: Path, cfg: Config, table) -> Adapter:
    """A saved state's trained weights as an `Adapter`: each layer read at scale 1 (LoRA with alpha = rank,
    LoHa and LoKr as their loaders read factors without an alpha), then given the scale training used."""
    from safetensors.torch import load_file

    tensors = load_file(str(ck.path / "adapter.safetensors"))
    groups = peft_key_groups(tensors, _STATE_PREFIXES, adapter_name="default")
    if not groups:
        raise AdapterError(f"{ck.path.name}: no adapter weights in its adapter.safetensors (a {cfg.adapter.kind} "
                           "run); compare its final adapter instead")
    scales = _scales(run_dir, cfg, table)
    layers = {}
    for (comp, module), names in groups.items():
        key = f"{comp}.{module}"
        if key not in scales:
            raise AdapterError(f"{ck.path.name}: layer {key} is not in the run's adapter plan; was the state saved by "
                               "another run?")
        parts = {part: tensors[name] for part, name in names.items()}
        try:
            if "lora_A.weight" in parts:
                down, up, mag = parts["lora_A.weight"], parts["lora_B.weight"], parts.get("lora_magnitude_vector")
                layer = LoraLayer(down, up, float(down.shape[0]), None if mag is None else mag.reshape(-1),
                                  parts.get("lora_B.bias"))
            else:
                layer = lycoris.from_keys(parts, None, table.shape(comp, module))
        except (KeyError, ValueError) as e:
            raise AdapterError(f"{ck.path.name}: layer {key} is incomplete ({e}); compare the run's other checkpoints "
                               "or its final adapter") from None
        layers[key] = layer.scaled(scales[key])
    return Adapter(layers, format="state")


def adapter_of(ck: Checkpoint, run_dir: Path, cfg: Config, table) -> Adapter:
    return load_adapter(ck.path, table) if ck.final else state_adapter(ck, run_dir, cfg, table)


def at_strength(adapter: Adapter, strength: float) -> Adapter:
    """The adapter that gives at strength 1 what this one gives at `strength`, each layer's update scaled."""
    if strength == 1:
        return adapter
    dora = sorted(k for k, lay in adapter.layers.items() if lay.magnitude is not None)
    if dora:
        raise AdapterError(f"strength {strength:g}: a DoRA adapter ({len(dora)} layers, e.g. {dora[0]}) takes its "
                           "strength in the loader, which blends the base and the trained weight; no DoRA file holds "
                           "that blend. Export at strength 1 and set the strength where you load it")
    return dataclasses.replace(adapter, layers={k: lay.scaled(strength) for k, lay in adapter.layers.items()})


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
        """The prompt with every unset option the run's, but the negative prompt: unset stays unset (no negative
        prompt), as the previews, Generate and `sdxl-lora generate` render it."""
        return PreviewPrompt(p.prompt, p.negative, int(p.width or self.size), int(p.height or self.size),
                             int(p.steps or self.steps), float(self.guidance if p.guidance is None else p.guidance),
                             int(self.seed if p.seed is None else p.seed))


@dataclass
class Grid:
    path: Path                 # the XY grid image of one prompt
    prompt: str
    cached: int                # cells read from the cache
    rendered: int              # cells rendered now


def _cell_key(ck: Checkpoint, strength: float, p: PreviewPrompt, model: str, sampler: Sampler) -> str:
    what = {"weights": ck.digest, "strength": strength, "prompt": dataclasses.asdict(p), "model": model,
            "sampler": dataclasses.asdict(sampler), "applied": "merged"}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]


@contextmanager
def _applied(pipe, ck: Checkpoint, run_dir: Path, cfg: Config, table):
    """Yields at(strength): checkpoint `ck` merged into the pipeline's weights at that strength (every kind, as the
    run's previews merge the adapter being trained); the pipeline is as it was after."""
    with merged(pipe, adapter_of(ck, run_dir, cfg, table)) as merge:
        yield merge


def compare_grids(pipe, run_dir: Path, checkpoints: list[Checkpoint], prompts: list[PreviewPrompt],
                  strengths: list[float], settings: Settings, model: str, table,
                  losses: dict[int, dict[str, float]] | None = None, progress=None) -> list[Grid]:
    """One XY grid per prompt: a row per checkpoint, a column per strength. Cells already in RUN/compare/
    are read from there; the others are rendered (one checkpoint loaded at a time) and stored."""
    from PIL import Image

    cfg = load_config(run_dir / "config.toml")
    cache = run_dir / CACHE_DIR
    resolved = [settings.resolve(p) for p in prompts]
    sampler = Sampler.of_run(cfg)
    cells = {(c, s, i): cache / f"{_cell_key(c, s, p, model, sampler)}.png" for c in checkpoints for s in strengths
             for i, p in enumerate(resolved)}
    todo = [k for k, path in cells.items() if not path.is_file()]
    done = 0
    for ck in checkpoints:
        mine = [k for k in todo if k[0] == ck]
        if not mine:
            continue
        with _applied(pipe, ck, run_dir, cfg, table) as at:
            for _, s, i in mine:
                at(s)
                p = resolved[i]
                image = render(pipe, [p], seed=p.seed, steps=p.steps, guidance=p.guidance, width=p.width,
                               height=p.height, sampler=sampler)[0]
                save_png(image, cells[(ck, s, i)])
                done += 1
                if progress is not None:
                    progress(done / len(todo), f"{ck.label} at strength {s:g}")
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
    return export_adapter(adapter, out, fmt, metadata=meta, unet_config=table.unet_config, overwrite=overwrite,
                          reads=(ck.path, final))

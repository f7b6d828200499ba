"""The three folders the UI may touch (datasets, models, runs) and the one check every path goes through.

The page sends paths typed or picked by a person; each is resolved against its folder and refused when
it lands outside: by ``..``, an absolute path elsewhere, backslashes (read as separators, as Windows
writes them), or a symlink inside the folder that leads out of it. A path that looks URL-encoded
(``%2e%2e%2f``) is refused rather than guessed at: no layer of the page decodes it, and none may.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# The built-in models' names come from the task configs: importing sdxl.demo.tiny or llm.tiny would pull in
# torch, which the page does not need until it trains, renders or plans.
from sdxl_lora.llm.config import TINY_LLM
from sdxl_lora.sdxl.config import DEMO_NAME, TINY_NAME
from sdxl_lora.sdxl.images import IMAGE_EXTENSIONS


def is_builtin(model: str) -> bool:
    """The shipped demo base or the random-weights tiny SDXL: made by the package, in no folder of the page."""
    return model in (DEMO_NAME, TINY_NAME)


class PathRefused(ValueError):
    """A path outside the folders the UI was given; the message names both."""


# The encoded forms of '.', '/', '\\' and '%' itself (a double encoding).
_ENCODED = re.compile(r"%(2e|2f|5c|25)", re.IGNORECASE)


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


@dataclass(frozen=True)
class Folders:
    datasets: Path
    models: Path
    runs: Path

    @classmethod
    def create(cls, datasets: str | Path, models: str | Path, runs: str | Path) -> "Folders":
        f = cls(*(Path(os.path.abspath(os.path.expanduser(str(p)))) for p in (datasets, models, runs)))
        if not f.datasets.is_dir():
            raise FileNotFoundError(f"--datasets {f.datasets}: no such folder; give the folder that holds "
                                    "your datasets (one subfolder each)")
        f.models.mkdir(parents=True, exist_ok=True)
        f.runs.mkdir(parents=True, exist_ok=True)
        return f

    @property
    def ui(self) -> Path:
        """The UI's own bookkeeping (queue, launch configs, console logs, gradio's cache), inside runs/."""
        return self.runs / ".ui"

    def model(self, choice: str) -> str:
        """What a model field's choice names for the loaders: a built-in model's name as it is, else the path
        inside the models folder."""
        return choice if is_builtin(choice) else str(self.inside(choice, "models"))

    def inside(self, path: str | Path, kind: str) -> Path:
        """`path` (absolute, or relative to the folder of `kind`) as an absolute path inside that folder, its
        symlinks resolved inside it too. Every path the page sends goes through here."""
        root: Path = getattr(self, kind)
        raw = str(path).strip()
        if not raw:
            raise PathRefused(f"no path given; pick one under the {kind} folder {root}")
        if _ENCODED.search(raw):
            raise PathRefused(f"{raw} looks URL-encoded (%2e, %2f, %5c); give the path as it is on disk, under "
                              f"the {kind} folder {root}")
        p = Path(os.path.expanduser(raw.replace("\\", "/")))
        full = Path(os.path.abspath(p if p.is_absolute() else root / p))
        if not _within(full, root):
            raise PathRefused(f"{raw} is outside the {kind} folder {root}; pick one from the list: this UI reads and "
                              f"writes only under the folders it was started with (to use another {kind} folder, "
                              f"start the UI again with --{kind} naming it)")
        real = Path(os.path.realpath(full))
        if not _within(real, Path(os.path.realpath(root))):
            raise PathRefused(f"{raw} leads outside the {kind} folder {root} through a symlink (to {real}); this "
                              f"UI only reads and writes under its folders: start it with --{kind} naming the "
                              "real folder, or copy the files in")
        return full

    def run(self, name: str) -> Path:
        """A run's folder from its name, as the run pickers send it: one folder directly under runs/."""
        full = self.inside(name, "runs")
        if full.parent != self.runs or full.name.startswith("."):
            raise PathRefused(f"{name!r} is not a run name: a run is a folder directly under {self.runs} "
                              "(letters, digits, '-' and '_'; no '/' or leading '.')")
        return full


def image_folders(root: Path, limit: int = 500) -> list[str]:
    """Folders under `root` (itself included) that hold images, relative to root ('.' for root itself)."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if any(os.path.splitext(f)[1].lower() in IMAGE_EXTENSIONS for f in files):
            rel = os.path.relpath(folder, root)
            out.append(rel)
            if len(out) >= limit:
                break
    return sorted(out)


def model_choices(models: Path) -> list[str]:
    """What the model field offers: the shipped demo base ('tiny-sdxl-demo'), diffusers SDXL folders and
    single .safetensors checkpoints under the models folder (relative paths). A materialised copy of the
    random-weights tiny SDXL is not offered."""

    out = [DEMO_NAME]
    for folder, dirs, files in os.walk(models):
        here = Path(folder)
        if (here / "model_index.json").is_file():
            dirs[:] = []
            # "tiny-sdxl-v1-seed0": a materialised copy of the random-weights tiny SDXL (sdxl/demo/tiny.py).
            if not here.name.startswith("tiny-sdxl-v") and here != models:
                out.append(os.path.relpath(here, models))
            continue
        if "config.json" in files and here != models:  # a transformers model (an LLM), not an SDXL one
            dirs[:] = []
            continue
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "loras")
        for f in sorted(files):
            if f.endswith(".safetensors"):
                out.append(os.path.relpath(here / f, models))
    return out


def jsonl_files(root: Path, limit: int = 500) -> list[str]:
    """Instruction/chat data files (.jsonl) under root, relative to it."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [os.path.relpath(os.path.join(folder, f), root) for f in sorted(files) if f.endswith(".jsonl")]
        if len(out) >= limit:
            break
    return sorted(out)


def llm_model_choices(models: Path) -> list[str]:
    """The embedded tiny LM and transformers model folders (config.json, no model_index.json) under models."""
    out = [TINY_LLM]
    for folder, dirs, files in os.walk(models):
        here = Path(folder)
        if "config.json" in files and not (here / "model_index.json").exists() and here != models:
            dirs[:] = []
            if not here.name.startswith(f"{TINY_LLM}-v"):
                out.append(os.path.relpath(here, models))
            continue
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "loras")
    return out

"""Training states on disk: atomic saves with a checksum manifest, keep-last-K, and finding the newest
complete state to resume from.

A state is a folder checkpoints/step-NNNNNNNN/ holding
  adapter.safetensors   the trainable weights, by parameter name
  optimizer.pt          the optimizer's state (tensors and numbers only: loaded with weights_only=True)
  trainer.pt            step, epoch, position in the epoch, LR schedule, RNG states, the task's state
  manifest.json         sha256 of each file above; written last, so a folder without it is incomplete
It is written under a temporary name, every file fsynced, then renamed into place.

Accelerate's save_state is not used: it writes the whole model (2.6 B frozen UNet parameters for a
LoRA of a few MB) and writes in place, so a crash mid-save leaves a torn state.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
import signal
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .fsutil import fsync_dir, naming_a_full_disk

log = logging.getLogger(__name__)

FILES = ("adapter.safetensors", "optimizer.pt", "trainer.pt")
# What every optimizer.pt and trainer.pt this program writes holds (a trainer.pt may hold more: EMA, identity).
KEYS = {"optimizer.pt": ("state", "param_groups"), "trainer.pt": ("step", "epoch", "position", "schedule", "rng")}
_PREFIX = "step-"


class CheckpointError(RuntimeError):
    pass


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


# Fault injection for the durability and fault tests only: SDXL_LORA_TEST_KILL="save:6" kills this process
# with SIGKILL half-way through writing the state of step 6, "step:10" in the middle of step 10 (after the
# backward pass, before the optimizer step): no clean-up can run, as in a power cut. "POINT:N@SIGTERM" sends
# that signal instead, a stop request whose handling is under test. The points: save, step, cache (after
# the Nth cache entry), preview (before the previews of step N: 0 is the first), export (before the final one).
_KILL_AT = os.environ.get("SDXL_LORA_TEST_KILL")


def test_fault(point: str, step: int) -> None:
    if _KILL_AT is None:
        return
    at, _, sig = _KILL_AT.partition("@")
    if at == f"{point}:{step}":
        os.kill(os.getpid(), getattr(signal, sig) if sig else signal.SIGKILL)


# SDXL_LORA_TEST_OOM="3": step 3 fails as a GPU's allocator does when it runs out of memory (the loop's
# save-and-stop test on a machine without one).
_OOM_AT = os.environ.get("SDXL_LORA_TEST_OOM")


def oom_fault(step: int) -> None:
    if _OOM_AT is not None and step == int(_OOM_AT):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a test's fault)")


# SDXL_LORA_TEST_NAN="1:3": from step 3 on, process 1's loss is NaN (the NaN guard's several-process test).
_NAN_AT = os.environ.get("SDXL_LORA_TEST_NAN")


def nan_fault(loss: torch.Tensor, step: int, process: int) -> torch.Tensor:
    if _NAN_AT is not None:
        rank, first = (int(x) for x in _NAN_AT.split(":"))
        if process == rank and step >= first:
            return loss * float("nan")
    return loss


def save_state(root: Path, step: int, adapter: dict[str, torch.Tensor], optimizer_state: dict,
               trainer_state: dict[str, Any], keep: int) -> Path:
    """Write the state of `step` atomically; then drop older states beyond `keep`, but only after the
    new one reads back complete."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{step:08d}"
    tmp = root / f".tmp-{_PREFIX}{step:08d}"
    clear_unfinished(root)
    tmp.mkdir()
    try:
        with naming_a_full_disk(final):  # before the clean-up, which frees the space whose lack says "disk full"
            save_file({k: v.detach().to("cpu").contiguous() for k, v in adapter.items()}, str(tmp / FILES[0]))
            test_fault("save", step)
            torch.save(optimizer_state, tmp / FILES[1])
            torch.save(trainer_state, tmp / FILES[2])
            manifest = {"step": step, "files": {}}
            for name in FILES:
                _fsync_file(tmp / name)
                manifest["files"][name] = file_sha256(tmp / name)
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
            _fsync_file(tmp / "manifest.json")
            fsync_dir(tmp)
    except Exception:
        # Nothing half-written stays; the states saved before are untouched.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)  # an older state of the same step (a resumed run re-saving it)
    os.replace(tmp, final)
    fsync_dir(root)
    verify(final)
    for old in complete_states(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def clear_unfinished(root: Path) -> list[Path]:
    """Remove the states whose save was interrupted (a crash mid-save) from `root`: they are never complete,
    and only the process that trains the run saves, so at its saves and at its start none is being written."""
    stale = sorted(root.glob(f".tmp-{_PREFIX}*"))
    for path in stale:
        shutil.rmtree(path)
    return stale


def verify(state: Path) -> dict:
    """The manifest, if every file is present with its checksum; CheckpointError naming what is wrong otherwise."""
    mf = state / "manifest.json"
    if not mf.is_file():
        raise CheckpointError(f"{state} has no manifest.json (a save that did not finish)")
    try:
        manifest = json.loads(mf.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mf} is unreadable: {e}") from e
    for name, digest in manifest.get("files", {}).items():
        f = state / name
        if not f.is_file():
            raise CheckpointError(f"{f} is missing")
        if file_sha256(f) != digest:
            raise CheckpointError(f"{f} does not match its checksum (truncated or corrupted)")
    return manifest


def complete_states(root: Path) -> list[Path]:
    """State folders by step, newest first (by name; completeness is checked by `newest_valid`)."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)),
                  key=lambda p: p.name, reverse=True)


def newest_valid(root: Path) -> Path | None:
    """The newest state that verifies and reads back (load_state); each newer one that does not is skipped
    with a warning naming it."""
    for state in complete_states(root):
        try:
            load_state(state)
            return state
        except CheckpointError as e:
            log.warning("skipping checkpoint %s: %s", state.name, e)
    return None


def load_state(state: Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """The state's adapter, optimizer state and trainer state. CheckpointError naming the file when one does
    not read back as this program writes it: the checksums only show that the files are the ones the
    manifest lists, and a file put there with a matching manifest (or damaged before it was summed) is
    refused like a torn one."""
    verify(state)
    try:
        adapter = load_file(str(state / FILES[0]))
    except SafetensorError as e:
        raise CheckpointError(f"{state / FILES[0]} is not a readable safetensors file ({e})") from None
    # weights_only: these files come from the run's own folder, and still no pickle code runs.
    loaded = []
    for name in FILES[1:]:
        try:
            obj = torch.load(state / name, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, EOFError, RuntimeError) as e:
            cause = str(e).strip().splitlines()[0].split(". ")[0][:160] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"{state / name} is not a training state this program wrote ({cause}); "
                                  "it was not loaded") from None
        if not isinstance(obj, dict) or any(k not in obj for k in KEYS[name]):
            raise CheckpointError(f"{state / name} does not hold a training state (it lacks "
                                  f"{', '.join(k for k in KEYS[name] if not isinstance(obj, dict) or k not in obj)})")
        loaded.append(obj)
    return adapter, loaded[0], loaded[1]

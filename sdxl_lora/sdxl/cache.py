"""A content-addressed on-disk cache of tensors (VAE latents, text embeddings) as safetensors files.

A key is a hash of everything the tensors depend on (the image's bytes, bucket, crop, flip, the
model's identity...), so an edited image or another model simply misses and is recomputed, and
nothing stale is ever served. Each entry is written atomically, so an interrupted cache build
resumes where it stopped; an unreadable or corrupt entry counts as missing and is rewritten.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tqdm.auto import tqdm

from sdxl_lora.core.checkpoint import test_fault
from sdxl_lora.core.fsutil import atomic_save

log = logging.getLogger(__name__)

_KEY = re.compile(r"^[0-9A-Za-z_-]{8,128}$")


def file_digest(path: str | Path) -> str:
    """sha256 of the file's bytes, hex: the image's identity, whatever its name or timestamp."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def component_identity(model_path: Path, component: str) -> str:
    """Identifies a model component's weights for cache keys: path, sizes and mtimes of its files.
    Cheap (no hashing of gigabytes) and changes whenever the weights are replaced."""
    root = model_path / component if model_path.is_dir() else model_path
    files = sorted(root.rglob("*")) if root.is_dir() else [root]
    h = hashlib.sha256(str(root.resolve()).encode())
    for f in files:
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _plain(part):
    if isinstance(part, (str, int, float, bool)) or part is None:
        return part
    if isinstance(part, Path):
        return str(part)
    if isinstance(part, (tuple, list)):
        return [_plain(p) for p in part]
    raise TypeError(f"cache_key part {part!r} is a {type(part).__name__}; use strings, numbers or tuples of them")


def cache_key(*parts) -> str:
    """A stable hash (sha256 hex) of the parts: the same parts give the same key in every process."""
    # JSON keeps types apart ("1" vs 1) and, unlike hash(), does not change between interpreter runs.
    blob = json.dumps([_plain(p) for p in parts], separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class TensorCache:
    """Tensors stored under root/<key[:2]>/<key>.safetensors; get() gives None for anything not usable."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        if not _KEY.match(key):
            raise ValueError(f"cache key {key!r} is not a cache_key() hash")
        # Two-character shards keep folders small for datasets of many thousand images.
        return self.root / key[:2] / f"{key}.safetensors"

    def __contains__(self, key: str) -> bool:
        """Whether an entry exists (without reading it; get() still checks it is intact)."""
        return self.path(key).is_file()

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (SafetensorError, OSError, ValueError) as e:
            log.warning("cache entry %s is unreadable (%s); it will be recomputed", path, e)
            return None
        # The stored digest catches bytes damaged after a complete write (a header parse would not).
        if meta.get("key") != key or meta.get("sha256") != _tensors_digest(tensors):
            log.warning("cache entry %s does not match its key or content; it will be recomputed", path)
            return None
        return tensors

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        path = self.path(key)
        clean = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        meta = {"key": key, "sha256": _tensors_digest(clean)}
        atomic_save(path, lambda tmp: save_file(clean, str(tmp), metadata=meta))

    def fill(self, keys: list[str], compute: Callable[[str], dict[str, torch.Tensor]], *, desc: str,
             process_index: int = 0, num_processes: int = 1, show: bool = True, poll_s: float = 0.5) -> int:
        """Make sure every key has an entry, with several processes sharing the work; returns how many
        entries this process computed (compute(key) makes the entry of key).

        Process p owns unique keys p, p + n, p + 2n... (n = num_processes): balanced shares that need no talk
        between processes. Each computes the entries it owns and lacks, then waits (polling the
        folder) until every other entry is readable. Waiting by polling, not by one collective
        barrier, means no NCCL/gloo timeout however long the others take; if a process dies, the
        launcher stops the run.
        """
        keys = list(dict.fromkeys(keys))  # unique, in order: the same list in every process
        mine = [i for i in range(process_index, len(keys), num_processes) if self.get(keys[i]) is None]
        for n, i in enumerate(tqdm(mine, desc=desc, unit="entry", disable=not show or not mine), 1):
            self.put(keys[i], compute(keys[i]))
            test_fault("cache", n)
        if num_processes > 1:
            self._wait([k for i, k in enumerate(keys) if i % num_processes != process_index], desc, show, poll_s)
        return len(mine)

    def _wait(self, keys: list[str], desc: str, show: bool, poll_s: float) -> None:
        pending = [k for k in keys if k not in self or self.get(k) is None]
        bar = tqdm(total=len(keys), initial=len(keys) - len(pending), desc=f"{desc} (other processes)",
                   unit="entry", disable=not show or not pending)
        last_progress = time.monotonic()
        while pending:
            # Entries are renamed into place whole, so one that exists and reads back is final.
            still = [k for k in pending if k not in self or self.get(k) is None]
            if len(still) < len(pending):
                bar.update(len(pending) - len(still))
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > 600:
                log.warning("%s: still waiting for %d entries from other processes (none new for 10 minutes) "
                            "in %s; if a process has died, stop the run", desc, len(still), self.root)
                last_progress = time.monotonic()
            pending = still
            if pending:
                time.sleep(poll_s)
        bar.close()

"""The CUDA caching allocator's options, chosen at launch before torch's first CUDA allocation (torch reads
them once). Free of torch, so that a command can set them before anything imports it."""
from __future__ import annotations

import os
import sys
from pathlib import Path

# The variables torch reads its allocator's options from: the unified name (torch 2.10 on) and the CUDA one.
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def allocator_setting(environ: dict | None = None) -> str | None:
    """The allocator options the process runs with (the user's or prefer_expandable_segments'), else None."""
    environ = os.environ if environ is None else environ
    return next((environ[k] for k in ALLOC_CONF_VARS if environ.get(k)), None)


def prefer_expandable_segments(environ: dict | None = None) -> str | None:
    """Has PyTorch's CUDA allocator grow its memory segments in place (`expandable_segments:True`) unless
    the allocator's options are already set; returns the variable it set, else None. Fixed-size segments
    leave gaps between a step's differently sized tensors (and beside CUDA graphs' pools) that count as
    reserved memory the run cannot use; expandable ones map pages as needed. Left alone where the driver's
    virtual-memory calls it needs fail (Windows, WSL, Jetson). Must run before torch's first CUDA
    allocation: the allocator reads the variable once. The memory cap (train.vram_gb, a memory fraction)
    still holds: torch checks the fraction before it maps more pages (c10/cuda/CUDACachingAllocator.cpp,
    alloc_block)."""
    environ = os.environ if environ is None else environ
    if any(k in environ for k in ALLOC_CONF_VARS):
        return None
    if (sys.platform != "linux" or "microsoft" in os.uname().release.lower()
            or Path("/etc/nv_tegra_release").exists()):
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(x) for x in version("torch").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return None
    # torch reads PYTORCH_ALLOC_CONF from 2.10 on (and warns that the CUDA-only name is deprecated).
    key = "PYTORCH_ALLOC_CONF" if (major, minor) >= (2, 10) else "PYTORCH_CUDA_ALLOC_CONF"
    environ[key] = "expandable_segments:True"
    return key

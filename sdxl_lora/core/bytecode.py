"""Whether this process imported the heavy packages from their sources because Python may not keep byte-code.

Some container images set PYTHONDONTWRITEBYTECODE and install packages without their compiled byte-code: every
process then compiles the sources of torch, diffusers and transformers again before it can do anything, seconds
of every launch (docs/speed.md). Python reads byte-code that exists whatever the variable says, so only the two
together cost time, and only that case is reported."""
from __future__ import annotations

import importlib.util
import os
import sys

# The packages whose import dominates a launch.
HEAVY = ("torch", "diffusers", "transformers", "peft")


def compiled_from_source(modules: tuple[str, ...] = HEAVY) -> list[str]:
    """The imported packages among `modules` that had no byte-code to read and could keep none: Python runs with
    byte-code writing off (PYTHONDONTWRITEBYTECODE, -B) and the package's compiled file does not exist."""
    if not sys.dont_write_bytecode:
        return []
    names = []
    for name in modules:
        # From the source file: the lazy modules transformers and diffusers put in sys.modules carry no __cached__.
        source = getattr(sys.modules.get(name), "__file__", None)
        if source and source.endswith(".py") and not os.path.exists(importlib.util.cache_from_source(source)):
            names.append(name)
    return names


def advice(names: list[str]) -> str:
    """The run log's warning for compiled_from_source's packages: what it costs and how to fix it."""
    return (f"{', '.join(names)} imported from source: Python writes no byte-code here (PYTHONDONTWRITEBYTECODE "
            "or -B) and the packages hold none, so every launch compiles them again before training starts. "
            "For faster launches unset PYTHONDONTWRITEBYTECODE, and where the packages' folders are read-only also "
            "set PYTHONPYCACHEPREFIX to a writable folder (docs/speed.md)")

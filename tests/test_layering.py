"""The layers DESIGN.md promises, read from the source: the core (sdxl_lora/core) knows no task, no
diffusers and no front end; a task (sdxl_lora/sdxl, sdxl_lora/llm) knows neither the other task nor a
front end; the UI drives the library, never the CLI. Every import counts, the ones inside functions too,
so a new violation fails here with the file and line that made it."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sdxl_lora"

FRONT_ENDS = ("sdxl_lora.cli", "sdxl_lora.commands", "sdxl_lora.ui")  # commands: the CLI's groups
RULES = {
    # layer -> modules (and their submodules) it must not import
    "sdxl_lora.core": ("sdxl_lora.sdxl", "sdxl_lora.llm", "sdxl_lora.training", "diffusers", *FRONT_ENDS),
    "sdxl_lora.sdxl": ("sdxl_lora.llm", "sdxl_lora.training", *FRONT_ENDS),
    "sdxl_lora.llm": ("sdxl_lora.sdxl", "sdxl_lora.training", *FRONT_ENDS),
    "sdxl_lora.ui": ("sdxl_lora.cli", "sdxl_lora.commands"),
}


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, name: str) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in the file (module `name`), relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` may import a submodule: count pkg.sub too.
            out += [(node.lineno, mod)] + [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


def violations(package: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        mod = module_name(path, package)
        for layer, banned in RULES.items():
            if mod != layer and not mod.startswith(layer + "."):
                continue
            seen = set()
            for line, imported in imports(path, mod):
                hit = next((b for b in banned if imported == b or imported.startswith(b + ".")), None)
                if hit and (line, hit) not in seen:
                    seen.add((line, hit))
                    found.append(f"{path.relative_to(package.parent)}:{line}: {mod} imports {imported} "
                                 f"({layer} must not import {hit})")
    return sorted(found)


def test_each_layer_imports_only_what_is_below_it():
    assert violations() == []


def test_the_check_sees_a_violation_inside_a_function(tmp_path):
    # A lazy import in a core module is still a dependency: the check must report it.
    fake = tmp_path / "sdxl_lora"
    (fake / "core").mkdir(parents=True)
    (fake / "core" / "bad.py").write_text("def f():\n    from ..sdxl import task\n    import diffusers\n")
    (fake / "ui").mkdir()
    (fake / "ui" / "tab.py").write_text("from sdxl_lora.cli import main\n")
    found = violations(fake)
    assert any("core/bad.py:2" in v and "must not import sdxl_lora.sdxl" in v for v in found), found
    assert any("core/bad.py:3" in v and "must not import diffusers" in v for v in found), found
    assert any("ui/tab.py:1" in v and "must not import sdxl_lora.cli" in v for v in found), found

"""The layers DESIGN.md promises, read from the source: the core (sdxl_lora/core) knows no task, no
diffusers and no front end; a task (sdxl_lora/sdxl, sdxl_lora/llm) knows neither the other task nor a
front end; the UI drives the library, never the CLI; and no modules import each other in a circle. Every import
counts, the ones inside functions too, so a new violation fails here with the file and line that made it."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "sdxl_lora"

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


def fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package named sdxl_lora under tmp_path holding `files` (path inside it -> source)."""
    root = tmp_path / "sdxl_lora"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_each_layer_imports_only_what_is_below_it():
    assert violations() == []


def test_the_check_sees_a_violation_inside_a_function(tmp_path):
    # A lazy import in a core module is still a dependency: the check must report it.
    found = violations(fake_package(tmp_path, {
        "core/bad.py": "def f():\n    from ..sdxl import task\n    import diffusers\n",
        "ui/tab.py": "from sdxl_lora.cli import main\n"}))
    assert any("core/bad.py:2" in v and "must not import sdxl_lora.sdxl" in v for v in found), found
    assert any("core/bad.py:3" in v and "must not import diffusers" in v for v in found), found
    assert any("ui/tab.py:1" in v and "must not import sdxl_lora.cli" in v for v in found), found


# Import circles allowed, each exactly as found (its modules): none. A circle is a sign that a module holds
# what belongs to two jobs; cut it (a name moved to the module that owns it) rather than list it here.
CIRCLE_EXCEPTIONS: set[frozenset[str]] = set()


def import_graph(package: Path = PACKAGE) -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    """Each module of the package -> {module of the package it imports: the first line that does}, with every
    import counted (imports()), and each module's file."""
    paths = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    graph = {}
    for mod, path in paths.items():
        edges: dict[str, int] = {}
        for line, imported in imports(path, mod):
            if imported in paths and imported != mod:
                edges.setdefault(imported, line)
        graph[mod] = edges
    return graph, paths


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """Tarjan's strongly connected components: modules that each reach every other through imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def shortest_cycle(graph: dict[str, dict[str, int]], start: str, within: set[str]) -> list[str]:
    """The shortest import path from `start` back to it inside one component: start, ..., start."""
    came_from = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]  # path runs v, ..., start
                if w in within and w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in no circle of {sorted(within)}")


def circles(package: Path = PACKAGE, exceptions=frozenset(CIRCLE_EXCEPTIONS)) -> list[str]:
    """Every import circle among the package's modules but the named exceptions: its files, and one cycle as
    the file and line of each import in it."""
    graph, paths = import_graph(package)
    found = []
    for component in strongly_connected(graph):
        if len(component) < 2 or frozenset(component) in exceptions:
            continue
        cycle = shortest_cycle(graph, min(component), component)
        where = lambda m: str(paths[m].relative_to(package.parent))  # noqa: E731
        steps = [f"{where(a)}:{graph[a][b]} imports {b}" for a, b in zip(cycle, cycle[1:])]
        found.append(f"import circle among {', '.join(sorted(where(m) for m in component))}: " + "; ".join(steps))
    return sorted(found)


def test_no_modules_import_each_other_in_a_circle():
    assert circles() == []


def test_the_check_sees_a_circle_through_a_function_level_import(tmp_path):
    # A lazy import that closes a circle still ties the two modules together: the check must report it, with
    # the files and the lines of the cycle.
    fake = fake_package(tmp_path, {
        "__init__.py": "", "sdxl/__init__.py": "", "sdxl/task.py": "from .images import scan\n",
        "sdxl/images.py": "import os\n\n\ndef scan():\n    from .task import load\n",
        "sdxl/loss.py": "from . import images\n"})  # loss imports into the circle, is not part of it
    found = circles(fake, exceptions=frozenset())
    assert found == ["import circle among sdxl_lora/sdxl/images.py, sdxl_lora/sdxl/task.py: "
                     "sdxl_lora/sdxl/images.py:5 imports sdxl_lora.sdxl.task; "
                     "sdxl_lora/sdxl/task.py:1 imports sdxl_lora.sdxl.images"], found
    assert circles(fake, exceptions={frozenset({"sdxl_lora.sdxl.images", "sdxl_lora.sdxl.task"})}) == []

"""No import loops between ftlayer's modules: the imports of every module of the
distribution (ftlayer, ftlayer.persistence, ftlayer.partitioners, ftlayer.integration),
at module level or inside functions, form a graph without cycles, so each layer can be
read, loaded and tested without the ones above it. Imports under TYPE_CHECKING are left
out (they never run), and so is a submodule's import of its own package (`from . import
x`: a package and its modules are one node's inside)."""

from __future__ import annotations

import ast
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
_PACKAGES = {
    "ftlayer": _ROOT / "ftlayer",
    "ftlayer.persistence": _ROOT / "persistence",
    "ftlayer.partitioners": _ROOT / "partitioners",
    "ftlayer.integration": _ROOT / "integration",
}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, base in _PACKAGES.items():
        for path in base.rglob("*.py"):
            parts = [p for p in path.relative_to(base).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    deps: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = {module} | {f"{module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            targets = {alias.name for alias in node.names}
        else:
            continue
        deps |= {t for t in targets if t in modules}
    # A submodule importing its own package (`from . import x`) is not a loop.
    return {d for d in deps if d != name and not name.startswith(d + ".")}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_back_through_others() -> None:
    modules = _modules()
    assert len(modules) > 100  # the whole distribution was found
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]

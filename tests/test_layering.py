"""The package's layering, read from the source with `ast` (imports inside functions included).

- The core (infokv_rag minus its service and integrations) imports nothing from the service, the
  integrations, the benchmarks, the examples or the tests. One exception: `infokv_rag.cli`, the
  command line, is the application's entry point and starts the service for `infokv-rag serve`.
- The kernels (kernels/, imported as infokv_rag.kernels) import nothing else of infokv_rag.
- No module of infokv_rag imports one that imports it back, directly or through others. Imports under
  `if TYPE_CHECKING:` are annotations only (never run) and do not count.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {
    "infokv_rag": ROOT / "infokv_rag",
    "infokv_rag.kernels": ROOT / "kernels",
    "infokv_rag.integrations": ROOT / "integrations",
}
OUTSIDE = ("benchmarks", "examples", "tests", "integrations", "kernels")
"""Top-level names the package must never import (kernels and integrations only as infokv_rag.*)."""
ENTRY_POINTS = {"infokv_rag.cli"}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, directory in PACKAGE_DIRS.items():
        for path in directory.rglob("*.py"):
            parts = path.relative_to(directory).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if package == "infokv_rag" and parts and parts[0] in ("kernels", "integrations"):
                continue
            modules[".".join((package, *parts))] = path
    return modules


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for alternative in child.orelse:
                yield from _import_nodes(alternative)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _import_nodes(child)


def imports_of(module: str) -> set[str]:
    """Absolute names `module` imports at run time; `from pkg import name` counts as pkg.name when that is a module."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            candidate = f"{base}.{alias.name}"
            found.add(candidate if candidate in MODULES else base)
    return found


GRAPH = {module: {name for name in imports_of(module) if name in MODULES} for module in MODULES}


def _core(module: str) -> bool:
    return not module.startswith(("infokv_rag.service", "infokv_rag.integrations")) and module not in ENTRY_POINTS


def test_the_modules_are_found() -> None:
    assert {
        "infokv_rag.engine",
        "infokv_rag.scorers.infokv",
        "infokv_rag.kernels.dispatch",
        "infokv_rag.integrations._common",
    } <= set(MODULES)


def test_the_core_imports_nothing_from_the_layers_above() -> None:
    above = ("infokv_rag.service", "infokv_rag.integrations", *OUTSIDE)
    offences = {
        module: sorted(
            name for name in imports_of(module) if name.startswith(tuple(f"{a}." for a in above)) or name in above
        )
        for module in MODULES
        if _core(module)
    }
    assert {module: names for module, names in offences.items() if names} == {}


def test_the_kernels_import_nothing_else_of_the_package() -> None:
    offences = {
        module: sorted(
            name
            for name in imports_of(module)
            if name.startswith("infokv_rag") and not name.startswith("infokv_rag.kernels")
        )
        for module in MODULES
        if module.startswith("infokv_rag.kernels")
    }
    assert {module: names for module, names in offences.items() if names} == {}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_one_that_imports_it_back() -> None:
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"a"}}) == [["a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []

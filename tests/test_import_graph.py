"""What may import what (DESIGN.md §9), read from the sources: no import
circles among Pagoda's modules, protocol/ imports no other Pagoda package,
and the HTTP routes (frontend/api/) never import engine_core.

Imports under `if TYPE_CHECKING:` do not run and are left out; imports
inside functions count (they run when the function does).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("engine_core", "frontend", "protocol", "kernels")


def module_files() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def imported_names(path: Path) -> set[str]:
    """Every absolute module (or module.attribute) name the file imports at run time."""
    names: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            test = node.test
            if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
            ):
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            names.update(alias.name for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            assert node.level == 0, f"{path}: relative import"
            base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)

    Visitor().visit(ast.parse(path.read_text()))
    return names


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {
        name: {m for m in imported_names(path) if m in modules and m != name}
        for name, path in modules.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
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


def test_no_import_circles() -> None:
    graph = import_graph()
    assert len(graph) > 50  # the scan found the packages
    assert circles(graph) == []


def test_circles_are_found() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_protocol_imports_no_other_package() -> None:
    for name, targets in import_graph().items():
        if name.startswith("protocol"):
            outside = {t for t in targets if not t.startswith("protocol")}
            assert not outside, f"{name} imports {outside}"


def test_http_routes_import_no_engine_core() -> None:
    for name, targets in import_graph().items():
        if name.startswith("frontend.api"):
            engine = {t for t in targets if t.startswith("engine_core")}
            assert not engine, f"{name} imports {engine}"

"""What may import what (DESIGN.md §9), read from the sources: no import
circles among Pagoda's modules, everything is imported under the `pagoda.`
namespace, protocol/ and kernels/ import no other Pagoda package, and the
HTTP routes (frontend/api/) never import engine_core.

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
            modules[".".join(("pagoda", *parts))] = path
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


def test_everything_imported_under_the_namespace() -> None:
    """`import engine_core` would load a second copy of a module beside
    `pagoda.engine_core`, and clash with other distributions' names."""
    for name, path in module_files().items():
        bare = {m for m in imported_names(path) if m.split(".")[0] in PACKAGES}
        assert not bare, f"{name} imports {bare}"


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_protocol_and_kernels_import_no_other_package() -> None:
    for name, targets in import_graph().items():
        for package in ("pagoda.protocol", "pagoda.kernels"):
            if _inside(name, package):
                outside = {t for t in targets if not _inside(t, package)}
                assert not outside, f"{name} imports {outside}"


def test_http_routes_import_no_engine_core() -> None:
    for name, targets in import_graph().items():
        if _inside(name, "pagoda.frontend.api"):
            engine = {t for t in targets if _inside(t, "pagoda.engine_core")}
            assert not engine, f"{name} imports {engine}"


def test_engine_core_reaches_workers_only_through_the_executor() -> None:
    """The torch-free core (scheduler, block manager, engine loop) names no
    worker, model, attention backend or weight loader: those are behind the
    executor (DESIGN.md §8)."""
    compute = [
        "pagoda.engine_core.worker",
        "pagoda.engine_core.models",
        "pagoda.engine_core.attention",
        "pagoda.engine_core.loaders",
        "pagoda.kernels",
    ]
    for name, targets in import_graph().items():
        if _inside(name, "pagoda.engine_core.core"):
            reached = {t for t in targets if any(_inside(t, c) for c in compute)}
            assert not reached, f"{name} imports {reached}"

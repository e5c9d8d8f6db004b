"""The Python package's modules point one way, as the server's do (tests/module_graph.rs): no
module of `python/src/gpu_flight` imports, through any chain of others, itself. Imports made
only for type checking (`if TYPE_CHECKING:`) count too: a module that needs another's type
there depends on it as much as one that calls it, and a protocol of its own says what it
needs instead (`_actions.Actions`, `_cudf.ExportView`)."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "python" / "src" / "gpu_flight"


def imported(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports, by module name (`_client`, `dask`, ...): a
    name the package itself exports (`from . import Client`) is an import of `__init__`."""
    names: set[str] = set()

    def of_package(aliases: list[ast.alias]) -> None:
        names.update(a.name if a.name in modules else "__init__" for a in aliases)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:  # from ._client import Client
                names.add(node.module.split(".")[0])
            elif node.level == 1 or node.module == "gpu_flight":  # from . import _cdata, _cuda
                of_package(node.names)
            elif node.module and node.module.startswith("gpu_flight."):
                names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[1] for a in node.names if a.name.startswith("gpu_flight."))
    return names


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle's modules, each found once from its first module in sorted order."""
    found: list[list[str]] = []
    seen: set[frozenset[str]] = set()

    def walk(start: str, at: str, path: list[str]) -> None:
        for next_module in sorted(graph.get(at, ())):
            if next_module == start:
                key = frozenset(path)
                if key not in seen:
                    seen.add(key)
                    found.append([*path, start])
            elif next_module not in path and next_module > start:
                walk(start, next_module, [*path, next_module])

    for start in sorted(graph):
        walk(start, start, [start])
    return found


def package_graph() -> dict[str, set[str]]:
    modules = {path.stem: path for path in PACKAGE.glob("*.py")}
    return {name: imported(path, set(modules)) & set(modules) for name, path in modules.items()}


def test_the_package_has_no_import_cycles() -> None:
    graph = package_graph()
    assert "_export" in graph["_client"], "the graph was not read"
    assert cycles(graph) == [], "\n".join(" -> ".join(cycle) for cycle in cycles(graph))


def test_a_cycle_through_type_checking_imports_is_found(tmp_path: pathlib.Path) -> None:
    # The check itself, on what the package looked like before its protocols.
    module = tmp_path / "_export.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import _cdata, _cudf\n"
        "if TYPE_CHECKING:\n"
        "    from ._client import Client\n"
    )
    assert imported(module, {"_cdata", "_cudf", "_client"}) == {"_cdata", "_cudf", "_client"}
    # A name the package exports comes from `__init__`, which imports every module.
    module.write_text("from gpu_flight import Client, _cdata\n")
    assert imported(module, {"_cdata", "_client"}) == {"__init__", "_cdata"}
    graph = {"_client": {"_export"}, "_export": {"_client", "_cudf"}, "_cudf": {"_export"}}
    assert cycles(graph) == [["_client", "_export", "_client"], ["_cudf", "_export", "_cudf"]]

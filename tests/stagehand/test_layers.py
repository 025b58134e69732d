"""The layers of the package, enforced on its import graph (docs/ARCHITECTURE.md draws them).

    app  ->  front door (torch_stagehand, api, report, config)  ->  compiler  ->  runtime  ->  kernels
         ->  environment (every layer reads its variables there; it imports nothing of the package)

A module may import its own layer and the layers below it, never one above;
inside the runtime, the slab file format and the precision registry do not
import the streaming engine (except `slab.loading`, which fills the host
store), and nothing in the package has an import cycle.
"""

from __future__ import annotations

import ast
import pathlib

import networkx as nx
from _helpers import ROOT

FOLDERS = {"stagehand": "torch_stagehand", "compiler": "torch_stagehand.compiler",
           "runtime": "torch_stagehand.runtime", "kernels": "torch_stagehand.kernels"}
LAYERS = ["torch_stagehand.environment", "torch_stagehand.kernels", "torch_stagehand.runtime", "torch_stagehand.compiler", "torch_stagehand",
          "torch_stagehand.app"]


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from package import module` imports the module; `from module import name`, the module.
            targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _layer(module: str) -> int:
    """The layer of the longest prefix that names the module."""
    matches = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return LAYERS.index(max(matches, key=len))


def _graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for target in _imports(name, path, modules):
            graph.add_edge(name, target)
    return graph


def test_no_module_imports_a_layer_above_its_own():
    graph = _graph()
    assert len(graph) > 40  # the walk found the package
    upward = [(a, b) for a, b in graph.edges if _layer(b) > _layer(a)]
    assert upward == []


def test_the_slab_format_and_the_precision_registry_stay_off_the_engine():
    engine = {"torch_stagehand.runtime.runtime", "torch_stagehand.runtime.device.slots", "torch_stagehand.runtime.ops",
              "torch_stagehand.runtime.host.store"}
    graph = _graph()
    bad = [(a, b) for a, b in graph.edges
           if (a.startswith("torch_stagehand.runtime.slab") and a != "torch_stagehand.runtime.slab.loading"
               or a.startswith("torch_stagehand.runtime.precision")) and b in engine]
    assert bad == []


def test_the_import_graph_has_no_cycle():
    # Package __init__ modules re-export their children; a child importing a sibling through its
    # package is not a cycle of the code, so those edges are left out.
    graph = _graph()
    edges = [(a, b) for a, b in graph.edges if not a.startswith(b + ".") and not b.startswith(a + ".")]
    assert list(nx.simple_cycles(nx.DiGraph(edges))) == []

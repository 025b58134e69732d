"""A hash of source text, for the cache uuids of custom graph passes (torch/_inductor/custom_graph_pass.py
asks for a `uuid()` that changes whenever the pass's implementation does)."""

from __future__ import annotations

import hashlib
import inspect
import sys
from types import ModuleType
from typing import Callable, Iterable, Sequence


def hash_sources(sources: Iterable[str]) -> str:
    hasher = hashlib.sha256()
    for text in sources:
        data = text.encode("utf-8")
        hasher.update(len(data).to_bytes(8, "little"))  # "ab"+"c" and "a"+"bc" hash apart
        hasher.update(data)
    return hasher.hexdigest()[:32]


HASHED_PACKAGE = "torch_stagehand.compiler"  # the passes' helpers (graph_nodes, context) live here


def passes_uuid(passes: Sequence[Callable]) -> str:
    """Cache uuid of a pass list: the passes' names and a hash of the source of their modules and of every
    compiler module those use, so Inductor's FX graph cache never serves a graph an older pass compiled."""
    modules = _with_imports([inspect.getmodule(p) for p in passes])
    names = "+".join(getattr(p, "name", p.__name__) for p in passes)
    return f"stagehand-{names}-" + hash_sources(inspect.getsource(m) for m in modules)


def _with_imports(modules: list[ModuleType]) -> list[ModuleType]:
    """`modules` and, transitively, the HASHED_PACKAGE modules they use (imported as modules or through a
    function, class or constant defined there), in a stable order."""
    found = list(dict.fromkeys(modules))
    for module in found:  # grows while it is walked
        for value in vars(module).values():
            name = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", None)
            used = sys.modules.get(name) if isinstance(name, str) and name.startswith(HASHED_PACKAGE) else None
            if used is not None and used not in found:
                found.append(used)
    return found

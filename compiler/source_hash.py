"""A hash of source text, for the cache uuids of custom graph passes.

torch/_inductor/custom_graph_pass.py asks a custom pass for a `uuid()` that
changes whenever its implementation does, and recommends hashing the pass's
source files (`get_hash_for_files`). We hash `inspect.getsource` text instead
of file bytes so the same helper works for any module and is testable on
plain strings.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Callable, Iterable, Sequence


def hash_sources(sources: Iterable[str]) -> str:
    hasher = hashlib.sha256()
    for text in sources:
        data = text.encode("utf-8")
        hasher.update(len(data).to_bytes(8, "little"))  # "ab"+"c" and "a"+"bc" hash apart
        hasher.update(data)
    return hasher.hexdigest()[:32]


def passes_uuid(passes: Sequence[Callable]) -> str:
    """Cache uuid of a pass list: the passes' names and a hash of their modules' source.

    Editing a pass's module changes the uuid, so Inductor's FX graph cache never
    serves a graph compiled with an older version of the pass."""
    modules = list(dict.fromkeys(inspect.getmodule(p) for p in passes))
    names = "+".join(getattr(p, "name", p.__name__) for p in passes)
    return f"stagehand-{names}-" + hash_sources(inspect.getsource(m) for m in modules)

"""What the passes share: the runtime's static facts, options, and a change log.

A pass reads the `CompileContext` and the graph and returns a graph; it never
touches runtime *state* (slots, streams, counters). The context only exposes
what is fixed at compile time: block names, layer layouts, byte counts, tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("torch_stagehand.compiler")

INNER_COMPILERS = ("inductor", "eager")


class BackendOptionsError(ValueError):
    pass


@dataclass(frozen=True)
class BackendOptions:
    inner: str = "inductor"

    @staticmethod
    def from_dict(options: dict[str, Any] | None) -> "BackendOptions":
        options = dict(options or {})
        inner = options.pop("inner", "inductor")
        if options:
            raise BackendOptionsError(
                f"backend 'stagehand': unknown option(s) {sorted(options)} (known: inner)"
            )
        if inner not in INNER_COMPILERS:
            raise BackendOptionsError(
                f"backend 'stagehand': options['inner'] must be one of {INNER_COMPILERS}, got {inner!r}"
            )
        return BackendOptions(inner=inner)


@dataclass
class CompileContext:
    runtime: Any  # torch_stagehand.runtime.Runtime (read-only use)
    options: BackendOptions
    graph_id: int = 0
    changes: list[str] = field(default_factory=list)

    def note(self, pass_name: str, message: str) -> None:
        line = f"[{pass_name}] {message}"
        self.changes.append(line)
        log.debug(line)

    @property
    def device(self) -> torch.device:
        return self.runtime.device

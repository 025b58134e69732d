"""Fetch order: which block to fetch next, the one owner of that answer.

The compiler (`link_units`) wires each block unit's next / previous token from `FetchOrder.for_graph` over one
graph's block order; the eager path learns it from the last forward pass (registration order before one). The
forward fetches the block that runs next, the backward the one that ran before; at an order's ends, the
registration-order neighbour unless it runs in this order (across a graph break the next graph holds the following
blocks). A `Lookahead` is one block deep; a plan's deeper one is `PlanDriver.prefetch`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from torch_stagehand.runtime import registry
from torch_stagehand.runtime.registry import NO_BLOCK

LOOKAHEAD_DEPTH = 1


@dataclass(frozen=True)
class Lookahead:
    """What to fetch while `block` runs: `next_fwd` in the forward, `next_bwd` in the backward."""

    block: int
    next_fwd: int
    next_bwd: int
    depth: int = LOOKAHEAD_DEPTH


class FetchOrder:
    """The fetch order of one runtime's blocks: per graph (pure) and learned from eager calls."""

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self._current: dict[int, None] = {}  # blocks started in the forward pass under way, in order
        self._last: dict[int, Lookahead] = {}  # the last complete pass, by block
        self._current_lookahead: dict[int, Lookahead] | None = None  # computed once per pass, for the backward

    @staticmethod
    def for_graph(blocks_in_order: Sequence[int], n_blocks: int) -> list[Lookahead]:
        """One `Lookahead` per position of `blocks_in_order` (a block may appear at several positions)."""
        present, last = set(blocks_in_order), len(blocks_in_order) - 1
        return [Lookahead(block, blocks_in_order[i + 1] if i < last else _neighbour(block + 1, n_blocks, present),
                          blocks_in_order[i - 1] if i > 0 else _neighbour(block - 1, n_blocks, present))
                for i, block in enumerate(blocks_in_order)]

    def record_forward(self, block: int) -> None:
        """Block `block` starts a forward (eager path); a block seen again begins a new pass."""
        if block in self._current:
            self._last = _by_block(self.for_graph(list(self._current), self.n_blocks))
            self._current = {}
        self._current[block] = None
        self._current_lookahead = None

    def eager_next(self, block: int, backward: bool) -> int:
        """The block to prefetch while `block` runs eagerly (NO_BLOCK: none): forward, its successor in the last
        complete pass; backward, its predecessor in this step's forward pass (run in full), else in the last one."""
        if backward and block in self._current:
            if self._current_lookahead is None:
                self._current_lookahead = _by_block(self.for_graph(list(self._current), self.n_blocks))
            return self._current_lookahead[block].next_bwd
        known = self._last.get(block)
        if known is not None:
            return known.next_bwd if backward else known.next_fwd
        upcoming = block - 1 if backward else block + 1  # registration order: nothing recorded yet
        return upcoming if 0 <= upcoming < self.n_blocks else NO_BLOCK

    def learned_order(self) -> list[int]:
        """The forward pass under way (or the last one), as recorded; for explain and tests."""
        return list(self._current)


def edge_token(block_tok: torch.Tensor, step: int, present: Sequence[torch.Tensor]) -> torch.Tensor:
    """At a graph's end, the token of the registration-order neighbour not in `present` (asked per call)."""
    rt, block = registry.decode(block_tok)
    nb = _neighbour(block + step, len(rt.blocks), {registry.decode(t)[1] for t in present})
    return rt.no_block_token if nb == NO_BLOCK else rt.block_tokens[nb]


def _neighbour(block: int, n_blocks: int, present: set[int]) -> int:
    return block if 0 <= block < n_blocks and block not in present else NO_BLOCK


def _by_block(lookaheads: list[Lookahead]) -> dict[int, Lookahead]:
    # A block appears once per pass on the eager path (a repeat starts a new pass).
    return {la.block: la for la in lookaheads}

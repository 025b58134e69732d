"""Fetch order: which block to fetch next, the one owner of that answer.

Both paths ask here. The compiler (`link_units`) hands over the order its
block units run in one Dynamo graph and wires each unit's next / previous
token from `FetchOrder.for_graph`. The eager op path has no schedule, so
`FetchOrder` learns the order from the calls themselves: the blocks started in
the last forward pass, in the order they ran (a model whose blocks run 1, 0, 2
prefetches in that order, not in registration order); before a pass has been
seen it falls back to registration order.

One rule for both, per position in an order: the forward fetches the block
that runs next, the backward (the order reversed) the block that ran before.
At the ends of the order the neighbour in registration order is fetched
instead, unless that block already runs in this order: across a graph break
the next graph holds the following blocks (block 3 ends one graph, block 4
starts the next), but a block that ran earlier in this order is not "next".

Lookahead depth is 1 (one block ahead of the computing one, two device
slots); the planner raises it here later, nowhere else.
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
        self.depth = LOOKAHEAD_DEPTH
        self._current: list[int] = []  # blocks started in the forward pass under way
        self._current_set: set[int] = set()
        self._last: dict[int, Lookahead] = {}  # the last complete pass, by block
        self._current_lookahead: dict[int, Lookahead] | None = None  # computed once per pass, for the backward

    # ---- the pure rule ----------------------------------------------------------------

    @staticmethod
    def for_graph(blocks_in_order: Sequence[int], n_blocks: int) -> list[Lookahead]:
        """One `Lookahead` per position of `blocks_in_order` (a block may appear at several positions)."""
        present = set(blocks_in_order)
        last = len(blocks_in_order) - 1
        result = []
        for i, block in enumerate(blocks_in_order):
            if i < last:
                next_fwd = blocks_in_order[i + 1]
            else:
                next_fwd = _neighbour(block + 1, n_blocks, present)
            if i > 0:
                next_bwd = blocks_in_order[i - 1]
            else:
                next_bwd = _neighbour(block - 1, n_blocks, present)
            result.append(Lookahead(block, next_fwd, next_bwd))
        return result

    # ---- the eager path ---------------------------------------------------------------

    def record_forward(self, block: int) -> None:
        """Block `block` starts running in a forward pass (eager path: its first layer was called).

        A block seen again means a new pass began: the pass so far becomes
        the order the next forward prefetches by.
        """
        if block in self._current_set:
            self._last = _by_block(self.for_graph(self._current, self.n_blocks))
            self._current, self._current_set = [], set()
        self._current.append(block)
        self._current_set.add(block)
        self._current_lookahead = None

    def eager_next(self, block: int, backward: bool) -> int:
        """The block to prefetch while `block` runs eagerly; NO_BLOCK for none.

        Forward: the successor in the last complete pass (this pass has not
        reached it yet). Backward: the predecessor in this step's forward pass
        (it has run in full), else in the last one.
        """
        if backward and block in self._current_set:
            if self._current_lookahead is None:
                self._current_lookahead = _by_block(self.for_graph(self._current, self.n_blocks))
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
    """At a compiled graph's end, the token of the block to fetch next: the neighbour in registration order
    (`step` +1 forward, -1 backward) unless it runs in this graph (`present`: the graph's block tokens).
    Asked per call, not fixed when the graph compiled: one graph serves every block of its structure."""
    rt, block = registry.decode(block_tok)
    nb = _neighbour(block + step, len(rt.blocks), {registry.decode(t)[1] for t in present})
    return rt.no_block_token if nb == NO_BLOCK else rt.block_tokens[nb]


def _neighbour(block: int, n_blocks: int, present: set[int]) -> int:
    return block if 0 <= block < n_blocks and block not in present else NO_BLOCK


def _by_block(lookaheads: list[Lookahead]) -> dict[int, Lookahead]:
    # A block appears once per pass on the eager path (a repeat starts a new pass).
    return {la.block: la for la in lookaheads}

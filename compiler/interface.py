"""What the compiler reads from the runtime: the `StreamingRuntime` protocol. Everything the passes, the units and
the backend use from a `Runtime` is declared here, so a hand-made fake runtime is enough to run a pass in a test;
`Runtime` implements it (tests/compiler/test_passes.py checks)."""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch


class StreamedLayer(Protocol):
    """One streamed Linear as the compiler sees it."""

    fqn: str  # relative to its block
    block: int
    out_features: int
    in_features: int


@runtime_checkable
class StreamingRuntime(Protocol):
    # ---- static facts, fixed at offload time -------------------------------------------
    blocks: list[str]  # block FQNs, in model order
    layers: Sequence[StreamedLayer]
    device: torch.device
    block_tokens: list[torch.Tensor]  # 0-dim CPU tensors naming each block in a graph
    no_block_token: torch.Tensor  # names "no block" (before the first / after the last)

    @property
    def precision(self) -> dict[int, str]:
        """The current precision map (block -> precision name); a copy."""

    def layer_at(self, block: int, position: int) -> int:
        """Index in `layers` of block `block`'s `position`-th streamed layer (as a captured read names it)."""

    def layer_layout(self, index: int, precision: str) -> list[int]:
        """Where layer `index` sits in its block's device bytes, as op-schema ints."""

    def block_nbytes(self, block: int, precision: str) -> int: ...

    def trainable_positions(self, block: int) -> tuple[int, ...]:
        """The positions of the block's streamed layers whose weights train now (a variant compiles per set)."""

    # ---- the few things the compiler tells the runtime -----------------------------------
    def abort_held_blocks(self) -> None:
        """A compiled unit raised before its evict ran: release every block it held."""

    def recover_from_oom(self, where: str, error: BaseException, trainable_backward: bool = False) -> bool:
        """A unit (`where`) ran out of device memory: free, re-plan; True when it should run again (oom_recovery.py)."""

    def record_compile(self, seconds: float, block_variant: bool, loaded: bool = False) -> None:
        """Count one compiled unit in `stats()` (`loaded`: from the compile caches, not compiled)."""

    def model_call_began(self) -> None:
        """The offloaded model's forward was entered (a step's forward phase starts there)."""

    def record_first_run(self) -> None:
        """Count a compiled unit's first run (its kernels load and tune then)."""

    def planned_recompute(self, block: int) -> bool | None:
        """Recompute the block's activations (True), keep them (False), or None: the model's checkpointing decides."""

    def spill_hooks(self, block: int) -> Any:
        """A context (saved-tensor hooks) that spills the block's saved activations to host, or None."""

    def record_recompute(self, block: int) -> None:
        """Count one block recompute (a block unit re-ran its forward in backward) in `stats()`."""

    def record_graph(self, record: Any) -> None:
        """Keep what the backend did to one Dynamo graph, for `explain()`."""

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call `callback` when the runtime closes (the compiler drops its variants then)."""

"""The eager op path is correct but slow: a compiled model that takes it is told once per block and cause."""

from __future__ import annotations

import warnings


class EagerFallbackWarning(UserWarning):
    """A compiled model ran a block through the eager op path (correct, slower)."""


def warn_eager_once(warned: set, block: int, block_name: str, backward: bool) -> None:
    """Warn that `block` ran eagerly inside a compiled model, once per (block, cause) in `warned`."""
    cause = ("recomputed in backward outside the compiled program (reentrant checkpointing, or a checkpoint "
             "the backend could not place)" if backward else
             "ran outside the compiled program (a graph the backend did not get, or Dynamo fell back to eager)")
    if (block, cause) not in warned:
        warned.add((block, cause))
        warnings.warn(f"stagehand: block {block_name} {cause}: its streamed linears run the eager op "
                      "path, one op at a time (correct, slower; counted in stats()['eager_linear_calls'])",
                      EagerFallbackWarning, stacklevel=5)



"""Checking a precision map (a name for every block, or {block index or FQN: name}): one set of rules and words for
`offload`, `Runtime.set_precision` and the CLI."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch_stagehand.runtime.precision.registry import FULL, names


class PrecisionMapError(ValueError):
    """A precision map names an unknown precision or block; the message says which."""


def validate_precision_map(precision: str | Mapping, blocks: Sequence[str] | int | None, *,
                           base: Mapping[int, str] | None = None, context: str = "precision map") -> dict[int, str]:
    """Resolve `precision` into {block index: precision name}, or raise PrecisionMapError.

    blocks: the block FQNs, or their count (keys must then be indices), or None when the model is not known yet
    (only the names are checked; the map comes back as given). base: the map that blocks left out keep (None: the
    full precision). context: how messages start ("offload: precision map", "--precision")."""
    known = names()
    if isinstance(precision, str):
        if precision not in known:
            raise PrecisionMapError(f"{context}: unknown precision {precision!r} (known: {', '.join(known)})")
        if blocks is None:
            return precision
        precision = {b: precision for b in range(_count(blocks))}
    if not isinstance(precision, Mapping):
        raise PrecisionMapError(f"{context}: precision must be {', '.join(map(repr, known))} or a dict block -> "
                                f"precision, got {precision!r}")
    resolved: dict[int, str] = {}
    out_of_range: list[int] = []
    for key, value in precision.items():
        block = _block_index(key, blocks, context)
        if blocks is not None and not 0 <= block < _count(blocks):
            out_of_range.append(block)
            continue
        if value not in known:
            raise PrecisionMapError(f"{context}: block {key!r} has unknown precision {value!r} "
                                    f"(known: {', '.join(known)})")
        resolved[block] = value
    if out_of_range:
        bad, n = sorted(out_of_range), _count(blocks)
        raise PrecisionMapError(f"{context} names block(s) {bad}; block {bad[0]} does not exist "
                                f"(the model has blocks 0..{n - 1})")
    if blocks is None:
        return resolved
    full = {b: FULL for b in range(_count(blocks))} if base is None else dict(base)
    full.update(resolved)
    missing = [b for b in range(_count(blocks)) if b not in full]
    if missing:
        raise PrecisionMapError(f"{context}: blocks {missing} have no precision")
    return full


def _count(blocks: Sequence[str] | int) -> int:
    return blocks if isinstance(blocks, int) else len(blocks)


def _block_index(key, blocks: Sequence[str] | int | None, context: str) -> int:
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise PrecisionMapError(f"{context}: key {key!r} is neither a block index nor a block FQN")
    if isinstance(key, int):
        return key
    if blocks is None or isinstance(blocks, int) or key not in blocks:
        first = f" (blocks: {blocks[0]} ...)" if isinstance(blocks, Sequence) and blocks else ""
        raise PrecisionMapError(f"{context}: no block named {key!r}{first}")
    return list(blocks).index(key)

"""What the user typed, checked: precision maps (as ranges until checked), output paths, sizes. Every mistake
is a UsageError (one line, exit status 2), and so are the library's errors `user_errors` lists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from torch_stagehand.runtime import precision as precisions


class UsageError(Exception):
    """A mistake in what the user asked for: reported as one line, exit status 2."""


class TargetFailed(UsageError):
    """The user's file target failed (its factory or its forward raised): one line, or its traceback with --debug."""

    def __init__(self, target: str, what: str, error: BaseException):
        first_line = (str(error).strip().splitlines() or [""])[0]  # Dynamo appends the user's stack on more lines
        super().__init__(f"target {target!r}: {what}{type(error).__name__}: {first_line}")
        self.error = error


def user_errors() -> tuple[type[BaseException], ...]:
    """The library's exceptions that mean "what you asked for cannot be done" (a bad config or budget, a precision
    the device cannot run, host copies that do not fit, ...): a command reports them as usage errors. Imported
    when called (a command failed), not with this module."""
    from torch_stagehand.config import ConfigError
    from torch_stagehand.runtime.blocks import BlockSelectionError
    from torch_stagehand.runtime.conductor.costs import BudgetError
    from torch_stagehand.runtime.conductor.telemetry import TelemetryPathError
    from torch_stagehand.runtime.host.plan import HostMemoryError
    from torch_stagehand.runtime.precision.fp8 import Fp8UnsupportedError
    from torch_stagehand.runtime.selective.fp8_rules import Fp8PolicyError

    from torch_stagehand.app.telemetry_plots import TelemetryFileError
    from torch_stagehand.app.textdata import CorpusError

    return (ConfigError, precisions.PrecisionMapError, BlockSelectionError, BudgetError, TelemetryPathError,
            HostMemoryError, Fp8UnsupportedError, Fp8PolicyError, TelemetryFileError, CorpusError)


def one_line(error: BaseException) -> str:
    """An error's message on one line (a library message may wrap; the command's report may not)."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


def check_vram_budget(text: str | None) -> str | None:
    """`--vram-budget`, read before anything is built: a size with a unit, never a bare number."""
    from torch_stagehand.runtime.conductor.costs import BudgetError, parse_bytes

    if text is not None:
        try:
            parse_bytes(text, "--vram-budget")
        except BudgetError as e:
            raise UsageError(str(e)) from None
    return text


@dataclass(frozen=True)
class PrecisionRanges:
    """A parsed map like '0-3:int8,4:bf16', kept as (first, last, precision) ranges until `check_precision_range`
    has checked them against the model's block count ('0-99999999999:int8' is never expanded)."""

    text: str
    parts: tuple[tuple[int, int, str], ...]  # (first block, last block inclusive, precision), in the order written


def parse_precision(text: str) -> str | PrecisionRanges:
    """'bf16', 'int8' (any registered precision), or a map like '0-3:int8,4:bf16' (blocks it leaves out stay bf16)."""
    spec = text.strip()
    known = precisions.names()
    if spec in known:
        return spec
    if not spec:
        raise UsageError("--precision: empty (use bf16, int8 or a map like 0-3:int8,4:bf16)")
    parts = tuple(_parse_part(raw.strip(), text, known) for raw in spec.split(","))
    _refuse_overlaps(parts, text)
    return PrecisionRanges(text, parts)


def _parse_part(part: str, text: str, known) -> tuple[int, int, str]:
    if not part:
        raise UsageError(f"--precision {text!r}: empty part (a stray comma?)")
    blocks, sep, precision = part.partition(":")
    if not sep:
        if part in ("fp16", "fp32", "bfloat16", "int4"):
            raise UsageError(f"--precision {text!r}: unknown precision {part!r} (known: {', '.join(known)})")
        raise UsageError(f"--precision {text!r}: part {part!r} is not BLOCKS:PRECISION (e.g. 0-3:int8 or 4:bf16)")
    precision = precision.strip()
    first, dash, last = blocks.strip().partition("-")
    try:
        lo = int(first)
        hi = int(last) if dash else lo
    except ValueError:
        raise UsageError(f"--precision {text!r}: part {part!r}: blocks must be an index (4) or a range (0-3), "
                         f"got {blocks.strip()!r}") from None
    if lo < 0 or hi < lo:
        raise UsageError(f"--precision {text!r}: part {part!r}: range {blocks.strip()!r} must be ascending and >= 0")
    _checked({lo: precision}, None, f"--precision {text!r}")  # the precision's name, by the library's rules
    return lo, hi, precision


def _refuse_overlaps(parts: tuple[tuple[int, int, str], ...], text: str) -> None:
    """Two parts naming one block: found by comparing range ends, never by listing the blocks."""
    order = sorted(range(len(parts)), key=lambda i: parts[i][0])
    for before, after in zip(order, order[1:]):
        if parts[after][0] <= parts[before][1]:
            later = max(before, after)  # the part written second is the one that repeats
            lo, hi, precision = parts[later]
            written = f"{lo}-{hi}" if hi != lo else f"{lo}"
            raise UsageError(f"--precision {text!r}: part '{written}:{precision}' names block "
                             f"{parts[after][0]} a second time")


def check_precision_range(precision: str | PrecisionRanges, n_blocks: int) -> str | dict[int, str]:
    """The map checked against a model of `n_blocks` blocks, then (and only then) expanded per block."""
    if isinstance(precision, str):
        return precision
    for lo, hi, _ in precision.parts:
        if hi >= n_blocks and hi != lo:
            raise UsageError(f"--precision names blocks {lo}-{hi}; block {max(lo, n_blocks)} does not exist "
                             f"(the model has blocks 0..{n_blocks - 1})")
    singles = {lo: p for lo, hi, p in precision.parts if lo == hi}
    _checked(singles, n_blocks, "--precision")  # an index past the end: the library's words
    expanded = {block: p for lo, hi, p in precision.parts for block in range(lo, hi + 1)}
    return _checked(expanded, n_blocks, "--precision")


def _checked(precision: str | dict[int, str], n_blocks: int | None, context: str):
    """The library's precision-map rules (names, block range), as a usage error."""
    try:
        return precisions.validate_precision_map(precision, n_blocks, context=context)
    except precisions.PrecisionMapError as e:
        raise UsageError(str(e)) from None


def check_output_path(option: str, path: str, *, folder: bool) -> None:
    """Refuse, before any work, an output path that cannot be written: a folder where a file goes, or the reverse."""
    if folder and os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{option} {path!r} is a file; give a folder (it is created if missing)")
    if not folder and os.path.isdir(path):
        raise UsageError(f"{option} {path!r} is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):  # the nearest existing ancestor must be a folder we can create in
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"{option} {path!r}: {parent!r} is a file, not a folder")

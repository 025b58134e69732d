"""Which arguments of a model's blocks carry the residual stream, remembered between runs (regional compilation).
Under `compile_blocks` Dynamo guards on every tensor argument's grad flag, and a first block fed by a frozen
embedding would trace apart from the others of its structure. The block unit gives that argument grad anyway
(units.BlockUnit._residual_stream_needing_grad) and names it in a file beside the compile bundle (`remember`); a
later run's `compile_blocks` gives it grad before Dynamo sees it (`give_grad`). A bad file is ignored, warned."""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
from typing import Any, Callable

import torch

from torch_stagehand.runtime.atomic_file import write_atomic

log = logging.getLogger("torch_stagehand.compiler")
_SUFFIX = ".residual.json"
_recorded: set[tuple] = set()  # (bundle, block list, graph-input positions) this process noted already


def hints_file(bundle_path: str) -> str:
    """The hints file beside a compile bundle (`compile/<fingerprint>.bundle`)."""
    return os.path.splitext(bundle_path)[0] + _SUFFIX


def block_list(fqn: str) -> str:
    """The list a block belongs to: its name without the index (`transformer_blocks.7` -> `transformer_blocks`)."""
    return re.sub(r"\.\d+$", "", fqn)


def load(bundle_path: str) -> dict[str, list[str]]:
    """The hints recorded beside `bundle_path`: block list -> argument names; {} without a (valid) file."""
    path = hints_file(bundle_path)
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            hints = json.load(f)
    except (OSError, ValueError) as e:
        log.warning("stagehand: residual-stream hints %s ignored: unreadable (%s)", path, e)
        return {}
    if not (isinstance(hints, dict) and all(isinstance(k, str) and isinstance(v, list)
                                            and all(isinstance(n, str) for n in v) for k, v in hints.items())):
        log.warning("stagehand: residual-stream hints %s ignored: not a list of argument names per block list",
                    path)
        return {}
    return hints


def remember(bundle_path: str, fqn: str, template: Any, positions) -> None:
    """The block unit of `fqn` gave grad to its graph inputs at `positions`: note their argument names (from their
    Dynamo sources) for its block list, once per process. An unwritable file costs the next run an extra trace."""
    key = block_list(fqn)
    if (bundle_path, key, tuple(positions)) in _recorded:
        return
    _recorded.add((bundle_path, key, tuple(positions)))
    placeholders = [n for n in template.graph.nodes if n.op == "placeholder"]
    sources = (getattr(placeholders[i].meta.get("grapharg"), "source", None) for i in sorted(positions))
    names = [name for name in (getattr(source, "local_name", None) for source in sources) if isinstance(name, str)]
    hints = load(bundle_path) if names else {}
    if not names or hints.get(key) == names:
        return
    hints[key] = names
    try:
        write_atomic(hints_file(bundle_path), json.dumps(hints, indent=1, sort_keys=True))
    except OSError as e:
        log.warning("stagehand: residual-stream hints %s not written: %s", hints_file(bundle_path), e)


def positional_names(forward: Any) -> list[str]:
    """The names `forward` takes by position, in order (worked out once per block: `give_grad` runs per call)."""
    return [p.name for p in inspect.signature(forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def give_grad(positional: list[str], names: list[str], args: tuple, kwargs: dict,
              trains: Callable[[], bool] = lambda: True) -> tuple[tuple, dict]:
    """`args` and `kwargs` of a forward taking `positional`, with the floating tensors passed as `names` made to
    need grad (a new leaf) when `trains()`: the flags a later block gets, so Dynamo runs the same graph. Where all
    have them already (every block but the first), nothing is copied and `trains` is not asked."""
    def lacks_grad(value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.is_floating_point() and not value.requires_grad

    spots = [("kw", name) if name in kwargs else ("pos", positional.index(name)) for name in names
             if name in kwargs or (name in positional and positional.index(name) < len(args))]
    spots = [(kind, at) for kind, at in spots if lacks_grad(kwargs[at] if kind == "kw" else args[at])]
    if not spots or not trains():
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    for kind, at in spots:
        held = kwargs if kind == "kw" else args
        held[at] = held[at].detach().requires_grad_()
    return tuple(args), kwargs

"""The one precision -> colour table every plot draws from (the demo's, `stagehand plot`'s).

Built from the precision registry each time it is asked: named precisions take their colour from `_NAMED` (by-role
variants are shades of their precision's colour), any other name the next unused colour of `_SPARE`, then
generated hues. No two names ever share a colour.
"""

from __future__ import annotations

import colorsys
import itertools
from typing import Iterable

from torch_stagehand.runtime import precision as precisions

_NAMED = {
    "bf16": "#3b6fb6",  # blue: full precision
    "int8": "#e8892b",  # orange
    "fp8": "#2e9e5b",  # green
    "int8-attn": "#f6c38c",  # light orange: int8 attention, MLP full
    "int8-mlp": "#9c5414",  # dark orange: int8 MLP, attention full
    "fp8-attn": "#99d4ad",  # light green
    "fp8-mlp": "#17593a",  # dark green
    "int8-attn+fp8-mlp": "#8e44ad",  # purple: both roles low, in different precisions
    "fp8-attn+int8-mlp": "#d35db0",  # pink
}
_SPARE = ("#17becf", "#bcbd22", "#8c564b", "#7f8c8d", "#1f3b73", "#c0392b")
_GOLDEN = 0.618033988749895  # hue step that keeps generated hues apart however many are drawn


def precision_colors(extra: Iterable[str] = ()) -> dict[str, str]:
    """{name: "#rrggbb"} for every registered precision (registration order), then the `extra` names
    (precisions a telemetry file names that this process has not registered); all colours distinct."""
    names = list(dict.fromkeys([*precisions.names(), *extra]))
    used = {_NAMED[n] for n in names if n in _NAMED}
    fresh = _fresh_colors(used)
    return {name: _NAMED[name] if name in _NAMED else next(fresh) for name in names}


def _fresh_colors(used: set[str]):
    """Colours not in `used` (and marked used as they are handed out): the spare ones, then generated hues."""
    hues = itertools.accumulate(itertools.repeat(_GOLDEN), lambda hue, step: (hue + step) % 1.0)
    generated = ("#%02x%02x%02x" % tuple(round(255 * c) for c in colorsys.hsv_to_rgb(h, 0.65, 0.8)) for h in hues)
    for color in itertools.chain(_SPARE, generated):
        if color not in used:
            used.add(color)
            yield color

"""The precision registry: one entry per precision (name, code, host layout, buffer filling, a layer's views, linear
and grad-input from a slot). Callers hold a name or code and ask for the entry; a new precision is
`precisions.register(MyPrecision())`, a `Precision` subclass."""

from torch_stagehand.runtime.precision.base import Precision
from torch_stagehand.runtime.precision.layout import ALIGN, CODE_DTYPES, DTYPE_CODES, LayerLayout, align
from torch_stagehand.runtime.precision.registry import (FP8, FULL, INT8, by_code, get, layer_views, master, names,
                                                        register, unregister)
from torch_stagehand.runtime.precision.validate import PrecisionMapError, validate_precision_map

__all__ = [
    "ALIGN", "CODE_DTYPES", "DTYPE_CODES", "FP8", "FULL", "INT8", "LayerLayout", "Precision", "PrecisionMapError",
    "align", "by_code", "get", "layer_views", "master", "names", "register", "unregister", "validate_precision_map",
]

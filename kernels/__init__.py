"""W8A16 kernels and their torch reference twins. `int8_linear` / `int8_linear_grad_input` take the fused Triton
kernels for a CUDA activation when Triton imports, else the reference twin (the same numbers within bf16 rounding; on
CUDA it warns once, `TritonUnavailableWarning`, naming `TRITON_IMPORT_ERROR`). `int8_linear_triton` /
`int8_linear_grad_input_triton` always take Triton."""

import contextlib
import sys

if __name__ == "kernels":  # pragma: no cover - exercised by a subprocess in tests/kernels/test_kernel_fallback.py
    # This folder found as a top-level `kernels` (Python started in the repository's root, which sys.path then
    # holds) would shadow Hugging Face's `kernels`, which transformers >= 5.2x imports: that package takes this
    # module's place, and where it is not installed the import fails as it would outside the root.
    import importlib.machinery
    import importlib.util
    import os

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or ".") != _root])
    if _spec is None:
        del sys.modules["kernels"]
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    sys.modules["kernels"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["kernels"])

from torch_stagehand.kernels.fallback import TritonUnavailableWarning, warn_reference_fallback
from torch_stagehand.kernels.quantize import dequantize, quantize_per_row
from torch_stagehand.kernels.reference import grouped_lowbit_ref, grouped_out_features, int8_linear_grad_input_ref, int8_linear_ref

TRITON_IMPORT_ERROR: BaseException | None = None  # why the fused kernels are missing, if they are
try:  # Triton is a dependency, but a broken or absent install must not break the CPU path.
    from torch_stagehand.kernels.launch import int8_linear_grad_input_triton, int8_linear_triton
    from torch_stagehand.kernels.tuning.autotune import LaunchConfig, tuned_configs, tuning_log, tuning_seconds
    from torch_stagehand.kernels.tuning.deferral import deferred as deferred_tuning, tune_deferred
    from torch_stagehand.kernels.grouped import grouped_lowbit as _grouped_lowbit_cuda

    HAS_TRITON = True
except Exception as e:  # pragma: no cover - depends on the install
    HAS_TRITON = False
    TRITON_IMPORT_ERROR = e
    LaunchConfig = None

    def _no_triton(*args, **kwargs):
        raise RuntimeError("torch_stagehand.kernels: Triton is not importable here")

    int8_linear_triton = int8_linear_grad_input_triton = _no_triton

    def tuned_configs():
        return {}

    def tuning_seconds():
        return 0.0

    tuning_log, deferred_tuning = tuned_configs, contextlib.nullcontext

    def tune_deferred(stop=lambda: False):
        return 0


def _fused(x) -> bool:
    """Whether a call on `x` takes the Triton kernel; a CUDA call that cannot says why, once."""
    if HAS_TRITON:
        return x.is_cuda
    if x.is_cuda:
        warn_reference_fallback("the W8A16 kernels", TRITON_IMPORT_ERROR)
    return False


def grouped_lowbit(x, q, scale, offs, rows_are_out: bool):
    """Per expert e, x[rows of e] @ B_e with B_e the one-byte stack q [E, R, C] dequantized by its per-row
    scale [E, R] (rows_are_out: q[e] is [out, in], else [in, out]); `offs`: each expert's end row."""
    if _fused(x):
        return _grouped_lowbit_cuda(x, q, scale, offs, rows_are_out)
    return grouped_lowbit_ref(x, q, scale, offs, rows_are_out)


def int8_linear(x, qweight, scale, bias=None, activation=None):
    """y = (x @ qweight[:, :K].T) * scale + bias, optional "gelu_tanh"; K = x.shape[-1]."""
    if _fused(x):
        return int8_linear_triton(x, qweight, scale, bias, activation)
    return int8_linear_ref(x, qweight, scale, bias, activation)


def int8_linear_grad_input(dy, qweight, scale, k=None):
    """dx = (dy * scale) @ qweight[:, :k]; k defaults to qweight.shape[1]."""
    if _fused(dy):
        return int8_linear_grad_input_triton(dy, qweight, scale, k)
    return int8_linear_grad_input_ref(dy, qweight, scale, k)


__all__ = ["HAS_TRITON", "LaunchConfig", "TRITON_IMPORT_ERROR", "TritonUnavailableWarning", "dequantize",
           "grouped_lowbit", "grouped_lowbit_ref", "grouped_out_features", "int8_linear", "int8_linear_grad_input",
           "int8_linear_grad_input_ref", "int8_linear_grad_input_triton", "int8_linear_ref", "int8_linear_triton",
           "quantize_per_row", "deferred_tuning", "tune_deferred", "tuned_configs", "tuning_log", "tuning_seconds"]

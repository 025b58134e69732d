"""Saying so when a CUDA tensor takes a torch reference twin because Triton did not import.

Triton is a dependency, but a broken install (a wheel built for another CUDA, a missing
compiler) must not break the model: the kernels fall back to their reference twins. On the
CPU that is the design; on CUDA it is correct but slow (the W8A16 twin dequantizes the whole
weight to compute), so the first such call warns, naming the import error, once per kernel
family and process.
"""

from __future__ import annotations

import warnings


class TritonUnavailableWarning(RuntimeWarning):
    """A CUDA call ran a kernel's torch reference twin because Triton failed to import."""


_WARNED: set[str] = set()  # kernel families already warned about in this process


def warn_reference_fallback(kernels: str, error: BaseException | None) -> None:
    """Warn once per `kernels` family that CUDA calls take the reference path, and why (`error`)."""
    if kernels in _WARNED:
        return
    _WARNED.add(kernels)
    why = f"{type(error).__name__}: {error}" if error is not None else "unknown import error"
    warnings.warn(f"stagehand: Triton failed to import ({why}); {kernels} on CUDA run the torch reference "
                  "path instead (correct, much slower). Fix the Triton install to get the fused kernels.",
                  TritonUnavailableWarning, stacklevel=3)

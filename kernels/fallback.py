"""The warning a CUDA call gives, once per kernel family, when it takes a torch twin because Triton did not import
(a broken install must not break the model; on CUDA the twin is correct but slow)."""

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

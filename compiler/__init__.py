"""The stagehand backend and its passes (one module per pass)."""

from torch_stagehand.compiler.backend import stagehand_backend

__all__ = ["stagehand_backend"]

"""The stagehand backend and its passes (one module per pass)."""

from .backend import stagehand_backend

__all__ = ["stagehand_backend"]

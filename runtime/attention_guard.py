"""A guard against an attention backend that returns wrong gradients under block streaming.

cuDNN's SDPA backward gave wrong LoRA gradients for streamed, compiled blocks (their attention gets a gradient
whose strides differ from its output's; cf. pytorch/pytorch#141147), so `offload` on CUDA turns that backend off,
says so once, and leaves flash and memory-efficient attention to carry attention. `STAGEHAND_ALLOW_CUDNN_SDPA=1`
keeps it on. The setting is process-wide; it comes back when the last runtime that turned it off is closed.
"""

from __future__ import annotations

import warnings

import torch
from torch_stagehand.environment import env


class AttentionBackendWarning(UserWarning):
    """stagehand changed which attention backend torch may use (to keep gradients right)."""


_HOLDERS = [0]  # live runtimes that keep cuDNN SDPA off (it was on before the first)


def disable_unsafe_sdpa_backends(device: torch.device):
    """Turn cuDNN SDPA off for a CUDA runtime. Returns the undo to call when that runtime closes, or None."""
    if device.type != "cuda" or env("STAGEHAND_ALLOW_CUDNN_SDPA"):
        return None
    if _HOLDERS[0]:
        _HOLDERS[0] += 1
        return _release
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return None  # the user turned it off: nothing to give back
    _HOLDERS[0] = 1
    torch.backends.cuda.enable_cudnn_sdp(False)
    warnings.warn(
        f"stagehand: disabled cuDNN scaled-dot-product attention (torch {torch.__version__}): its backward gave "
        "wrong gradients for streamed, compiled blocks here; flash / memory-efficient attention are used instead "
        "(set STAGEHAND_ALLOW_CUDNN_SDPA=1 to keep it)",
        AttentionBackendWarning,
        stacklevel=3,
    )
    return _release


def _release() -> None:
    _HOLDERS[0] -= 1
    if _HOLDERS[0] == 0:
        torch.backends.cuda.enable_cudnn_sdp(True)

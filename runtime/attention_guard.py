"""A guard against an attention backend that returns wrong gradients under block streaming.

Measured on an H200 with torch 2.11 (cuDNN 9 as shipped in its CUDA 13 wheel): a tiny
diffusers Flux transformer with peft LoRA, compiled with the stagehand backend,
got LoRA gradients with cosine -0.18 to 0.13 against the plain model (values up
to 1e20 in bf16), with or without checkpointing, while the loss matched; with
cuDNN's SDPA backend disabled the same run agreed to cosine 0.9998. The compiled
units hand each attention a gradient whose strides differ from its output's,
which cuDNN's SDPA backward has mishandled before (pytorch/pytorch#141147); the
same backend also faults at Flux's full shape on the H100 (DESIGN.md). So
`offload` on CUDA turns that backend off, says so once, and leaves flash and
memory-efficient attention (which were right in every run) to carry attention.
`STAGEHAND_ALLOW_CUDNN_SDPA=1` keeps it on for whoever has checked their build.
The setting is process-wide; it comes back when the last runtime that turned it
off is closed (`restore()`).
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

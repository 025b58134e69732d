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
"""

from __future__ import annotations

import os
import warnings

import torch


class AttentionBackendWarning(UserWarning):
    """stagehand changed which attention backend torch may use (to keep gradients right)."""


def disable_unsafe_sdpa_backends(device: torch.device) -> bool:
    """Turn cuDNN SDPA off for a CUDA runtime; True when this call changed the setting."""
    if device.type != "cuda" or os.environ.get("STAGEHAND_ALLOW_CUDNN_SDPA") == "1":
        return False
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    warnings.warn(
        f"stagehand: disabled cuDNN scaled-dot-product attention (torch {torch.__version__}): its backward gave "
        "wrong gradients for streamed, compiled blocks here; flash / memory-efficient attention are used instead "
        "(set STAGEHAND_ALLOW_CUDNN_SDPA=1 to keep it)",
        AttentionBackendWarning,
        stacklevel=3,
    )
    return True

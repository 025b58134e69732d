"""Torch reference twins of the W8A16 kernels.

These define the numbers: fp32 accumulation, per-row scale (and bias, and the
optional tanh-GeLU) in the epilogue, output in the activation's dtype. They run
anywhere (the CPU path and the tests' ground truth). `qweight` may be wider than
the activation's K (slab files pad K); the padding columns are ignored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def int8_linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    k = x.shape[-1]
    acc = x.float() @ qweight[:, :k].float().t()
    acc = acc * scale.float()
    if bias is not None:
        acc = acc + bias.float()
    if activation == "gelu_tanh":
        acc = F.gelu(acc, approximate="tanh")
    elif activation is not None:
        raise ValueError(f"int8_linear: unknown activation {activation!r} (supported: 'gelu_tanh')")
    return acc.to(x.dtype)


def int8_linear_grad_input_ref(dy: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, k: int | None = None) -> torch.Tensor:
    k = qweight.shape[1] if k is None else k
    return ((dy.float() * scale.float()) @ qweight[:, :k].float()).to(dy.dtype)

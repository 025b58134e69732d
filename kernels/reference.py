"""Torch reference twins of the W8A16 kernels: they define the numbers (fp32 accumulation; per-row scale, bias and
the optional tanh-GeLU in the epilogue; output in the activation's dtype) and run anywhere. `qweight` may be wider
than the activation's K (slab files pad K): the padding columns are ignored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def int8_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                    activation: str | None = None) -> torch.Tensor:
    k = x.shape[-1]
    check_weight(qweight, scale, k, "int8_linear", bias)
    if activation not in (None, "gelu_tanh"):
        raise ValueError(f"int8_linear: unknown activation {activation!r} (supported: 'gelu_tanh')")
    acc = x.float() @ qweight[:, :k].float().t()
    acc = acc * scale.float().reshape(-1)
    if bias is not None:
        acc = acc + bias.float().reshape(-1)
    if activation == "gelu_tanh":
        acc = F.gelu(acc, approximate="tanh")
    return acc.to(x.dtype)


def int8_linear_grad_input_ref(dy: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, k: int | None = None) -> torch.Tensor:
    k = qweight.shape[1] if k is None else k
    check_weight(qweight, scale, k, "int8_linear_grad_input")
    if dy.shape[-1] != qweight.shape[0]:
        raise ValueError(f"int8_linear_grad_input: dy has {dy.shape[-1]} features, qweight has {qweight.shape[0]} rows")
    return ((dy.float() * scale.float().reshape(-1)) @ qweight[:, :k].float()).to(dy.dtype)


def check_weight(qweight, scale, k, what, bias=None):
    """The weight's checks, for the twins and the Triton launchers alike: one contract, one set of messages."""
    if qweight.dim() != 2 or qweight.dtype != torch.int8:
        raise ValueError(f"{what}: qweight must be a 2-D int8 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    if k < 0 or k > qweight.shape[1]:
        raise ValueError(f"{what}: K={k} is wider than qweight's {qweight.shape[1]} columns")
    if scale.numel() != qweight.shape[0]:
        raise ValueError(f"{what}: scale has {scale.numel()} elements, qweight has {qweight.shape[0]} rows")
    if bias is not None and bias.numel() != qweight.shape[0]:
        raise ValueError(f"{what}: bias has {bias.numel()} elements, qweight has {qweight.shape[0]} rows")


def grouped_out_features(q: torch.Tensor, rows_are_out: bool) -> int:
    """The output width of a grouped product with the stack q [E, R, C] (grouped.py)."""
    return q.shape[1] if rows_are_out else q.shape[2]


def check_grouped_args(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor, rows_are_out: bool) -> None:
    """Shapes that agree, named: a wrong stack or routing must not compute garbage."""
    if q.dim() != 3 or x.dim() != 2:
        raise ValueError(f"grouped low-bit GEMM: x must be [S, K] and q [E, R, C], got x {list(x.shape)}, "
                         f"q {list(q.shape)}")
    e, r, c = q.shape
    k = c if rows_are_out else r
    if x.shape[1] != k:
        raise ValueError(f"grouped low-bit GEMM: x has {x.shape[1]} features, the stack {list(q.shape)} reduces "
                         f"over {k} ({'rows are outputs' if rows_are_out else 'rows are inputs'})")
    if scale.shape != (e, r):
        raise ValueError(f"grouped low-bit GEMM: the scale must be one per stored row, [{e}, {r}], got "
                         f"{list(scale.shape)}")
    if offs.shape != (e,):
        raise ValueError(f"grouped low-bit GEMM: offs must hold one end per expert ({e}), got {list(offs.shape)}")


def grouped_lowbit_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor,
                       rows_are_out: bool) -> torch.Tensor:
    """The torch twin: dequantize the stack to x's dtype, one GEMM per expert (reads `offs` on the host)."""
    check_grouped_args(x, q, scale, offs, rows_are_out)
    dense = (q.to(torch.float32) * scale.unsqueeze(-1)).to(x.dtype)
    b = dense.transpose(-2, -1) if rows_are_out else dense
    y = x.new_zeros(x.shape[0], b.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            y[start:end] = x[start:end] @ b[e]
        start = end
    return y

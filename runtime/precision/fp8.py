""""fp8": E4M3 weights with one fp32 scale per output row (adaptive-fp8.txt; issue 10).

Streams one byte per weight like INT8 (plus 4 bytes of scale per row). On a
GPU with FP8 tensor cores (compute capability 8.9 and up) both the forward and
the grad-input run `torch._scaled_mm`: the activation (or the incoming
gradient) is quantized to E4M3 per row on the fly; the weight's per-row scale
is the GEMM's column scale in the forward, and in the grad-input (where the
weight's rows are the reduction dimension) it is folded into the gradient
before that is quantized. Elsewhere fp8 is refused (`check_device`) unless the
user asked for the emulation (selective_precision.fp8_emulate): the
dequantized weight in the activation's dtype, exactly what the stored bytes
mean, without the activation rounding of the tensor-core path.
"""

from __future__ import annotations

import functools
import torch
import torch.nn.functional as F

from torch_stagehand.kernels.fp8_quant import E4M3, quantize_rows, quantize_rows_ref, transpose_bytes

from torch_stagehand.runtime.precision.base import OneBytePerRow
from torch_stagehand.runtime.precision.fp8_graph import fp8_linear_in_graph


class Fp8UnsupportedError(RuntimeError):
    """fp8 was asked for on a device without FP8 tensor cores and no emulation was allowed."""


def has_fp8_tensor_cores(device: torch.device) -> bool:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return _capability_at_least_89(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capability_at_least_89(index: int) -> bool:  # asked on every fp8 linear: once per device
    return torch.cuda.get_device_capability(index) >= (8, 9)


def quantize_rows_e4m3(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, k] -> (E4M3 [n, k], fp32 scale [n]) with w ~= q * scale[:, None]; absmax per row maps to 448.

    The activations' per-row arithmetic (kernels/fp8_quant.py), in torch ops wherever the weight is."""
    q, scale = quantize_rows_ref(w)
    return q, scale.view(-1)


def dequantize_rows_e4m3(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


def scaled_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x @ (q * scale)^T (+ bias) on FP8 tensor cores."""
    n, k = q.shape
    if k % 16 or n % 16:
        raise ValueError(f"fp8: torch._scaled_mm needs in/out features divisible by 16, got [{n}, {k}]")
    xq, xs = quantize_rows(x.reshape(-1, k))  # one fused kernel on the GPU (kernels/fp8_quant.py)
    # Row-wise scaled FP8 GEMMs return bf16 only; an fp16 / fp32 model gets its dtype back after. The bias
    # is a separate add: cuBLASLt refuses a bias with row-wise scales at some shapes (CUBLAS_STATUS_NOT_SUPPORTED
    # at 16 x 3072 x 3072 on an H100, torch 2.11 + CUDA 13) though it takes it at others. In compiled blocks
    # the rewrite puts that add in the graph instead (Fp8PerRow.bias_in_graph) and passes no bias here.
    # Fast accumulation in the forward only, as torchao's float8 training recipe: 7-15% faster GEMMs on an H100
    # (fp8_parts_h100.json); the grad-input keeps the promoted accumulation over its long reductions.
    y = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=scale.view(1, n), out_dtype=torch.bfloat16,
                         use_fast_accum=True)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], n)


@functools.lru_cache(maxsize=64)
def _ones_row(k: int, device: torch.device) -> torch.Tensor:
    """The grad-input's unit column scale (its real scale went into dy): one per width, not one per call."""
    return torch.ones(1, k, dtype=torch.float32, device=device)


def scaled_grad_input(dy: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """dx = dy @ (q * scale) on FP8 tensor cores: the row scale (the reduction dim) goes into dy first."""
    n, k = q.shape
    dq, ds = quantize_rows(dy.reshape(-1, n), col_scale=scale)  # (dy * scale) quantized in one kernel
    # _scaled_mm wants its second operand column-major (Hopper's FP8 GEMMs are TN only): a transposed
    # copy of the 1-byte weight, made by a tiled kernel (torch's own copy is ~8x slower at 1 byte).
    dx = torch._scaled_mm(dq, transpose_bytes(q).t(), scale_a=ds, scale_b=_ones_row(k, q.device),
                          out_dtype=torch.bfloat16)
    if dx.dtype != dy.dtype:
        dx = dx.to(dy.dtype)
    return dx.view(*dy.shape[:-1], k)


class Fp8PerRow(OneBytePerRow):
    name = "fp8"
    code = 2
    weight_dtype = E4M3

    def bias_in_graph(self, lay) -> bool:
        # cuBLASLt's row-wise FP8 GEMM takes no bias at some shapes; a separate add inside the op is a full
        # pass over the output (0.13 ms at 4096 x 12288 on an H100), an add in the graph fuses into the next op.
        return True

    def graph_linear(self, lay, device, rows):
        # The tensor-core math only: the emulation stays the op's (asked for explicitly, never fast).
        return fp8_linear_in_graph if has_fp8_tensor_cores(device) else None

    def quantize(self, weight: torch.Tensor, quantizer: str) -> tuple[torch.Tensor, torch.Tensor]:
        # `quantizer` names the INT8 clipping search; E4M3 keeps the row's absmax (its spacing is relative).
        return quantize_rows_e4m3(weight)

    def linear_from_slot(self, x, slot, bias, lay):
        q, s = self.views(slot, lay)
        if has_fp8_tensor_cores(x.device):
            return scaled_linear(x, q, s, bias)
        return F.linear(x, dequantize_rows_e4m3(q, s, x.dtype), bias)

    def grad_input_from_slot(self, dy, slot, lay):
        q, s = self.views(slot, lay)
        if has_fp8_tensor_cores(dy.device):
            return scaled_grad_input(dy, q, s)
        return dy @ dequantize_rows_e4m3(q, s, dy.dtype)

    def check_device(self, device: torch.device, emulate: bool) -> None:
        if emulate or has_fp8_tensor_cores(device):
            return
        device = torch.device(device)
        what = (f"{torch.cuda.get_device_name(device)} (compute capability "
                f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
                if device.type == "cuda" and torch.cuda.is_available() else f"the {device.type} device")
        raise Fp8UnsupportedError(
            f"precision 'fp8' needs FP8 tensor cores (compute capability 8.9+, e.g. Ada or Hopper); {what} has "
            "none. Set selective_precision.fp8_emulate=true to compute a dequantized emulation instead")

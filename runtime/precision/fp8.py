""""fp8": E4M3 weights with one fp32 scale per output row. On FP8 tensor cores (8.9+) the Linear runs
`torch._scaled_mm` on per-row E4M3 activations (the weight's row scale folded into the gradient for grad-input);
elsewhere fp8 is refused unless selective_precision.fp8_emulate asks for the dequantized emulation."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from torch_stagehand.kernels.fp8_quant import E4M3, quantize_rows, quantize_rows_ref, transpose_bytes
from torch_stagehand.runtime.precision.base import OneBytePerRow
from torch_stagehand.runtime.precision.fp8_graph import fp8_linear_in_graph, scaled_backward, scaled_forward


class Fp8UnsupportedError(RuntimeError):
    """fp8 was asked for on a device without FP8 tensor cores and no emulation was allowed."""


def has_fp8_tensor_cores(device: torch.device) -> bool:
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and _capability_at_least_89(
        device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capability_at_least_89(index: int) -> bool:  # asked on every fp8 linear: once per device
    return torch.cuda.get_device_capability(index) >= (8, 9)


def quantize_rows_e4m3(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, k] -> (E4M3 [n, k], fp32 scale [n]), w ~= q * scale[:, None]: the activations' arithmetic, in torch."""
    q, scale = quantize_rows_ref(w)
    return q, scale.view(-1)


def dequantize_rows_e4m3(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


def scaled_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x @ (q * scale)^T (+ bias) on FP8 tensor cores."""
    n, k = q.shape
    if k % 16 or n % 16:
        raise ValueError(f"fp8: torch._scaled_mm needs in/out features divisible by 16, got [{n}, {k}]")
    y = scaled_forward(x, q, scale, quantize_rows)
    return y if bias is None else y + bias  # a separate add: cuBLASLt refuses a bias with row-wise scales


@functools.lru_cache(maxsize=64)
def _ones_row(k: int, device: torch.device) -> torch.Tensor:
    """The grad-input's unit column scale (its real scale went into dy): one per width, not one per call."""
    return torch.ones(1, k, dtype=torch.float32, device=device)


def scaled_grad_input(dy: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """dx = dy @ (q * scale) on FP8 tensor cores, with the fused quantize and transpose kernels."""
    return scaled_backward(dy, q, scale, _ones_row(q.shape[1], q.device), quantize_rows, transpose_bytes)


class Fp8PerRow(OneBytePerRow):
    name = "fp8"
    code = 2
    weight_dtype = E4M3

    def bias_in_graph(self, lay) -> bool:
        # cuBLASLt's row-wise FP8 GEMM takes no bias at some shapes; an add in the graph fuses into the next op.
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

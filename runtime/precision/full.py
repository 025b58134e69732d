""""bf16": the weights exactly as the model holds them (its own dtype and layout: a float32 model streams float32).
The master copy: the modules keep views of this entry's buffer, so it is never derived from anything."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from torch_stagehand.runtime.host.copy import copy_to_host
from torch_stagehand.runtime.precision.base import Precision
from torch_stagehand.runtime.precision.layout import DTYPE_CODES, LayerLayout, dense_view, logical

if TYPE_CHECKING:
    from torch_stagehand.runtime.blocks import StreamedLayerSpec


class FullPrecision(Precision):
    name = "bf16"
    code = 0
    derived_from_master = False
    # The dtypes a master can hold: the ones the ops compute in (and INT8 quantizes from).
    dtypes = (torch.bfloat16, torch.float16, torch.float32)

    def layer_nbytes(self, spec: "StreamedLayerSpec") -> tuple[int, int]:
        w = spec.weight
        return w.numel() * w.element_size(), 0

    def layer_layout(self, spec: "StreamedLayerSpec", offset: int, scale_offset: int) -> LayerLayout:
        return LayerLayout(self.code, offset, spec.out_features, spec.in_features, -1, spec.transposed,
                           DTYPE_CODES[spec.weight.dtype])

    def views(self, buf: torch.Tensor, lay: LayerLayout) -> tuple[torch.Tensor, ...]:
        return (dense_view(buf, lay),)

    def write(self, buf: torch.Tensor, lay: LayerLayout, weight: torch.Tensor, quantizer: str) -> None:
        copy_to_host(logical(dense_view(buf, lay), lay), weight)

    def linear_from_slot(self, x, slot, bias, lay):
        return F.linear(x, logical(dense_view(slot, lay), lay), bias)

    def grad_input_from_slot(self, dy, slot, lay):
        return dy @ logical(dense_view(slot, lay), lay)

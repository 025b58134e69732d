"""One Linear-like rule (`runtime/linear_like.py`), shared by the streaming engine and the slab format."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torch_stagehand.runtime.blocks import streamed_layers
from torch_stagehand.runtime.linear_like import is_conv1d
from torch_stagehand.runtime.slab.layers import iter_linear_layers

pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
Conv1D = pytorch_utils.Conv1D


class Conv1D_LookAlike(nn.Module):
    """Named like transformers' Conv1D with its attributes, but from elsewhere: not one."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.zeros(nx, nf))


Conv1D_LookAlike.__name__ = "Conv1D"


class Conv1DSubclass(Conv1D):
    pass


def test_the_rule_holds_for_linear_conv1d_and_neither():
    assert is_conv1d(Conv1D(8, 4))  # transformers' GPT-2 Conv1D: weight [in, out]
    assert is_conv1d(Conv1DSubclass(8, 4))  # a subclass of it is one too
    assert not is_conv1d(nn.Linear(4, 8))
    assert not is_conv1d(nn.Conv1d(4, 8, 1))  # torch's convolution: neither
    assert not is_conv1d(Conv1D_LookAlike(8, 4))  # a class that only borrows the name


def test_engine_and_slab_count_the_same_layers_the_same_way():
    # Each block holds one of each kind; the engine must stream exactly the layers a
    # slab would store, with the same [in, out] reading of a Conv1D's weight.
    def block():
        return nn.ModuleDict({"lin": nn.Linear(4, 6), "c1d": Conv1D(6, 4), "sub": Conv1DSubclass(5, 4),
                              "other": Conv1D_LookAlike(6, 4), "conv": nn.Conv1d(4, 6, 1)})

    model = nn.Module()
    model.blocks = nn.ModuleList([block(), block()])
    streamed = {s.fqn: (s.out_features, s.in_features, s.transposed)
                for s in streamed_layers(model, ["blocks.0", "blocks.1"])}
    in_slab = {li.name: (li.out_features, li.in_features, li.layout == "conv1d") for li in iter_linear_layers(model)}
    assert streamed == in_slab
    assert in_slab["blocks.0.lin"] == (6, 4, False)
    assert in_slab["blocks.0.c1d"] == (6, 4, True) and in_slab["blocks.1.sub"] == (5, 4, True)
    assert not any(name.endswith((".other", ".conv")) for name in in_slab)


def test_adapter_paths_are_the_lora_ones():
    from torch_stagehand.runtime.linear_like import is_adapter_path

    assert is_adapter_path("blocks.0.attn.to_q.lora_A.default")
    assert is_adapter_path("layers.3.mlp.up_proj.lora_magnitude_vector")
    assert not is_adapter_path("blocks.0.attn.to_q.base_layer")
    assert not is_adapter_path("blocks.0.flora.proj")  # a name that only contains "lora"

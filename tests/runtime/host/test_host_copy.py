"""Device-to-host copies through the pinned bounce buffer (runtime/host/copy.py), and the GPU quantizer's
larger chunks (kernels/quantize.py): the same bytes as the plain paths."""

from __future__ import annotations

import pytest
import torch

from torch_stagehand.kernels import quantize_per_row
from torch_stagehand.runtime.host import copy as host_copy


def test_a_host_source_is_a_plain_copy_and_leaves_no_bounce_buffer():
    src = torch.randn(6, 4, dtype=torch.bfloat16)
    dst = torch.empty(4, 6, dtype=torch.bfloat16).t()  # a transposed view, as a Conv1D layout is
    host_copy.copy_to_host(dst, src)
    assert torch.equal(dst, src) and host_copy._bounce == []


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["rows", "transposed", "padded"])
def test_gpu_to_pageable_goes_through_the_bounce_and_copies_every_byte(layout):
    src = torch.randn(300, 200, device="cuda", dtype=torch.bfloat16)
    flat = torch.full((300 * 256,), -1.0, dtype=torch.bfloat16)
    dst = {"rows": lambda: flat[:300 * 200].view(300, 200),
           "transposed": lambda: flat[:300 * 200].view(200, 300).t(),
           "padded": lambda: flat.view(300, 256)[:, :200]}[layout]()  # rows padded to a slab's width
    assert not dst.is_pinned()
    host_copy.copy_to_host(dst, src)
    assert torch.equal(dst, src.cpu())
    if layout == "padded":
        assert (flat.view(300, 256)[:, 200:] == -1).all()  # the padding is left alone
    assert host_copy._bounce and host_copy._bounce[0].is_pinned()
    q = torch.randint(-127, 128, (64, 96), device="cuda", dtype=torch.int8)
    q_dst = torch.empty(64, 96, dtype=torch.int8)
    host_copy.copy_to_host(q_dst, q)  # the bounce is reused (it is large enough)
    assert torch.equal(q_dst, q.cpu())
    host_copy.release()
    assert host_copy._bounce == []


@pytest.mark.gpu
def test_gpu_quantizer_chunks_give_the_rows_of_small_chunks(patch_config):
    w = torch.randn(3000, 512, device="cuda", dtype=torch.bfloat16)
    w[7, 3] = 40.0  # an outlier row: its clipping search picks a ratio below 1
    q_big, s_big = quantize_per_row(w)
    patch_config(quantize_gpu_chunk=1)  # back to 1024-row chunks
    q_small, s_small = quantize_per_row(w)
    assert torch.equal(q_big, q_small) and torch.equal(s_big, s_small)

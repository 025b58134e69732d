"""The precision registry: a precision is one entry, and nothing outside runtime/precision/ changes to add one.

The proof is a test-only dummy, "half8" (weights stored as float16 in the
host buffer and the slot, computed in the activation's dtype), registered from
here: offload, the eager path, the compiled path (the ops only see its code in
the layouts) and the host store's rebuild-on-write all work for it unchanged.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import torch_stagehand as stagehand
from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime.precision import DTYPE_CODES, LayerLayout, Precision, PrecisionMapError
from torch_stagehand.runtime.precision.layout import dense_view

from _helpers import assert_exact, rel_err, toy

HALF8_BLOCKS = (1, 3)


class Half8(Precision):
    """Dummy: the weight rounded to float16, stored [out, in], derived from the full-precision master."""

    name = "half8"
    code = 42
    derived_from_master = True

    def layer_nbytes(self, spec):
        return 2 * spec.out_features * spec.in_features, 0

    def layer_layout(self, spec, offset, scale_offset):
        return LayerLayout(self.code, offset, spec.out_features, spec.in_features, -1, False, DTYPE_CODES[torch.float16])

    def views(self, buf, lay):
        return (dense_view(buf, lay),)

    def write(self, buf, lay, weight, quantizer):
        dense_view(buf, lay).copy_(weight)

    def linear_from_slot(self, x, slot, bias, lay):
        return F.linear(x, dense_view(slot, lay).to(x.dtype), bias)

    def grad_input_from_slot(self, dy, slot, lay):
        return dy @ dense_view(slot, lay).to(dy.dtype)


@pytest.fixture
def half8():
    entry = precisions.register(Half8())
    yield entry
    precisions.unregister(entry.name)


def _half8_reference(model, blocks=HALF8_BLOCKS):
    """A plain copy whose half8 blocks hold their weights rounded through float16."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for b in blocks:
            for lin in (ref.blocks[b].up, ref.blocks[b].down):
                lin.weight.copy_(lin.weight.half().float())
    return ref


def _forward_and_input_grad(fn, x):
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    y.square().sum().backward()
    return y.detach(), x.grad


def test_registry_lookups_and_guards(half8):
    assert precisions.names()[:2] == ("bf16", "int8") and "half8" in precisions.names()
    assert precisions.get("half8") is half8 and precisions.by_code(42) is half8
    assert precisions.get("int8").code == 1 and precisions.by_code(0).name == "bf16"
    with pytest.raises(ValueError, match="exists already"):
        precisions.register(Half8())
    clash = Half8()
    clash.name = "other"
    with pytest.raises(ValueError, match="code 42 is taken by 'half8'"):
        precisions.register(clash)
    with pytest.raises(ValueError, match="full-precision master"):
        precisions.unregister("bf16")
    with pytest.raises(KeyError, match="no precision has code 99"):
        precisions.by_code(99)


def test_validate_precision_map_is_one_set_of_rules():
    fqns = ["blocks.0", "blocks.1", "blocks.2"]
    assert precisions.validate_precision_map("int8", fqns) == {0: "int8", 1: "int8", 2: "int8"}
    assert precisions.validate_precision_map({"blocks.2": "int8"}, fqns) == {0: "bf16", 1: "bf16", 2: "int8"}
    assert precisions.validate_precision_map({1: "int8"}, 3, base={0: "int8", 1: "bf16", 2: "bf16"}) == {
        0: "int8", 1: "int8", 2: "bf16"}
    for bad, words in [("fp4", "unknown precision 'fp4'"), ({1: "fp4"}, "unknown precision 'fp4'"),
                       ({5: "int8", 7: "int8"}, r"block\(s\) \[5, 7\]; block 5 does not exist.*blocks 0..2"),
                       ({"blocks.9": "int8"}, "no block named 'blocks.9'"), ({True: "int8"}, "neither a block index"),
                       (3, "or a dict block -> precision")]:
        with pytest.raises(PrecisionMapError, match=words):
            precisions.validate_precision_map(bad, fqns)
    with pytest.raises(PrecisionMapError, match=r"blocks \[2\] have no precision"):
        precisions.validate_precision_map({0: "bf16"}, fqns, base={1: "bf16"})


def test_unregistered_precision_is_unknown_everywhere():
    model, _ = toy()
    with pytest.raises(PrecisionMapError, match="unknown precision 'half8'"):
        stagehand.offload(model, device="cpu", precision={1: "half8"})


def test_dummy_precision_streams_eagerly_and_compiled(half8):
    model, x = toy(n=4)
    full_ref = copy.deepcopy(model)
    ref = _half8_reference(model)
    rt = stagehand.offload(model, device="cpu", precision={b: "half8" for b in HALF8_BLOCKS})
    try:
        assert rt.precision == {0: "bf16", 1: "half8", 2: "bf16", 3: "half8"}
        # The host store laid it out and built it from the master: float16 bytes, half of fp32's.
        assert rt.store.nbytes(1, "half8") * 2 == rt.store.nbytes(1, "bf16")
        assert torch.equal(precisions.layer_views(rt.store.buffer(1, "half8"), rt.store.layout(1, "half8")[0])[0],
                           full_ref.blocks[1].up.weight.half())

        want_y, want_dx = _forward_and_input_grad(ref, x)
        assert rel_err(want_y, full_ref(x)) > 1e-6  # float16 rounding is visible: the dummy really ran

        eager_y, eager_dx = _forward_and_input_grad(model, x)
        # the dummy's ops on the float16 weights, as the reference runs them: measured 0 (CPU, torch 2.13, 3 seeds)
        assert_exact(eager_y, want_y)
        assert_exact(eager_dx, want_dx)

        torch._dynamo.reset()
        compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
        y, dx = _forward_and_input_grad(compiled, x)
        assert_exact(y, want_y)  # measured 0
        assert_exact(dx, want_dx)
        streamed = {prec for _, prec, _ in rt.pool.resident().values()}
        assert "half8" in streamed and rt.stats()["precision_counts"] == {"bf16": 2, "half8": 2}

        # A write to the master (load_state_dict) makes the derived copy stale: it is rebuilt.
        new_state = {k: v * 0.5 for k, v in full_ref.state_dict().items()}
        model.load_state_dict(new_state)
        full_ref.load_state_dict(new_state)
        with torch.no_grad():
            assert_exact(compiled(x), _half8_reference(full_ref)(x))  # measured 0
    finally:
        rt.restore()
        torch._dynamo.reset()


def test_ops_compute_a_code_they_never_heard_of(half8):
    """The op schemas carry the layout; its code finds the entry at run time."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 5, generator=g)
    lay = half8.layer_layout(_Spec(6, 5), 0, -1)
    slot = torch.zeros(256, dtype=torch.uint8)
    half8.write(slot, lay, w, "mse")
    x, dy = torch.randn(3, 5, generator=g), torch.randn(3, 6, generator=g)
    tok = torch.tensor(-1)
    y = torch.ops.stagehand.linear(x, slot, None, tok, tok, lay.as_ints())
    dx = torch.ops.stagehand.linear_grad_input(dy, slot, lay.as_ints())
    assert torch.equal(y, F.linear(x, w.half().float())) and torch.equal(dx, dy @ w.half().float())


class _Spec:
    def __init__(self, out_features, in_features):
        self.out_features, self.in_features = out_features, in_features

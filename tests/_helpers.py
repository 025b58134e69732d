"""Shared helpers for the backend tests: reference models and error measures."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_stagehand.kernels import dequantize, quantize_per_row
from torch_stagehand.runtime.blocks import find_blocks, streamed_layers


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_exact(actual: torch.Tensor, expected: torch.Tensor, msg: str | None = None) -> None:
    """Bitwise-equal values (shape and dtype too): for an fp32 path that runs the reference's own ops."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=msg)


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """`rel_err(a, b) < tol`, where `tol == 0` asks for bitwise-equal values (a parametrised exact case)."""
    if tol == 0:
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return rel_err(a, b) < tol


def first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return out[0]
    return out.logits if hasattr(out, "logits") else out[0]


def int8_reference(model: nn.Module, precision: dict[int, str] | str, quantizer: str = "mse") -> nn.Module:
    """A plain copy of `model` whose INT8 blocks hold dequantized weights: what INT8 streaming computes."""
    ref = copy.deepcopy(model)
    blocks = find_blocks(ref)
    precision = {b: precision for b in range(len(blocks))} if isinstance(precision, str) else precision
    with torch.no_grad():
        for spec in streamed_layers(ref, blocks):
            if precision.get(spec.block, "bf16") != "int8":
                continue
            w = spec.weight
            q, s = quantize_per_row(spec.as_matrix(w.detach()), method=quantizer)
            deq = dequantize(q, s, torch.float32)
            w.copy_((deq.t() if spec.transposed else deq).reshape(w.shape).to(w.dtype))
    return ref


class Block(nn.Module):
    def __init__(self, d: int, graph_break: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d, bias=False)
        self.graph_break = graph_break

    def forward(self, x):
        h = F.gelu(self.up(self.norm(x)))
        if self.graph_break:
            torch._dynamo.graph_break()
        return x + self.down(h)


class ToyModel(nn.Module):
    """Embedding linear, `n` pre-norm MLP blocks, head. Small enough for exact fp32 checks."""

    def __init__(self, d: int = 32, n: int = 4, graph_break_in: int | None = None):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList([Block(d, graph_break=(i == graph_break_in)) for i in range(n)])
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def toy(d=32, n=4, dtype=torch.float32, graph_break_in=None, seed=0):
    torch.manual_seed(seed)
    model = ToyModel(d, n, graph_break_in).to(dtype)
    model.requires_grad_(False)
    x = torch.randn(2, 5, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return model, x


# Each layer's pieces start on this boundary in a block's flat buffer (runtime/precision/layout.py ALIGN).
_BOUNDARY = 256


def _aligned(n: int) -> int:
    return -(-n // _BOUNDARY) * _BOUNDARY


def block_bytes_by_precision(model: nn.Module) -> dict[str, list[int]]:
    """Each block's streamed bytes in bf16 (the model's own dtype) and in int8, from the Linear shapes alone.

    Computed here, not read from the host store or the slot pool, so a residency bound
    built on it checks the pool instead of restating it. Call before `offload`.
    """
    blocks = find_blocks(model)
    full, int8 = [0] * len(blocks), [0] * len(blocks)
    for spec in streamed_layers(model, blocks):
        n, k = spec.out_features, spec.in_features
        full[spec.block] += _aligned(n * k * spec.module.weight.element_size())
        int8[spec.block] += _aligned(n * k) + _aligned(4 * n)  # int8 weight, fp32 per-row scale
    return {"bf16": full, "int8": int8}


def two_largest_blocks(block_bytes: dict[str, list[int]], precision: dict[int, str] | str) -> int:
    """The bytes of the two largest blocks in the precision each runs in: what two slots can hold at most."""
    n = len(block_bytes["bf16"])
    per_block = precision if isinstance(precision, dict) else {b: precision for b in range(n)}
    sizes = sorted((block_bytes[per_block.get(b, "bf16")][b] for b in range(n)), reverse=True)
    return sum(sizes[:2])


class CheckpointedToy(nn.Module):
    """A `ToyModel` whose blocks run through torch.utils.checkpoint, as HF / diffusers call them."""

    def __init__(self, inner: nn.Module, use_reentrant: bool = False):
        super().__init__()
        self.inner = inner
        self.use_reentrant = use_reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = self.inner.embed(x)
        for block in self.inner.blocks:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.inner.head(x)


class RecordingPinner:
    """A pinner for CPU tests: records the ranges offload would page-lock (and can refuse the n-th one)."""

    locks = True

    def __init__(self, fail_at: int | None = None):
        self.fail_at = fail_at
        self.calls = 0
        self.locked: dict[int, int] = {}  # pointer -> bytes
        self.unlocked: list[int] = []
        self.drains = 0  # device synchronisations before unlocking (one per batch)

    def register(self, ptr: int, nbytes: int) -> None:
        from torch_stagehand.runtime.host.arena import PinError

        self.calls += 1
        if self.calls == self.fail_at:
            raise PinError(f"simulated: cudaHostRegister of {nbytes} bytes failed")
        assert ptr not in self.locked
        self.locked[ptr] = nbytes

    def drain(self) -> None:
        self.drains += 1

    def unregister(self, ptr: int) -> None:
        del self.locked[ptr]
        self.unlocked.append(ptr)


def page_locked(t) -> bool:
    """Are the pages under `t` page-locked for CUDA? Asks the driver about `t`'s own first byte.

    `Tensor.is_pinned()` asks about its storage's first byte only, so it says False for a buffer
    carved from a larger host allocation and locked in place (cudaHostRegister of its range),
    which is how the host store pins exactly what streams.
    """
    import ctypes

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    if not paths:
        raise RuntimeError("page_locked: libcudart is not loaded in this process")
    cudart = ctypes.CDLL(sorted(paths)[0])
    attributes = (ctypes.c_int * 64)()  # cudaPointerAttributes: the memory type is its first field
    err = cudart.cudaPointerGetAttributes(attributes, ctypes.c_void_p(t.data_ptr()))
    if err != 0:
        raise RuntimeError(f"page_locked: cudaPointerGetAttributes failed with cudaError {err}")
    return attributes[0] == 1  # cudaMemoryTypeHost: page-locked host memory (0: unregistered)


def square_loss_step(call, model, x):
    """One forward and backward of `mean(out**2)` from cleared grads: the output and every gradient, copied."""
    for p in model.parameters():
        p.grad = None
    out = call(x)
    out.float().square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

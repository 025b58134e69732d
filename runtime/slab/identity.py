"""Slab identity: which weights a slab was quantized from, recorded per layer and checked on load.

The sha256 of `SAMPLED_ROWS` rows (first, last, evenly between) of the ``[out, in]`` weight the builder quantized,
with the shape and row indices, once per dtype of `IDENTITY_DTYPES` (casting is deterministic: a checkpoint loaded
in another dtype is not refused). Other weights differ in every row; an edit of unsampled rows only, or of the bias,
is not seen."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from torch_stagehand.runtime.slab.errors import SlabIdentityError

SCHEME = "sha256-sampled-rows-1"
SAMPLED_ROWS = 8
IDENTITY_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_DTYPE_NAMES = {d: str(d).replace("torch.", "") for d in IDENTITY_DTYPES}


def sampled_rows(out_features: int) -> list[int]:
    """The rows a layer's identity hashes: first, last and evenly between (all of them if fewer)."""
    if out_features <= SAMPLED_ROWS:
        return list(range(out_features))
    return sorted({i * (out_features - 1) // (SAMPLED_ROWS - 1) for i in range(SAMPLED_ROWS)})


def _hash_rows(rows: torch.Tensor, indices: list[int], out_features: int, dtype: torch.dtype) -> str:
    h = hashlib.sha256(f"{SCHEME}:{out_features}x{rows.shape[1]}:{indices}:{_DTYPE_NAMES[dtype]}:".encode())
    cast = rows.detach().to("cpu", dtype).contiguous()
    h.update(cast.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class RowSampler:
    """Collects a layer's sampled rows as the writer's row chunks pass, then makes its identity record."""

    def __init__(self, out_features: int):
        self.out_features = out_features
        self.indices = sampled_rows(out_features)
        self._rows: dict[int, torch.Tensor] = {}

    def take(self, r0: int, chunk: torch.Tensor) -> None:
        """`chunk` holds rows [r0, r0 + len(chunk)); keep copies of the sampled ones (the chunk is reused)."""
        for i in self.indices:
            if r0 <= i < r0 + chunk.shape[0]:
                self._rows[i] = chunk[i - r0].detach().to("cpu", copy=True)

    def record(self) -> dict[str, Any]:
        missing = [i for i in self.indices if i not in self._rows]
        if missing:
            raise RuntimeError(f"slab identity: rows {missing} never passed the writer")
        rows = torch.stack([self._rows[i] for i in self.indices])
        hashes = {_DTYPE_NAMES[d]: _hash_rows(rows, self.indices, self.out_features, d) for d in IDENTITY_DTYPES}
        return {"scheme": SCHEME, "rows": list(self.indices), "sha256": hashes}


def record_problem(record: Any, out_features: int) -> str | None:
    """Why a manifest's identity record is malformed (None: it is well formed)."""
    if not isinstance(record, dict):
        return f"is {type(record).__name__}, expected an object"
    if record.get("scheme") != SCHEME:
        return f"scheme is {record.get('scheme')!r}, this runtime knows {SCHEME!r}"
    rows = record.get("rows")
    if not isinstance(rows, list) or not rows or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < out_features for i in rows):
        return f"rows must be a non-empty list of row indices below {out_features}, got {rows!r}"
    hashes = record.get("sha256")
    if not isinstance(hashes, dict) or not hashes or not all(
            isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in hashes.items()):
        return f"sha256 must map dtype names to sha256 hex digests, got {hashes!r}"
    return None


def check_layer(name: str, record: dict[str, Any] | None, weight: torch.Tensor, where: str) -> bool:
    """Compare a live ``[out, in]`` weight with the layer's recorded identity: False when there is nothing to
    compare with (no record, or none for its dtype); SlabIdentityError when the weights are not the slab's source."""
    dtype = _DTYPE_NAMES.get(weight.dtype)
    want = None if record is None or dtype is None else record["sha256"].get(dtype)
    if want is None:
        return False
    indices = record["rows"]
    if max(indices) >= weight.shape[0]:  # the shape checks name this; here it only must not index past the end
        raise SlabIdentityError(f"the model's weight has {weight.shape[0]} rows, the slab's source had more",
                                path=where, layer=name)
    got = _hash_rows(weight.detach()[indices], indices, weight.shape[0], weight.dtype)
    if got != want:
        raise SlabIdentityError(
            f"the slab was built from other weights than the model's: the model's {dtype} rows {indices} "
            f"hash to {got[:16]}..., the slab recorded {want[:16]}... for its source; rebuild the slab "
            "from this model's weights (or offload without slab=)", path=where, layer=name)
    return True

"""Slab identity: which weights a slab was quantized from, recorded per layer and checked on load.

What a slab records (per layer, under the layer's ``"stagehand"`` key, as
``"identity"``): the sha256 of `SAMPLED_ROWS` rows of the full-precision
``[out, in]`` weight the builder quantized (the first, the last and the rest
evenly between; all rows when there are fewer), hashed together with the shape
and the row indices, once for each floating dtype a model may hold the weight
in (`IDENTITY_DTYPES`): the rows cast to that dtype. Both builders hash the rows
as they pass through the writer, so no extra read is made and the streamed
build records what the build from a live module records.

Why a hash per dtype: a checkpoint saved in fp32 is routinely loaded in bf16
(and a bf16 one in fp32). Casting is deterministic (round to nearest even), so
a model's weight in its own dtype equals the source rows cast to that dtype bit
for bit; the check hashes the model's rows as they are and compares them with
the hash recorded for the model's dtype, and never refuses a mere cast.

Why sampled rows and not the whole tensor: the check runs on every
`offload(slab=...)`, before the first step. Hashing every full-precision weight
of a 12B model there is 24 GB of sha256 (tens of seconds on one core); eight
rows per layer are a few MB (milliseconds). Weights other than the slab's
source (another checkpoint or seed, a fine-tune, a merged LoRA) differ in every
row, so any sampled row tells them apart. What sampling cannot see is an edit
confined to rows that are not sampled: that is the accepted limit.

Not covered: the bias. A model's own bias stays resident and is what it
computes with; the slab's bias is only read for a model built on the meta
device, which has no weights to compare either.

Slabs without identity (built before it was recorded, or plain SquareQ slabs)
cannot be checked: `offload` loads them with a `SlabIdentityWarning`, or refuses
them (`SlabIdentityError`) when ``Config(require_slab_identity=True)``.
"""

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
        return {
            "scheme": SCHEME,
            "rows": list(self.indices),
            "sha256": {_DTYPE_NAMES[d]: _hash_rows(rows, self.indices, self.out_features, d) for d in IDENTITY_DTYPES},
        }


def record_problem(record: Any, out_features: int) -> str | None:
    """Why a manifest's identity record is malformed (None: it is well formed)."""
    if not isinstance(record, dict):
        return f"is {type(record).__name__}, expected an object"
    if record.get("scheme") != SCHEME:
        return f"scheme is {record.get('scheme')!r}, this runtime knows {SCHEME!r}"
    rows = record.get("rows")
    if not isinstance(rows, list) or not rows or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < out_features for i in rows
    ):
        return f"rows must be a non-empty list of row indices below {out_features}, got {rows!r}"
    hashes = record.get("sha256")
    if not isinstance(hashes, dict) or not hashes or not all(
        isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in hashes.items()
    ):
        return f"sha256 must map dtype names to sha256 hex digests, got {hashes!r}"
    return None


def check_layer(name: str, record: dict[str, Any] | None, weight: torch.Tensor, where: str) -> bool:
    """Compare a live ``[out, in]`` weight with the layer's recorded identity.

    Returns False when there is nothing to compare with (no record, or none for the
    weight's dtype); raises SlabIdentityError when the weights are not the slab's source.
    """
    if record is None or weight.dtype not in IDENTITY_DTYPES:
        return False
    dtype = _DTYPE_NAMES[weight.dtype]
    want = record["sha256"].get(dtype)
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
            "from this model's weights (or offload without slab=)",
            path=where, layer=name,
        )
    return True

"""Safetensors headers parsed and checked, files read with ``pread`` and written, without mmap.

The format: an 8-byte little-endian header length N, N bytes of JSON (``{"__metadata__": {str: str}, name:
{"dtype", "shape", "data_offsets"}}``, offsets from the header's end), then the tensors' bytes, tiling the data
region. Not ``safe_open``: every page a mapping touches counts as this process's resident memory, while ``pread``
into a small reused buffer goes through the page cache, which is not ours."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
import zlib
from dataclasses import dataclass

import torch

from torch_stagehand.runtime.slab import read_worker
from torch_stagehand.runtime.slab.errors import SlabHeaderError, SlabTruncatedError

if sys.byteorder != "little":  # safetensors is little-endian; we copy raw bytes.
    raise ImportError("torch_stagehand slab I/O needs a little-endian host")

# safetensors dtype tag -> torch dtype.
ST_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
}
# Manifest dtype strings (SquareQ spells them like torch) <-> safetensors tags.
MANIFEST_DTYPE_TO_TAG = {"int8": "I8", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}

# A header bigger than this is not a slab header but garbage (safetensors caps it too).
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors header; `start`/`end` are absolute file offsets."""

    name: str
    dtype: str  # safetensors tag, e.g. "I8"
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsHeader:
    path: str
    header_len: int
    header_bytes: bytes  # the raw JSON bytes, as hashed into the manifest
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]
    data_start: int
    data_end: int  # absolute offset one past the last tensor byte


def read_header(path: str, fd: int | None = None, any_dtype: bool = False) -> SafetensorsHeader:
    """Parse and check a safetensors header (else SlabHeaderError/SlabTruncatedError): a sane length, JSON, known
    dtypes (`any_dtype`: others kept, their sizes unchecked), shapes that agree with the byte ranges, byte ranges
    that tile the data region, a file long enough to hold them."""
    own = fd is None
    if own:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise SlabHeaderError(f"cannot open: {e}", path=path) from e
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise SlabTruncatedError(f"file is {size} bytes, shorter than the 8-byte header length", path=path)
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        if n == 0 or n > MAX_HEADER_BYTES:
            raise SlabHeaderError(f"header length {n} is not plausible (not a safetensors file?)", path=path)
        if 8 + n > size:
            raise SlabTruncatedError(f"header of {n} bytes runs past the end of the {size}-byte file", path=path)
        raw = bytearray(n)
        pread_into(fd, memoryview(raw), 8, path)
    finally:
        if own:
            os.close(fd)
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SlabHeaderError(f"header is not valid JSON: {e}", path=path) from e
    if not isinstance(obj, dict):
        raise SlabHeaderError("header JSON is not an object", path=path)
    meta = obj.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise SlabHeaderError("__metadata__ is not an object", path=path)
    data_start = 8 + n
    tensors: dict[str, TensorInfo] = {}
    for name, d in obj.items():
        try:
            tag, shape, (b, e) = d["dtype"], tuple(int(s) for s in d["shape"]), d["data_offsets"]
            b, e = int(b), int(e)
        except (KeyError, TypeError, ValueError) as exc:
            raise SlabHeaderError(f"tensor entry is malformed: {d!r}", path=path, layer=name) from exc
        if tag not in ST_DTYPES and not any_dtype:
            raise SlabHeaderError(f"unknown dtype {tag!r}", path=path, layer=name)
        if e < b or (tag in ST_DTYPES and e - b != math.prod(shape) * ST_DTYPES[tag].itemsize):
            raise SlabHeaderError(
                f"tensor {name!r}: byte range [{b}, {e}) does not hold {tag} {list(shape)}", path=path, layer=name)
        tensors[name] = TensorInfo(name, tag, shape, data_start + b, data_start + e)
    pos = data_start
    for t in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if t.start != pos:
            what = "overlaps the previous tensor" if t.start < pos else f"leaves a hole of {t.start - pos} bytes"
            raise SlabHeaderError(f"tensor {t.name!r} {what} in the data region", path=path, layer=t.name)
        pos = t.end
    if pos > size:
        raise SlabTruncatedError(
            f"file is {size} bytes but the header describes {pos} bytes (truncated by {pos - size})", path=path)
    return SafetensorsHeader(path, n, bytes(raw), {str(k): str(v) for k, v in meta.items()}, tensors, data_start, pos)


def pread_into(fd: int, buf: memoryview, offset: int, path: str, layer: str | None = None) -> None:
    """Fill `buf` (a writable byte memoryview) from `offset`; a short file raises SlabTruncatedError."""
    try:
        read_worker.pread_into(fd, buf, offset)
    except read_worker.LayerError as e:
        raise SlabTruncatedError(e.message, path=path, layer=layer) from None


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable flat byte view of a contiguous CPU tensor (any dtype, pinned or not)."""
    if t.device.type != "cpu":
        raise ValueError(f"expected a CPU (optionally pinned) tensor, got device {t.device}")
    if not t.is_contiguous():
        raise ValueError("expected a contiguous tensor")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def crc32_hex(value: int) -> str:
    return f"{value & 0xFFFFFFFF:08x}"


class IncrementalWriter:
    """Writes a safetensors file whose header is known up front, tensor bytes streamed in order, hashing the file
    (sha256) and each tensor (crc32) on the way for the manifest. Peak memory: one chunk."""

    def __init__(self, path: str, entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]):
        """`entries`: (name, dtype tag, shape) of the tensors, laid out back to back in this order."""
        self.path = path
        obj: dict = {"__metadata__": dict(metadata)}
        pos = 0
        for name, tag, shape in entries:
            end = pos + math.prod(shape) * ST_DTYPES[tag].itemsize
            obj[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [pos, end]}
            pos = end
        raw = json.dumps(obj, separators=(",", ":")).encode("utf-8")
        self.header_bytes = raw + b" " * ((-len(raw)) % 8)  # space-padded to 8 bytes, as safetensors writes it
        base = 8 + len(self.header_bytes)
        self.order = [name for name, _, _ in entries]
        self.offsets = {k: (base + obj[k]["data_offsets"][0], base + obj[k]["data_offsets"][1]) for k in self.order}
        self.total_bytes = base + pos
        self._f = open(path, "wb")
        self._sha = hashlib.sha256()
        self._crc: dict[str, int] = {}
        self._idx = 0  # index into self.order of the tensor being written
        self._pos = 0
        self._emit(struct.pack("<Q", len(self.header_bytes)) + self.header_bytes)

    def _emit(self, data) -> None:
        self._f.write(data)
        self._sha.update(data)
        self._pos += len(data)

    def write(self, name: str, data) -> None:
        """Append bytes of tensor `name`; tensors must come in header order and complete."""
        mv = memoryview(data).cast("B")
        while self._idx < len(self.order) and self._pos == self.offsets[self.order[self._idx]][1]:
            self._idx += 1  # finished tensors (and zero-sized ones) move on
        if self._idx >= len(self.order) or self.order[self._idx] != name:
            expected = self.order[self._idx] if self._idx < len(self.order) else "<end of file>"
            raise RuntimeError(f"slab writer: got bytes for {name!r}, expected {expected!r}")
        start, end = self.offsets[name]
        if self._pos + len(mv) > end:
            raise RuntimeError(f"slab writer: {name!r} overflows its {end - start} bytes")
        self._crc[name] = zlib.crc32(mv, self._crc.get(name, 0))
        self._emit(mv)

    def crc32(self, name: str) -> str:
        return crc32_hex(self._crc.get(name, 0))

    def close(self) -> tuple[int, str]:
        """Finish; returns (file size, sha256 hex). Raises if a tensor was left short."""
        if self._pos != self.total_bytes:
            self._f.close()
            raise RuntimeError(f"slab writer: wrote {self._pos} of {self.total_bytes} bytes")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return self._pos, self._sha.hexdigest()

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()

"""`SlabReader`: an INT8 slab (SquareQ V2 compatible) checked at open (`checks.py`, zero points, every byte with
``verify="full"``), its layers copied into caller-owned (pinned) buffers, each read checked (crc32, scales, zero
points, length). Plain SquareQ slabs (no checksums, no slab id) get every check that needs none of ours."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import torch
from torch import nn

from torch_stagehand.runtime.slab import checks
from torch_stagehand.runtime.slab.errors import (
    SlabChecksumError, SlabDtypeError, SlabError, SlabLayerNotFoundError, SlabMissingTensorError, SlabShapeError,
    SlabSignatureError, SlabUnsupportedError, SlabValueError,
)
from torch_stagehand.runtime.slab.layers import iter_linear_layers
from torch_stagehand.runtime.slab.manifest import LayerEntry, check_slab_name, load_manifest
from torch_stagehand.runtime.slab.safetensors_io import byte_view, crc32_hex, pread_into, read_header

# Bytes read per pread when a layer has to be narrowed (padded -> unpadded) or hashed.
_CHUNK_BYTES = 8 << 20


def slab_paths(output_dir: str | os.PathLike, slab_name: str) -> tuple[str, str]:
    """(safetensors path, manifest path) of slab `slab_name` in `output_dir` (a bare name: SlabPathError else)."""
    check_slab_name(slab_name)
    d = os.fspath(output_dir)
    return os.path.join(d, f"{slab_name}.safetensors"), os.path.join(d, f"{slab_name}.manifest.json")


class SlabReader:
    """Validated read access to one slab. Thread-safe reads (``pread`` on one fd).

    Args:
        manifest_path: ``{name}.manifest.json``.
        safetensors_path: defaults to the file the manifest names, else ``{name}.safetensors``.
        expected_signature: raise SlabSignatureError unless the manifest carries it.
        model: run ``check_model(model)`` at open.
        verify: ``"fast"`` (structure, hashes of the header, sizes, zero points) or
            ``"full"`` (also the file's sha256 and every tensor's crc32: reads the whole file).
        verify_checksums: re-check each tensor's crc32 on every read (when recorded).
        check_zero_points: check every layer's zero points at open (False: only as each layer is read, as offload does).
    """

    def __init__(self, manifest_path: str | os.PathLike, safetensors_path: str | os.PathLike | None = None, *,
                 expected_signature: str | None = None, model: nn.Module | None = None, verify: str = "fast",
                 verify_checksums: bool = True, check_zero_points: bool = True):
        if verify not in ("fast", "full"):
            raise ValueError(f"SlabReader: verify must be 'fast' or 'full', got {verify!r}")
        self.manifest_path = os.fspath(manifest_path)
        self.manifest = load_manifest(self.manifest_path)
        recorded = (self.manifest.stagehand or {}).get("safetensors_file")
        self.path = (os.fspath(safetensors_path) if safetensors_path
                     else os.path.join(os.path.dirname(self.manifest_path), recorded) if recorded
                     else self.manifest_path.removesuffix(".manifest.json") + ".safetensors")
        self.verify_checksums = verify_checksums
        self.layers: dict[str, LayerEntry] = self.manifest.layers
        self._fd: int | None = None
        if expected_signature is not None and self.manifest.model_signature != expected_signature:
            raise SlabSignatureError(f"model_signature is {self.manifest.model_signature!r}, expected "
                                     f"{expected_signature!r}", path=self.manifest_path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise SlabMissingTensorError(f"cannot open the slab file: {e}", path=self.path) from e
        try:
            self.header = read_header(self.path, self._fd)
            checks.check_slab_id(self.manifest, self.header, self.manifest_path, self.path)
            checks.check_tensors(self.manifest, self.header, self.manifest_path, self.path)
            checks.check_file_identity(self.manifest, self.header, os.fstat(self._fd).st_size, self.manifest_path,
                                       self.path)
            checks.check_own_signature(self.manifest, self.manifest_path)
            if check_zero_points:
                self.check_zero_points()
            if verify == "full":
                self.verify_full()
            if model is not None:
                self.check_model(model)
        except BaseException:
            self.close()
            raise

    def check_zero_points(self, threads: int = 1) -> None:
        """Every layer's zero points are zero (else SlabUnsupportedError naming the first such layer, in the slab's
        order). `threads`: reads at once (each a seek on a cold disk, which answers many at once faster)."""
        def problem(e: LayerEntry) -> SlabError | None:
            zp = torch.empty(e.out_features, dtype=torch.float32)
            try:
                self._read_tensor(e, e.zero_point_key, byte_view(zp))
            except SlabError as error:
                return error
            if not bool((zp == 0).all()):
                return SlabUnsupportedError(
                    f"zero_point is non-zero ({int((zp != 0).sum())} of {e.out_features} rows): only per-row "
                    "symmetric INT8 (zero_point 0) is supported", path=self.path, layer=e.name)
            return None

        entries = list(self.layers.values())
        with ThreadPoolExecutor(min(threads, max(1, len(entries))), thread_name_prefix="stagehand-zp") as pool:
            found = list(pool.map(problem, entries)) if threads > 1 else map(problem, entries)
        first = next((error for error in found if error is not None), None)
        if first is not None:
            raise first

    def verify_full(self) -> None:
        """Read the whole file: sha256 against the manifest and every tensor's crc32."""
        h = self.header
        sha = hashlib.sha256(h.header_len.to_bytes(8, "little") + h.header_bytes)
        owner = {k: e for e in self.layers.values() for k in e.tensor_keys()}
        view = byte_view(torch.empty(_CHUNK_BYTES, dtype=torch.uint8))
        for info in sorted(h.tensors.values(), key=lambda t: t.start):
            e, crc = owner[info.name], 0
            for _, chunk in self._chunks(info.start, info.end, _CHUNK_BYTES, view, e.name):
                crc = zlib.crc32(chunk, crc)
                sha.update(chunk)
            self._compare_crc(e, info.name, crc)
        want = (self.manifest.stagehand or {}).get("safetensors_sha256")
        if want is not None and sha.hexdigest() != want:
            raise SlabChecksumError(f"file sha256 {sha.hexdigest()} differs from the manifest's {want}",
                                    path=self.path)

    def _chunks(self, start: int, end: int, step: int, view: memoryview, layer: str):
        """(offset, bytes) of [start, end) read `step` bytes at a time into `view`."""
        for pos in range(start, end, step):
            n = min(step, end - pos)
            pread_into(self._fd, view[:n], pos, self.path, layer)
            yield pos, view[:n]

    def _compare_crc(self, e: LayerEntry, key: str, crc: int) -> None:
        want = (e.checksums or {}).get(key)
        if want is not None and self.verify_checksums and crc32_hex(crc) != want:
            raise SlabChecksumError(f"tensor {key!r} crc32 {crc32_hex(crc)} differs from the manifest's {want} "
                                    "(corrupt data)", path=self.path, layer=e.name)

    def _read_tensor(self, e: LayerEntry, key: str, dst: memoryview) -> None:
        info = self.header.tensors[key]
        if len(dst) != info.nbytes:
            raise SlabShapeError(f"buffer of {len(dst)} bytes for tensor {key!r} of {info.nbytes}",
                                 path=self.path, layer=e.name)
        pread_into(self._fd, dst, info.start, self.path, e.name)
        self._compare_crc(e, key, zlib.crc32(dst))

    def _entry(self, name: str) -> LayerEntry:
        if self._fd is None:
            raise SlabError("reader is closed", path=self.path, layer=name)
        e = self.layers.get(name)
        if e is None:
            raise SlabLayerNotFoundError("no such layer in the slab", path=self.path, layer=name)
        return e

    def _check_dst(self, e: LayerEntry, what: str, t: torch.Tensor, dtype: torch.dtype | None, shape) -> None:
        if dtype is not None and t.dtype != dtype:
            raise SlabDtypeError(f"{what} buffer is {t.dtype}, needs {dtype}", path=self.path, layer=e.name)
        numel = math.prod(shape)
        if tuple(t.shape) not in ((numel,), tuple(shape)):
            raise SlabShapeError(f"{what} buffer has shape {list(t.shape)}, needs {list(shape)} (or flat {numel})",
                                 path=self.path, layer=e.name)
        if t.device.type != "cpu" or not t.is_contiguous():
            raise SlabShapeError(f"{what} buffer must be a contiguous CPU tensor (pinned is fine)",
                                 path=self.path, layer=e.name)

    def read_layer_into(self, name: str, qweight_out: torch.Tensor, scale_out: torch.Tensor,
                        bias_out: torch.Tensor | None = None, *, padded: bool = False) -> None:
        """Copy layer `name` into preallocated contiguous CPU tensors; on any error (a SlabError naming the layer and
        file) their content is unspecified.

        qweight_out: int8, ``[out, in_features]`` (``padded=False``: the padding columns dropped) or
            ``[out, padded_in_features]`` (``padded=True``: the rows as stored, padding columns zero); or flat.
        scale_out: float32 ``[out]``.
        bias_out: ``[out]`` of any float dtype (cast from the stored fp32), only for a layer with a bias; None skips it.
        """
        e = self._entry(name)
        width = self._check_layer_buffers(e, qweight_out, scale_out, bias_out, padded)
        if width == e.padded_in_features:
            self._read_tensor(e, e.qweight_key, byte_view(qweight_out))
        else:
            self._read_narrowed(e, qweight_out.view(e.out_features, width))
        self._read_tensor(e, e.scale_key, byte_view(scale_out))
        if not bool(torch.isfinite(scale_out).all()):
            raise SlabValueError("scale holds NaN or Inf", path=self.path, layer=e.name)
        if not bool((scale_out != 0).any()):
            raise SlabValueError("scale is all zero (the layer would dequantize to zeros)", path=self.path, layer=e.name)
        zp = torch.empty(e.out_features, dtype=torch.float32)
        self._read_tensor(e, e.zero_point_key, byte_view(zp))
        if not bool((zp == 0).all()):
            raise SlabUnsupportedError("zero_point is non-zero", path=self.path, layer=e.name)
        if bias_out is not None:
            self.read_bias_into(name, bias_out)

    def _check_layer_buffers(self, e: LayerEntry, qweight_out: torch.Tensor, scale_out: torch.Tensor,
                             bias_out: torch.Tensor | None, padded: bool) -> int:
        """`read_layer_into`'s buffers checked against layer `e`; the qweight rows' width."""
        width = e.padded_in_features if padded else e.in_features
        self._check_dst(e, "qweight", qweight_out, torch.int8, (e.out_features, width))
        self._check_dst(e, "scale", scale_out, torch.float32, (e.out_features,))
        if bias_out is not None:
            if not e.has_bias:
                raise SlabShapeError("bias buffer given but the layer has no bias", path=self.path, layer=e.name)
            self._check_dst(e, "bias", bias_out, None, (e.out_features,))
        return width

    def layer_job(self, name: str, qweight_out: torch.Tensor, scale_out: torch.Tensor, bias_out: torch.Tensor | None,
                  locate) -> dict:
        """What `read_layer_into(name, qweight_out, scale_out, bias_out)` reads and checks, for read_worker.py: each
        tensor's byte range and recorded crc32, and where it goes (`locate(buffer)`: its place in the memory that
        process maps; `bias_out` float32 here). The buffers are checked as `read_layer_into` checks them."""
        e = self._entry(name)
        width = self._check_layer_buffers(e, qweight_out, scale_out, bias_out, padded=False)
        if bias_out is not None and bias_out.dtype != torch.float32:
            raise SlabDtypeError(f"bias buffer is {bias_out.dtype}, needs torch.float32", path=self.path, layer=e.name)

        def part(key: str, to: torch.Tensor | None) -> dict:
            info = self.header.tensors[key]
            crc = (e.checksums or {}).get(key) if self.verify_checksums else None
            return {"key": key, "start": info.start, "nbytes": info.nbytes, "crc": crc,
                    "to": None if to is None else locate(to)}

        job = {"layer": e.name, "qweight": part(e.qweight_key, qweight_out), "scale": part(e.scale_key, scale_out),
               "zero_point": part(e.zero_point_key, None),
               "bias": None if bias_out is None else part(e.bias_key, bias_out)}
        if width != e.padded_in_features:  # stored rows wider than the buffer's: the leading columns of each
            job["qweight"]["rows"] = [e.out_features, e.padded_in_features, width]
        return job

    def read_bias_into(self, name: str, bias_out: torch.Tensor) -> None:
        """Only layer `name`'s bias (stored fp32) into `bias_out` of any float dtype."""
        e = self._entry(name)
        if not e.has_bias:
            raise SlabShapeError("bias buffer given but the layer has no bias", path=self.path, layer=e.name)
        self._check_dst(e, "bias", bias_out, None, (e.out_features,))
        stored = bias_out if bias_out.dtype == torch.float32 else torch.empty(e.out_features, dtype=torch.float32)
        self._read_tensor(e, e.bias_key, byte_view(stored))
        if stored is not bias_out:
            bias_out.view(-1).copy_(stored)

    def _read_narrowed(self, e: LayerEntry, dst: torch.Tensor) -> None:
        # Stored rows are wider than the destination: a few rows at a time through a small scratch buffer.
        info, row = self.header.tensors[e.qweight_key], e.padded_in_features
        rows = max(1, _CHUNK_BYTES // row)
        scratch = torch.empty(min(rows, e.out_features) * row, dtype=torch.int8)
        crc = 0
        for pos, chunk in self._chunks(info.start, info.end, rows * row, byte_view(scratch), e.name):
            crc = zlib.crc32(chunk, crc)
            r0, n = (pos - info.start) // row, len(chunk) // row
            dst[r0:r0 + n].copy_(scratch[:n * row].view(n, row)[:, : e.in_features])
        self._compare_crc(e, e.qweight_key, crc)

    def read_layer(self, name: str, *, padded: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """New tensors (qweight int8, scale fp32, bias fp32 or None) for one layer."""
        e = self._entry(name)
        q = torch.empty(e.out_features, e.padded_in_features if padded else e.in_features, dtype=torch.int8)
        s = torch.empty(e.out_features, dtype=torch.float32)
        b = torch.empty(e.out_features, dtype=torch.float32) if e.has_bias else None
        self.read_layer_into(name, q, s, b, padded=padded)
        return q, s, b

    @property
    def fd(self) -> int:
        """The file's descriptor (a reader process reads through a copy of it: the very file opened and checked)."""
        if self._fd is None:
            raise SlabError("reader is closed", path=self.path)
        return self._fd

    def check_model(self, model: nn.Module, include_prefixes: Iterable[str] | None = None) -> dict[str, nn.Module]:
        """Check a live model against the slab (by canonical names; adapter Linears ignored); returns canonical
        name -> live module. Raises SlabModelMismatchError naming the first slab layer the model lacks or holds with
        another shape / bias / layout, or the first model layer in the slab's scope that the slab lacks, then
        SlabSignatureError if the signatures differ. The scope: `include_prefixes`, else the prefixes the slab was
        built with (our slabs), else the whole model (SquareQ's definition)."""
        return checks.check_model(self.manifest, model, include_prefixes, self.manifest_path)

    def check_identity(self, model: nn.Module, require: bool = False) -> int:
        """Check that the slab was quantized from `model`'s weights (`identity.py`); returns the layers checked.
        Raises SlabIdentityError naming the first layer whose weights differ from the slab's source (meta ones are
        skipped). `require`: a slab that records no identity is an error, not a warning."""
        weights = [(li.name, li.module.weight.detach().t() if li.layout == "conv1d" else li.module.weight.detach())
                   for li in iter_linear_layers(model) if li.name in self.layers and not li.module.weight.is_meta]
        return checks.check_identity(self.manifest, weights, self.manifest_path, require)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "SlabReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        return f"SlabReader({self.path!r}, layers={len(self.layers)}, signature={self.manifest.model_signature!r})"

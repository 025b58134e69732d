"""Slab manifest: the SquareQ V2 schema (github.com/CodeAlexx/SquareQ, ``src/squareq/manifest.py``) and our extras.

Ours live under a ``"stagehand"`` key, top level and per layer, which SquareQ never reads: the slab id, the file's
size and hashes, per-tensor crc32, the quantizer, the signature scope, the source layout and the identity
(`identity.py`). ``safetensors_file`` must be a bare file name in the manifest's folder."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from torch_stagehand.runtime.atomic_file import write_atomic
from torch_stagehand.runtime.slab import identity
from torch_stagehand.runtime.slab.errors import (
    SlabAbiError, SlabDtypeError, SlabManifestError, SlabPathError, SlabShapeError, SlabUnsupportedError,
)

CURRENT_KERNEL_ABI_VERSION = 1
SUPPORTED_QUANT_BITS = frozenset({8})
QUANT_VERSION = "squareq_bp8_v2"
QUANT_SCHEME = "per_row_symmetric"
MIN_RUNTIME_VERSION = "0.1.0"
STAGEHAND_FORMAT = "stagehand-slab-1"
# Header __metadata__ key binding a safetensors file to its manifest.
SLAB_ID_KEY = "stagehand_slab_id"


@dataclass
class LayerEntry:
    """One quantized layer, as the host store needs it (see `SlabManifest.layers`)."""

    name: str
    out_features: int
    in_features: int
    padded_in_features: int
    has_bias: bool
    qweight_key: str
    scale_key: str
    zero_point_key: str
    bias_key: str | None
    pad_k: int = 1
    quant_bits: int = 8
    quant_scheme: str = QUANT_SCHEME
    quant_axis: int = 0
    dtype_qweight: str = "int8"
    dtype_scale: str = "float32"
    dtype_zero_point: str = "float32"
    dtype_bias: str = "float32"
    block_id: str | None = None
    # Ours (None for a plain SquareQ slab): tensor key -> crc32 hex of its bytes.
    checksums: dict[str, str] | None = None
    source_layout: str = "linear"  # "linear" [out, in] or "conv1d" (stored [in, out] in the model)
    source_dtype: str | None = None
    # Ours (None: not recorded): hashes of sampled rows of the source weights, see identity.py.
    identity: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # unknown per-layer fields, kept on re-save

    @property
    def qweight_shape(self) -> tuple[int, int]:
        return (self.out_features, self.padded_in_features)

    @property
    def qweight_nbytes(self) -> int:
        return self.out_features * self.padded_in_features

    def tensor_specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(key, dtype, shape) of each of the layer's tensors, in file order."""
        rows = (self.out_features,)
        specs = [(self.qweight_key, self.dtype_qweight, self.qweight_shape), (self.scale_key, self.dtype_scale, rows),
                 (self.zero_point_key, self.dtype_zero_point, rows)]
        return specs + ([(self.bias_key, self.dtype_bias, rows)] if self.bias_key else [])

    def tensor_keys(self) -> list[str]:
        return [key for key, _, _ in self.tensor_specs()]

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(self.extra)
        d.update(
            canonical_name=self.name, qweight_key=self.qweight_key, scale_key=self.scale_key,
            zero_point_key=self.zero_point_key, bias_key=self.bias_key,
            orig_shape=[self.out_features, self.in_features],
            packed_shape=[self.out_features, self.padded_in_features], pad_k=self.pad_k, quant_bits=self.quant_bits,
            quant_scheme=self.quant_scheme, quant_axis=self.quant_axis, dtype_qweight=self.dtype_qweight,
            dtype_scale=self.dtype_scale, dtype_zero_point=self.dtype_zero_point, block_id=self.block_id)
        optional = {"source_dtype": self.source_dtype or None,
                    "crc32": None if self.checksums is None else dict(self.checksums), "identity": self.identity}
        d["stagehand"] = {"source_layout": self.source_layout, "dtype_bias": self.dtype_bias,
                          **{k: v for k, v in optional.items() if v is not None}}
        return d


@dataclass
class SlabManifest:
    """`{name}.manifest.json`, parsed. `layers` keeps the file's order (sorted by name)."""

    model_signature: str
    architecture_id: str
    quant_version: str = QUANT_VERSION
    kernel_abi_version: int = CURRENT_KERNEL_ABI_VERSION
    min_runtime_version: str = MIN_RUNTIME_VERSION
    layer_count: int = 0
    total_qweight_bytes: int = 0
    layers: dict[str, LayerEntry] = field(default_factory=dict)
    # Our top-level extras (None for a plain SquareQ manifest), see the module docstring.
    stagehand: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    path: str | None = None

    @property
    def slab_id(self) -> str | None:
        return (self.stagehand or {}).get("slab_id")

    @property
    def signature_prefixes(self) -> tuple[str, ...] | None:
        p = (self.stagehand or {}).get("signature_prefixes")
        return None if p is None else tuple(p)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(self.extra)
        d.update(
            model_signature=self.model_signature, architecture_id=self.architecture_id,
            quant_version=self.quant_version, kernel_abi_version=self.kernel_abi_version,
            min_runtime_version=self.min_runtime_version, layer_count=len(self.layers),
            total_qweight_bytes=sum(e.qweight_nbytes for e in self.layers.values()),
            layers=[e.to_json() for e in self.layers.values()])
        if self.stagehand is not None:
            d["stagehand"] = self.stagehand
        return d

    def save(self, path: str | os.PathLike) -> None:
        write_atomic(os.fspath(path), json.dumps(self.to_json(), indent=2) + "\n")


_DTYPES = {"dtype_qweight": "int8", "dtype_scale": "float32", "dtype_zero_point": "float32"}
_TOP_FIELDS = {"model_signature": str, "architecture_id": str, "kernel_abi_version": int, "layers": list}
_LAYER_FIELDS = {"canonical_name": str, "qweight_key": str, "scale_key": str, "zero_point_key": str,
                 "orig_shape": list, "packed_shape": list}


def _req(d: dict, key: str, typ, path, layer=None):
    if key not in d:
        raise SlabManifestError(f"missing field {key!r}", path=path, layer=layer)
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise SlabManifestError(f"field {key!r} is {type(v).__name__}, expected {typ.__name__}", path=path, layer=layer)
    return v


def _shape2(v, key, path, layer) -> tuple[int, int]:
    if len(v) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v):
        raise SlabManifestError(f"{key} must be two positive ints, got {v!r}", path=path, layer=layer)
    return int(v[0]), int(v[1])


def load_manifest(path: str | os.PathLike) -> SlabManifest:
    """Parse a manifest; raise SlabManifestError / SlabShapeError / SlabAbiError /
    SlabUnsupportedError naming the file and layer. Pure JSON: opens no slab."""
    path = os.fspath(path)
    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as e:
        raise SlabManifestError(f"cannot read manifest: {e}", path=path) from e
    except json.JSONDecodeError as e:
        raise SlabManifestError(f"manifest is not valid JSON: {e}", path=path) from e
    if not isinstance(raw, dict):
        raise SlabManifestError("manifest is not a JSON object", path=path)
    for k, t in _TOP_FIELDS.items():
        _req(raw, k, t, path)
    abi = raw["kernel_abi_version"]
    if abi < 1 or abi > CURRENT_KERNEL_ABI_VERSION:
        raise SlabAbiError(f"kernel_abi_version {abi} is not supported (this runtime supports "
                           f"1..{CURRENT_KERNEL_ABI_VERSION})", path=path)
    qv = raw.get("quant_version", QUANT_VERSION)
    if qv != QUANT_VERSION:
        raise SlabUnsupportedError(f"quant_version {qv!r} is not {QUANT_VERSION!r}", path=path)
    sh = raw.get("stagehand")
    if sh is not None and not isinstance(sh, dict):
        raise SlabManifestError("field 'stagehand' is not an object", path=path)
    st_file = (sh or {}).get("safetensors_file")
    if st_file is not None and not is_bare_file_name(st_file):  # the reader opens it beside the manifest
        raise SlabPathError(f"field 'stagehand.safetensors_file' is {st_file!r}: it must be a bare file name in the "
                            "manifest's folder (no absolute path, no folder, no '..')", path=path)
    layers: dict[str, LayerEntry] = {}
    keys_seen: dict[str, str] = {}
    for i, d in enumerate(raw["layers"]):
        if not isinstance(d, dict):
            raise SlabManifestError(f"layers[{i}] is not an object", path=path)
        name = _req(d, "canonical_name", str, path, f"layers[{i}]")
        for k, t in _LAYER_FIELDS.items():
            _req(d, k, t, path, name)
        if name in layers:
            raise SlabManifestError("layer listed twice", path=path, layer=name)
        out_f, in_f = _shape2(d["orig_shape"], "orig_shape", path, name)
        p_out, p_in = _shape2(d["packed_shape"], "packed_shape", path, name)
        pad_k = d.get("pad_k", 1)
        if not isinstance(pad_k, int) or pad_k < 1:
            raise SlabManifestError(f"pad_k must be a positive int, got {pad_k!r}", path=path, layer=name)
        want_in = -(-in_f // pad_k) * pad_k
        if p_out != out_f or p_in != want_in:
            raise SlabShapeError(f"packed_shape {[p_out, p_in]} does not follow from orig_shape {[out_f, in_f]} "
                                 f"and pad_k {pad_k} (expected {[out_f, want_in]})", path=path, layer=name)
        bits, scheme, axis = d.get("quant_bits", 8), d.get("quant_scheme", QUANT_SCHEME), d.get("quant_axis", 0)
        if bits not in SUPPORTED_QUANT_BITS or scheme != QUANT_SCHEME or axis != 0:
            raise SlabUnsupportedError(f"quant_bits={bits}, quant_scheme={scheme!r}, quant_axis={axis}: only 8-bit "
                                       f"{QUANT_SCHEME} along axis 0 is supported", path=path, layer=name)
        dts = {k: d.get(k, v) for k, v in _DTYPES.items()}
        if dts != _DTYPES:
            raise SlabDtypeError(f"dtypes {dts} are not int8 / float32 / float32", path=path, layer=name)
        bias_key = d.get("bias_key")
        if bias_key is not None and not isinstance(bias_key, str):
            raise SlabManifestError(f"bias_key must be a string or null, got {bias_key!r}", path=path, layer=name)
        lsh = d.get("stagehand") or {}
        if not isinstance(lsh, dict):
            raise SlabManifestError("per-layer 'stagehand' is not an object", path=path, layer=name)
        record = lsh.get("identity")
        problem = None if record is None else identity.record_problem(record, out_f)
        if problem is not None:
            raise SlabManifestError(f"field 'stagehand.identity' {problem}", path=path, layer=name)
        entry = LayerEntry(
            name=name, out_features=out_f, in_features=in_f, padded_in_features=p_in, has_bias=bias_key is not None,
            qweight_key=d["qweight_key"], scale_key=d["scale_key"], zero_point_key=d["zero_point_key"],
            bias_key=bias_key, pad_k=pad_k, quant_bits=bits, quant_scheme=scheme, quant_axis=axis,
            dtype_bias=lsh.get("dtype_bias", "float32"), block_id=d.get("block_id"), checksums=lsh.get("crc32"),
            source_layout=lsh.get("source_layout", "linear"), source_dtype=lsh.get("source_dtype"), identity=record,
            extra={k: v for k, v in d.items() if k not in _KNOWN_LAYER_KEYS})
        for key in entry.tensor_keys():
            if key in keys_seen:
                raise SlabManifestError(f"tensor key {key!r} also used by layer {keys_seen[key]!r}", path=path, layer=name)
            keys_seen[key] = name
        layers[name] = entry
    count = raw.get("layer_count", len(layers))
    if count != len(layers):
        raise SlabManifestError(f"layer_count is {count} but {len(layers)} layers are listed", path=path)
    total, packed = raw.get("total_qweight_bytes"), sum(e.qweight_nbytes for e in layers.values())
    if total is not None and total != packed:
        raise SlabManifestError(f"total_qweight_bytes is {total} but the layers' packed shapes add up to {packed}",
                                path=path)
    return SlabManifest(
        model_signature=raw["model_signature"], architecture_id=raw["architecture_id"], quant_version=qv,
        kernel_abi_version=abi, min_runtime_version=raw.get("min_runtime_version", MIN_RUNTIME_VERSION),
        layer_count=len(layers), total_qweight_bytes=packed, layers=layers, stagehand=sh,
        extra={k: v for k, v in raw.items() if k not in _KNOWN_TOP_KEYS}, path=path)


def is_bare_file_name(name: Any) -> bool:
    """A file name with no folder part: not absolute, no separator, not '.' or '..'."""
    seps = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    return (isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name
            and not any(s in name for s in seps))


def check_slab_name(slab_name: Any) -> str:
    """A slab's name becomes ``{name}.safetensors`` / ``.manifest.json`` / ``.report.json`` in
    its folder: it must be a bare file name, or the files would land outside that folder."""
    if not is_bare_file_name(slab_name):
        raise SlabPathError(
            f"slab_name is {slab_name!r}: it must be a bare file name (no path separator, no '..'); "
            "say where the slab goes with output_dir")
    return slab_name


_KNOWN_LAYER_KEYS = frozenset([*_LAYER_FIELDS, "bias_key", "pad_k", "quant_bits", "quant_scheme", "quant_axis",
                                "dtype_qweight", "dtype_scale", "dtype_zero_point", "block_id", "stagehand"])
_KNOWN_TOP_KEYS = frozenset([*_TOP_FIELDS, "quant_version", "min_runtime_version", "layer_count",
                             "total_qweight_bytes", "stagehand"])

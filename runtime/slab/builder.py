"""Build INT8 slabs: from a live module, or streamed from a (sharded) safetensors checkpoint.

Both builders go through one writer: the safetensors header is computed from
shapes alone, then each layer is quantized a few rows at a time
(`quantize_per_row` is per-row, so chunking changes nothing) and its bytes are
appended to the file, hashed on the way (crc32 per tensor, sha256 of the file).
Peak memory is one chunk of rows (a few MB), never a layer's worth of
quantized tensors, let alone the model's. Both builders quantize the same
chunks of the same rows, so for the same weights they write the same tensors
and the same signature.

What is quantized: every ``nn.Linear`` and every transformers ``Conv1D`` (GPT-2;
its weight is stored ``[in, out]``, written transposed to ``[out, in]`` like a
Linear's, and the layer is marked ``source_layout: "conv1d"`` so a restore knows
to transpose back), filtered by canonical-name prefix. In a checkpoint, where
module types are unknown, every 2-D floating ``{name}.weight`` counts as a Linear
(``{name}.bias`` as its bias), as SquareQ's streaming builder does; embeddings
are 2-D too, so exclude them with `include_prefixes` or `blocks_only`, and name
Conv1D layers in `conv1d_layers`.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from ..kernels import dequantize, quantize_per_row
from .slab_errors import SlabError, SlabMissingTensorError, SlabShapeError
from .slab_io import ST_DTYPES, IncrementalWriter, byte_view, pread_into, read_header
from .slab_manifest import (
    CURRENT_KERNEL_ABI_VERSION,
    MIN_RUNTIME_VERSION,
    QUANT_VERSION,
    SLAB_ID_KEY,
    STAGEHAND_FORMAT,
    LayerEntry,
    SlabManifest,
    canonical_name,
    iter_linear_layers,
    signature_from_shapes,
)
from .slab_report import BuildResult, LayerReport, print_and_save_report

__all__ = ["BuildResult", "build_slab_from_checkpoint", "build_slab_from_module"]

# Weight elements quantized per chunk: 2M elements = 8 MB as fp32; the quantizer's
# temporaries are a few of these.
_CHUNK_ELEMS = 2 << 20


@dataclass
class _Plan:
    name: str
    out_features: int
    in_features: int
    has_bias: bool
    layout: str
    source_dtype: torch.dtype
    get_rows: Callable[[int, int], torch.Tensor]  # rows [r0, r1) of the [out, in] weight
    get_bias: Callable[[], torch.Tensor] | None
    release: Callable[[], None] = lambda: None


def _padded(n: int, pack_k: int) -> int:
    return -(-n // pack_k) * pack_k


def _cos_terms(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> tuple[float, float, float]:
    d = dequantize(q, s)
    w = w.float()
    return float((w * d).sum(dtype=torch.float64)), float(w.pow(2).sum(dtype=torch.float64)), float(
        d.pow(2).sum(dtype=torch.float64)
    )


def _cosine(dot: float, ww: float, dd: float) -> float:
    if ww == 0.0 or dd == 0.0:
        return 1.0 if ww == dd else 0.0
    return dot / (ww * dd) ** 0.5


def _alt_method(quantizer: str) -> str:
    return "absmax" if quantizer == "mse" else "mse"


def _write_slab(
    plans: list[_Plan],
    *,
    output_dir,
    slab_name: str,
    architecture_id: str,
    pack_k: int,
    quantizer: str,
    signature_prefixes: tuple[str, ...] | None,
    source: str,
    progress: bool,
    compare_quantizers: bool,
    print_report: bool,
) -> BuildResult:
    if not isinstance(pack_k, int) or pack_k < 1:
        raise ValueError(f"pack_k must be a positive int, got {pack_k!r}")
    if quantizer not in ("mse", "absmax"):
        raise ValueError(f"quantizer must be 'mse' or 'absmax', got {quantizer!r}")
    if not plans:
        raise SlabError(f"no Linear layers selected for slab {slab_name!r} (check include_prefixes / blocks_only)")
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    plans = sorted(plans, key=lambda p: p.name)  # SquareQ sorts layers by name
    os.makedirs(output_dir, exist_ok=True)
    st_path = os.path.join(os.fspath(output_dir), f"{slab_name}.safetensors")
    mf_path = os.path.join(os.fspath(output_dir), f"{slab_name}.manifest.json")
    slab_id = uuid.uuid4().hex
    entries: list[tuple[str, str, tuple[int, ...]]] = []
    for p in plans:
        pin = _padded(p.in_features, pack_k)
        entries += [(f"{p.name}.qweight", "I8", (p.out_features, pin)), (f"{p.name}.scale", "F32", (p.out_features,)),
                    (f"{p.name}.zero_point", "F32", (p.out_features,))]
        if p.has_bias:
            entries.append((f"{p.name}.bias", "F32", (p.out_features,)))
    meta = {"format": "pt", SLAB_ID_KEY: slab_id, "architecture_id": architecture_id, "quant_version": QUANT_VERSION}
    tmp_path = st_path + ".partial"
    writer = IncrementalWriter(tmp_path, entries, meta)
    layers: dict[str, LayerEntry] = {}
    reports: list[LayerReport] = []
    block_prefixes = _block_prefixes(p.name for p in plans)
    bar = tqdm(total=sum(p.out_features * p.in_features * p.source_dtype.itemsize for p in plans), unit="B",
               unit_scale=True, desc=f"slab {slab_name}", disable=not progress)
    try:
        for p in plans:
            t0 = time.perf_counter()
            pin = _padded(p.in_features, pack_k)
            keys = {k: f"{p.name}.{k}" for k in ("qweight", "scale", "zero_point", "bias")}
            rows = max(1, _CHUNK_ELEMS // p.in_features)
            qbuf = torch.zeros(min(rows, p.out_features), pin, dtype=torch.int8)  # padding columns stay 0
            scale = torch.empty(p.out_features, dtype=torch.float32)
            cos, alt = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
            for r0 in range(0, p.out_features, rows):
                r1 = min(p.out_features, r0 + rows)
                w = p.get_rows(r0, r1)
                if tuple(w.shape) != (r1 - r0, p.in_features):
                    raise SlabShapeError(f"weight rows are {list(w.shape)}, expected {[r1 - r0, p.in_features]}",
                                         layer=p.name)
                if not torch.isfinite(w).all():
                    raise SlabError(f"weight holds NaN or Inf in rows {r0}..{r1}", layer=p.name)
                q, s = quantize_per_row(w, method=quantizer)
                qbuf[: r1 - r0, : p.in_features] = q
                writer.write(keys["qweight"], byte_view(qbuf[: r1 - r0]))
                scale[r0:r1] = s
                cos = [a + b for a, b in zip(cos, _cos_terms(w, q, s))]
                if compare_quantizers:
                    qa, sa = quantize_per_row(w, method=_alt_method(quantizer))
                    alt = [a + b for a, b in zip(alt, _cos_terms(w, qa, sa))]
                bar.update((r1 - r0) * p.in_features * p.source_dtype.itemsize)
            writer.write(keys["scale"], byte_view(scale))
            writer.write(keys["zero_point"], byte_view(torch.zeros(p.out_features, dtype=torch.float32)))
            if p.has_bias:
                b = p.get_bias().detach().to("cpu", torch.float32).contiguous()
                if tuple(b.shape) != (p.out_features,):
                    raise SlabShapeError(f"bias is {list(b.shape)}, expected {[p.out_features]}", layer=p.name)
                writer.write(keys["bias"], byte_view(b))
            p.release()
            entry = LayerEntry(
                name=p.name, out_features=p.out_features, in_features=p.in_features, padded_in_features=pin,
                has_bias=p.has_bias, qweight_key=keys["qweight"], scale_key=keys["scale"],
                zero_point_key=keys["zero_point"], bias_key=keys["bias"] if p.has_bias else None, pad_k=pack_k,
                source_layout=p.layout, source_dtype=str(p.source_dtype).replace("torch.", ""),
                block_id=_block_id(p.name, block_prefixes),
            )
            entry.checksums = {k: writer.crc32(k) for k in entry.tensor_keys()}
            layers[p.name] = entry
            slab_bytes = sum(writer.offsets[k][1] - writer.offsets[k][0] for k in entry.tensor_keys())
            reports.append(LayerReport(
                name=p.name, shape=[p.out_features, p.in_features], bf16_bytes=p.out_features * p.in_features * 2,
                int8_bytes=slab_bytes, cosine=_cosine(*cos),
                cosine_alt=_cosine(*alt) if compare_quantizers else None, seconds=time.perf_counter() - t0))
        size, sha = writer.close()
    except BaseException:
        writer.abort()
        bar.close()
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise
    bar.close()
    os.replace(tmp_path, st_path)
    manifest = SlabManifest(
        model_signature=signature_from_shapes((p.name, p.in_features, p.out_features, p.has_bias) for p in plans),
        architecture_id=architecture_id, quant_version=QUANT_VERSION, kernel_abi_version=CURRENT_KERNEL_ABI_VERSION,
        min_runtime_version=MIN_RUNTIME_VERSION, layers=layers,
        stagehand={
            "format": STAGEHAND_FORMAT, "slab_id": slab_id, "safetensors_file": os.path.basename(st_path),
            "safetensors_bytes": size, "safetensors_sha256": sha,
            "header_sha256": hashlib.sha256(writer.header_bytes).hexdigest(), "checksum": "crc32 per tensor",
            "quantizer": quantizer, "pack_k": pack_k,
            "signature_prefixes": None if signature_prefixes is None else list(signature_prefixes),
            "source": source,
        },
    )
    manifest.layer_count = len(layers)
    manifest.total_qweight_bytes = sum(e.qweight_nbytes for e in layers.values())
    manifest.save(mf_path)
    manifest.path = mf_path
    result = BuildResult(
        safetensors_path=st_path, manifest_path=mf_path,
        report_path=os.path.join(os.fspath(output_dir), f"{slab_name}.report.json"), manifest=manifest,
        layers=reports, quantizer=quantizer, alt_quantizer=_alt_method(quantizer) if compare_quantizers else None,
        seconds=time.perf_counter() - t_start, slab_bytes=size,
    )
    print_and_save_report(result, print_table=print_report)
    return result


# ── from a live module ───────────────────────────────────────────────────


def build_slab_from_module(
    model: nn.Module,
    output_dir,
    slab_name: str,
    architecture_id: str,
    include_prefixes: Iterable[str] | None = None,
    pack_k: int = 64,
    quantizer: str = "mse",
    progress: bool = True,
    *,
    compare_quantizers: bool = True,
    print_report: bool = True,
) -> BuildResult:
    """Quantize the model's Linear / Conv1D weights (canonical names under
    `include_prefixes`, None: all) into ``{output_dir}/{slab_name}.safetensors``
    + ``.manifest.json`` + ``.report.json``. The model is only read."""
    prefixes = None if include_prefixes is None else tuple(include_prefixes)
    plans = []
    for li in iter_linear_layers(model, prefixes):
        w = li.module.weight
        if w.is_meta:
            raise SlabError("weight is on the meta device (not materialised)", layer=li.name)
        w = w.detach()
        if li.layout == "linear":
            get_rows = (lambda w: lambda r0, r1: w[r0:r1].to("cpu"))(w)
        else:  # Conv1D keeps [in, out]: output rows are its columns
            get_rows = (lambda w: lambda r0, r1: w[:, r0:r1].to("cpu").t().contiguous())(w)
        bias = li.module.bias if li.has_bias else None
        plans.append(_Plan(li.name, li.out_features, li.in_features, li.has_bias, li.layout, w.dtype, get_rows,
                           (lambda b: lambda: b)(bias) if bias is not None else None))
    return _write_slab(plans, output_dir=output_dir, slab_name=slab_name, architecture_id=architecture_id,
                       pack_k=pack_k, quantizer=quantizer, signature_prefixes=prefixes, source="module",
                       progress=progress, compare_quantizers=compare_quantizers, print_report=print_report)


# ── streamed from a checkpoint ───────────────────────────────────────────

_INDEX_PREFERENCE = ("model.safetensors.index.json", "diffusion_pytorch_model.safetensors.index.json")
_BLOCK_RE = re.compile(r"^(.*?)\.(\d+)\.")


def _resolve_checkpoint(path) -> dict[str, str]:
    """tensor key -> shard file, from a directory, an index json or a single file."""
    import json

    path = os.fspath(path)
    if os.path.isdir(path):
        idx = sorted(f for f in os.listdir(path) if f.endswith(".safetensors.index.json"))
        if len(idx) > 1:
            idx = [f for f in _INDEX_PREFERENCE if f in idx] or idx
            if len(idx) > 1:
                raise SlabError(f"several index files, pass one: {idx}", path=path)
        if idx:
            path = os.path.join(path, idx[0])
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if len(files) != 1:
                raise SlabError(f"expected one *.safetensors.index.json or one *.safetensors, found {files}", path=path)
            path = os.path.join(path, files[0])
    if path.endswith(".json"):
        with open(path) as f:
            wmap = json.load(f).get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            raise SlabError("index has no weight_map", path=path)
        base = os.path.dirname(path)
        return {k: os.path.join(base, v) for k, v in wmap.items()}
    return {k: path for k in read_header(path).tensors}


def _block_prefixes(names: Iterable[str]) -> tuple[str, ...]:
    """Prefixes before the first numeric path segment that occur with >= 2 indices
    (``model.layers.``, ``transformer_blocks.``, ``single_transformer_blocks.``)."""
    seen: dict[str, set[str]] = {}
    for n in names:
        m = _BLOCK_RE.match(n + ".")
        if m:
            seen.setdefault(m.group(1) + ".", set()).add(m.group(2))
    return tuple(sorted(p for p, idx in seen.items() if len(idx) >= 2))


def _block_id(name: str, block_prefixes: tuple[str, ...]) -> str | None:
    """``blocks.3`` for ``blocks.3.attn.qkv`` when ``blocks.`` is a block list (SquareQ's block_id)."""
    m = _BLOCK_RE.match(name + ".")
    return f"{m.group(1)}.{m.group(2)}" if m and m.group(1) + "." in block_prefixes else None


def _effective_prefixes(block: tuple[str, ...], include: tuple[str, ...] | None) -> tuple[str, ...]:
    if include is None:
        return block
    out = {b for b in block for i in include if b.startswith(i)} | {i for b in block for i in include if i.startswith(b)}
    return tuple(sorted(out))


def build_slab_from_checkpoint(
    model_dir_or_index_json,
    output_dir,
    slab_name: str,
    architecture_id: str,
    include_prefixes: Iterable[str] | None = None,
    pack_k: int = 64,
    quantizer: str = "mse",
    blocks_only: bool = False,
    progress: bool = True,
    *,
    conv1d_layers: Iterable[str] | Callable[[str], bool] | None = None,
    compare_quantizers: bool = True,
    print_report: bool = True,
) -> BuildResult:
    """Stream a safetensors checkpoint (a directory with ``*.safetensors.index.json``
    or one ``*.safetensors``, or the index / file path) into a slab, reading a few
    rows at a time with ``pread`` (no mmap), so resident memory stays a few chunks
    whatever the checkpoint size. Computes the same signature as
    `build_slab_from_module` on the same weights (from shapes only).

    blocks_only: keep only layers under the checkpoint's block lists (the
        prefixes before the first numeric segment that occur with >= 2 indices,
        e.g. ``model.layers.``), intersected with `include_prefixes`.
    conv1d_layers: canonical names (or a predicate) of transformers Conv1D layers,
        whose checkpoint weight is ``[in, out]``; such a layer is read whole (one
        tensor in memory) and transposed.
    """
    shards = _resolve_checkpoint(model_dir_or_index_json)
    headers = {f: read_header(f) for f in sorted(set(shards.values()))}
    infos = {}
    for key, f in shards.items():
        if key not in headers[f].tensors:
            raise SlabMissingTensorError(f"index lists tensor {key!r} but the shard does not hold it", path=f, layer=key)
        infos[key] = (f, headers[f].tensors[key])
    is_conv1d = conv1d_layers if callable(conv1d_layers) else (lambda s: lambda n: n in s)(set(conv1d_layers or ()))
    floating = {"F16", "BF16", "F32", "F64"}
    cand = {}
    for key, (f, t) in infos.items():
        if key.endswith(".weight") and len(t.shape) == 2 and t.dtype in floating:
            name = canonical_name(key[: -len(".weight")])
            if not any(p.startswith("lora_") for p in name.split(".")):
                cand[name] = key
    prefixes = None if include_prefixes is None else tuple(include_prefixes)
    if blocks_only:
        prefixes = _effective_prefixes(_block_prefixes(cand), prefixes)
        if not prefixes:
            raise SlabError("blocks_only: no block list found (no 'name.N.' keys with >= 2 indices)",
                            path=os.fspath(model_dir_or_index_json))
    fds: dict[str, int] = {}

    def fd_of(f: str) -> int:
        if f not in fds:
            fds[f] = os.open(f, os.O_RDONLY)
        return fds[f]

    # One reusable buffer for row chunks (bounded by _CHUNK_ELEMS elements).
    scratch = {"buf": torch.empty(0, dtype=torch.uint8)}

    def read_range(f, t, start, nbytes, name, fresh=False) -> torch.Tensor:
        if fresh:
            view = torch.empty(nbytes, dtype=torch.uint8)
        else:
            if scratch["buf"].numel() < nbytes:
                scratch["buf"] = torch.empty(nbytes, dtype=torch.uint8)
            view = scratch["buf"][:nbytes]
        pread_into(fd_of(f), byte_view(view), start, f, name)
        return view.view(ST_DTYPES[t.dtype])

    plans = []
    for name, key in cand.items():
        if prefixes is not None and not name.startswith(prefixes):
            continue
        f, t = infos[key]
        conv = is_conv1d(name)
        out_f, in_f = (t.shape[1], t.shape[0]) if conv else t.shape
        bkey = key[: -len(".weight")] + ".bias"
        has_bias = bkey in infos and len(infos[bkey][1].shape) == 1
        item = ST_DTYPES[t.dtype].itemsize
        if not conv:
            def get_rows(r0, r1, f=f, t=t, in_f=in_f, item=item, name=name):
                return read_range(f, t, t.start + r0 * in_f * item, (r1 - r0) * in_f * item, name).view(r1 - r0, in_f)
            release = lambda: None  # noqa: E731
        else:
            held: dict = {}

            def get_rows(r0, r1, f=f, t=t, held=held, name=name):
                if "w" not in held:
                    held["w"] = read_range(f, t, t.start, t.nbytes, name, fresh=True).view(*t.shape)
                return held["w"][:, r0:r1].t().contiguous()
            release = held.clear
        get_bias = None
        if has_bias:
            bf, bt = infos[bkey]
            get_bias = (lambda bf, bt, name: lambda: read_range(bf, bt, bt.start, bt.nbytes, name, fresh=True))(bf, bt, name)
        plans.append(_Plan(name, out_f, in_f, has_bias, "conv1d" if conv else "linear", ST_DTYPES[t.dtype],
                           get_rows, get_bias, release))
    try:
        return _write_slab(plans, output_dir=output_dir, slab_name=slab_name, architecture_id=architecture_id,
                           pack_k=pack_k, quantizer=quantizer, signature_prefixes=prefixes, source="checkpoint",
                           progress=progress, compare_quantizers=compare_quantizers, print_report=print_report)
    finally:
        for fd in fds.values():
            os.close(fd)


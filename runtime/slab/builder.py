"""Build INT8 slabs: the one writer every builder goes through (`write_slab`), and the builder from a live module.

The writer computes the header from shapes, then quantizes each layer a chunk of rows at a time (per-row: chunking
changes nothing), appending and hashing the bytes; peak memory is one chunk. A builder says where each layer's rows
come from (a `LayerPlan`). Quantized: ``nn.Linear`` and transformers ``Conv1D`` (written as ``[out, in]``)."""

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

from torch_stagehand.environment import tunable
from torch_stagehand.kernels import dequantize, quantize_per_row

from torch_stagehand.runtime.slab.errors import SlabError, SlabShapeError
from torch_stagehand.runtime.slab.identity import RowSampler
from torch_stagehand.runtime.slab.layers import iter_linear_layers, signature_from_shapes
from torch_stagehand.runtime.slab.manifest import (
    CURRENT_KERNEL_ABI_VERSION, MIN_RUNTIME_VERSION, QUANT_VERSION, SLAB_ID_KEY, STAGEHAND_FORMAT, LayerEntry,
    SlabManifest,
)
from torch_stagehand.runtime.slab.reader import slab_paths
from torch_stagehand.runtime.slab.report import BuildResult, LayerReport, print_and_save_report
from torch_stagehand.runtime.slab.safetensors_io import MANIFEST_DTYPE_TO_TAG, IncrementalWriter, byte_view


@dataclass
class LayerPlan:
    """Where one layer's rows come from: what a builder hands the writer."""

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
    d, w = dequantize(q, s), w.float()
    return tuple(float(x.sum(dtype=torch.float64)) for x in (w * d, w.pow(2), d.pow(2)))


def _cosine(dot: float, ww: float, dd: float) -> float:
    if ww == 0.0 or dd == 0.0:
        return 1.0 if ww == dd else 0.0
    return dot / (ww * dd) ** 0.5


def _alt_method(quantizer: str) -> str:
    return "absmax" if quantizer == "mse" else "mse"


def write_slab(plans: list[LayerPlan], *, output_dir, slab_name: str, architecture_id: str, pack_k: int,
               quantizer: str, signature_prefixes: tuple[str, ...] | None, source: str, progress: bool,
               compare_quantizers: bool, print_report: bool) -> BuildResult:
    st_path, mf_path = slab_paths(output_dir, slab_name)
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
    slab_id = uuid.uuid4().hex
    block_prefixes = find_block_prefixes(p.name for p in plans)
    layers = {p.name: LayerEntry(
        name=p.name, out_features=p.out_features, in_features=p.in_features,
        padded_in_features=_padded(p.in_features, pack_k), has_bias=p.has_bias, qweight_key=f"{p.name}.qweight",
        scale_key=f"{p.name}.scale", zero_point_key=f"{p.name}.zero_point",
        bias_key=f"{p.name}.bias" if p.has_bias else None, pad_k=pack_k, source_layout=p.layout,
        source_dtype=str(p.source_dtype).replace("torch.", ""), block_id=_block_id(p.name, block_prefixes))
        for p in plans}
    meta = {"format": "pt", SLAB_ID_KEY: slab_id, "architecture_id": architecture_id, "quant_version": QUANT_VERSION}
    tmp_path = st_path + ".partial"
    writer = IncrementalWriter(tmp_path, [(key, MANIFEST_DTYPE_TO_TAG[dtype], shape) for e in layers.values()
                                          for key, dtype, shape in e.tensor_specs()], meta)
    reports: list[LayerReport] = []
    bar = tqdm(total=sum(p.out_features * p.in_features * p.source_dtype.itemsize for p in plans), unit="B",
               unit_scale=True, desc=f"slab {slab_name}", disable=not progress)
    try:
        for p in plans:
            t0, entry = time.perf_counter(), layers[p.name]
            rows = max(1, tunable("slab_chunk_elements") // p.in_features)
            qbuf = torch.zeros(min(rows, p.out_features), entry.padded_in_features, dtype=torch.int8)  # padding: 0
            scale = torch.empty(p.out_features, dtype=torch.float32)
            cos, alt = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
            sampler = RowSampler(p.out_features)  # the layer's identity, from the rows as quantized
            for r0 in range(0, p.out_features, rows):
                r1 = min(p.out_features, r0 + rows)
                w = p.get_rows(r0, r1)
                if tuple(w.shape) != (r1 - r0, p.in_features):
                    raise SlabShapeError(f"weight rows are {list(w.shape)}, expected {[r1 - r0, p.in_features]}",
                                         layer=p.name)
                if not torch.isfinite(w).all():
                    raise SlabError(f"weight holds NaN or Inf in rows {r0}..{r1}", layer=p.name)
                sampler.take(r0, w)
                q, s = quantize_per_row(w, method=quantizer)
                qbuf[: r1 - r0, : p.in_features] = q
                writer.write(entry.qweight_key, byte_view(qbuf[: r1 - r0]))
                scale[r0:r1] = s
                cos = [a + b for a, b in zip(cos, _cos_terms(w, q, s))]
                if compare_quantizers:
                    qa, sa = quantize_per_row(w, method=_alt_method(quantizer))
                    alt = [a + b for a, b in zip(alt, _cos_terms(w, qa, sa))]
                bar.update((r1 - r0) * p.in_features * p.source_dtype.itemsize)
            writer.write(entry.scale_key, byte_view(scale))
            writer.write(entry.zero_point_key, byte_view(torch.zeros(p.out_features, dtype=torch.float32)))
            if p.has_bias:
                b = p.get_bias().detach().to("cpu", torch.float32).contiguous()
                if tuple(b.shape) != (p.out_features,):
                    raise SlabShapeError(f"bias is {list(b.shape)}, expected {[p.out_features]}", layer=p.name)
                writer.write(entry.bias_key, byte_view(b))
            p.release()
            entry.identity = sampler.record()
            entry.checksums = {k: writer.crc32(k) for k in entry.tensor_keys()}
            slab_bytes = sum(writer.offsets[k][1] - writer.offsets[k][0] for k in entry.tensor_keys())
            reports.append(LayerReport(
                name=p.name, shape=[p.out_features, p.in_features], bf16_bytes=p.out_features * p.in_features * 2,
                int8_bytes=slab_bytes, cosine=_cosine(*cos),
                cosine_alt=_cosine(*alt) if compare_quantizers else None, seconds=time.perf_counter() - t0))
        size, sha = writer.close()
    except BaseException:
        writer.abort()
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise
    finally:
        bar.close()
    os.replace(tmp_path, st_path)
    manifest = SlabManifest(
        model_signature=signature_from_shapes((p.name, p.in_features, p.out_features, p.has_bias) for p in plans),
        architecture_id=architecture_id, quant_version=QUANT_VERSION, kernel_abi_version=CURRENT_KERNEL_ABI_VERSION,
        min_runtime_version=MIN_RUNTIME_VERSION, layers=layers, layer_count=len(layers),
        total_qweight_bytes=sum(e.qweight_nbytes for e in layers.values()),
        stagehand={"format": STAGEHAND_FORMAT, "slab_id": slab_id, "safetensors_file": os.path.basename(st_path),
                   "safetensors_bytes": size, "safetensors_sha256": sha,
                   "header_sha256": hashlib.sha256(writer.header_bytes).hexdigest(), "checksum": "crc32 per tensor",
                   "identity": "sha256 of sampled source rows per layer (identity.py)", "quantizer": quantizer,
                   "pack_k": pack_k,
                   "signature_prefixes": None if signature_prefixes is None else list(signature_prefixes),
                   "source": source})
    manifest.save(mf_path)
    manifest.path = mf_path
    result = BuildResult(
        safetensors_path=st_path, manifest_path=mf_path,
        report_path=os.path.join(os.fspath(output_dir), f"{slab_name}.report.json"), manifest=manifest,
        layers=reports, quantizer=quantizer, alt_quantizer=_alt_method(quantizer) if compare_quantizers else None,
        seconds=time.perf_counter() - t_start, slab_bytes=size)
    print_and_save_report(result, print_table=print_report)
    return result


def build_slab_from_module(model: nn.Module, output_dir, slab_name: str, architecture_id: str,
                           include_prefixes: Iterable[str] | None = None, pack_k: int = 64, quantizer: str = "mse",
                           progress: bool = True, *, compare_quantizers: bool = True,
                           print_report: bool = True) -> BuildResult:
    """Quantize the model's Linear / Conv1D weights (canonical names under `include_prefixes`, None: all) into
    ``{output_dir}/{slab_name}.safetensors`` + ``.manifest.json`` + ``.report.json``. The model is only read."""
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
        plans.append(LayerPlan(li.name, li.out_features, li.in_features, li.has_bias, li.layout, w.dtype, get_rows,
                           (lambda b: lambda: b)(bias) if bias is not None else None))
    return write_slab(plans, output_dir=output_dir, slab_name=slab_name, architecture_id=architecture_id,
                       pack_k=pack_k, quantizer=quantizer, signature_prefixes=prefixes, source="module",
                       progress=progress, compare_quantizers=compare_quantizers, print_report=print_report)


_BLOCK_RE = re.compile(r"^(.*?)\.(\d+)\.")


def find_block_prefixes(names: Iterable[str]) -> tuple[str, ...]:
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

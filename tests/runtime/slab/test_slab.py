"""Slab files: builders, reader, validation, SquareQ V2 compatibility (CPU, fast)."""

from __future__ import annotations

import hashlib
import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from torch_stagehand import config
from torch_stagehand.kernels import quantize_per_row
from torch_stagehand.runtime.slab import (
    SlabAbiError,
    SlabChecksumError,
    SlabDtypeError,
    SlabError,
    SlabExtraTensorError,
    SlabHeaderError,
    SlabLayerNotFoundError,
    SlabManifestError,
    SlabMismatchError,
    SlabMissingTensorError,
    SlabModelMismatchError,
    SlabReader,
    SlabShapeError,
    SlabSignatureError,
    SlabTruncatedError,
    SlabUnsupportedError,
    SlabValueError,
    build_slab_from_checkpoint,
    build_slab_from_module,
    compute_model_signature,
    load_manifest,
)

# ── helpers ──────────────────────────────────────────────────────────────


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # The toy layers are tiny; on a loaded 2-core machine every multi-threaded
    # elementwise op (torch.round) waits ~15 ms for a descheduled worker.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)  # bias
        self.proj = nn.Linear(h, h, bias=False)
        self.fc = nn.Linear(h, 2 * h)


class Toy(nn.Module):
    """in_features 72 is not a multiple of pack_k=64, so padding is exercised."""

    def __init__(self, h: int = 72, n: int = 3):
        super().__init__()
        self.embed = nn.Embedding(50, h)
        self.blocks = nn.ModuleList(Block(h) for _ in range(n))
        self.head = nn.Linear(h, 11)


def make_toy(seed=0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    return Toy(**kw).to(torch.bfloat16)


def build(model, tmp_path, name="s", **kw):
    kw.setdefault("progress", False)
    kw.setdefault("print_report", False)
    kw.setdefault("compare_quantizers", False)
    return build_slab_from_module(model, tmp_path / name, name, "toy", **kw)


def rewrite_header(st_path, fn):
    """Rewrite a safetensors file through a JSON header edit (tensor data kept)."""
    raw = open(st_path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    hdr = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    data = fn(hdr, data)
    hb = json.dumps(hdr).encode()
    hb += b" " * ((-len(hb)) % 8)
    open(st_path, "wb").write(struct.pack("<Q", len(hb)) + hb + data)


def edit_manifest(path, fn):
    raw = json.load(open(path))
    fn(raw)
    json.dump(raw, open(path, "w"))


def squareq_signature(model):
    """SquareQ's compute_model_signature, restated: every nn.Linear, sorted, sha256[:16]."""
    items = sorted(
        f"{n}:{m.in_features}:{m.out_features}:{m.bias is not None}"
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
    )
    return hashlib.sha256("|".join(items).encode()).hexdigest()[:16]


def save_sharded(model, d, shards=2, single=False):
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    os.makedirs(d, exist_ok=True)
    if single:
        save_file(sd, str(d / "model.safetensors"))
        return d
    keys = sorted(sd)
    wmap = {}
    for i in range(shards):
        part = keys[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: sd[k] for k in part}, str(d / fname))
        wmap.update({k: fname for k in part})
    json.dump({"metadata": {}, "weight_map": wmap}, open(d / "model.safetensors.index.json", "w"))
    return d


# ── round trip ───────────────────────────────────────────────────────────


def test_roundtrip_bit_exact_into_flat_buffer_views(tmp_path):
    model = make_toy()
    res = build(model, tmp_path)
    r = SlabReader(res.manifest_path)
    assert sorted(r.layers) == sorted(
        ["head"] + [f"blocks.{i}.{n}" for i in range(3) for n in ("qkv", "proj", "fc")]
    )
    for name, e in r.layers.items():
        lin = model.get_submodule(name)
        q_ref, s_ref = quantize_per_row(lin.weight.detach(), method="mse")
        assert (e.out_features, e.in_features, e.padded_in_features) == (lin.out_features, 72, 128)
        assert e.has_bias == (lin.bias is not None)
        # views into one flat host buffer, as the host store holds them; sentinels around
        nq, ns = e.out_features * e.in_features, e.out_features * 4
        flat = torch.full((16 + nq + ns + 16,), 0x5A, dtype=torch.uint8)
        qv = flat[16 : 16 + nq].view(torch.int8).view(e.out_features, e.in_features)
        sv = flat[16 + nq : 16 + nq + ns].view(torch.float32)
        bv = torch.empty(e.out_features, dtype=torch.bfloat16) if e.has_bias else None
        r.read_layer_into(name, qv, sv, bv)
        assert torch.equal(qv, q_ref) and torch.equal(sv, s_ref)
        assert bool((flat[:16] == 0x5A).all()) and bool((flat[-16:] == 0x5A).all())
        if e.has_bias:
            assert torch.equal(bv, lin.bias.detach())
        qp, sp, bp = r.read_layer(name, padded=True)
        assert qp.shape == (e.out_features, 128)
        assert torch.equal(qp[:, :72], q_ref) and not qp[:, 72:].any()
    r.close()


def test_report_json_and_quantizer_comparison(tmp_path):
    res = build(make_toy(), tmp_path, compare_quantizers=True)
    rep = json.load(open(res.report_path))
    assert len(rep["layers"]) == 10
    for row in rep["layers"]:
        assert set(row) >= {"name", "shape", "bf16_bytes", "int8_bytes", "cosine", "cosine_alt", "seconds"}
        assert 1 - 2e-5 < row["cosine"] <= 1.0 + 1e-9  # 1 - cosine measured 7.5e-6 (CPU, torch 2.13, 5 seeds)
    assert "blocks.0.fc" in res.table()
    # Long Gaussian rows: mse clips the tails and beats absmax; both columns are real.
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(4096, 16, bias=False))
    nn.init.normal_(wide[0].weight, std=0.05)
    for quantizer, better in (("mse", True), ("absmax", False)):
        res = build(wide.bfloat16(), tmp_path, f"w{quantizer}", quantizer=quantizer, compare_quantizers=True)
        rep = json.load(open(res.report_path))
        row = rep["layers"][0]
        assert (row["cosine"] > row["cosine_alt"]) == better, (quantizer, row)
    assert rep["summary"]["cosine_absmax_mean"] < rep["summary"]["cosine_mse_mean"]


@config.patch(slab_chunk_elements=200)  # tiny chunks: every layer quantized a few rows at a time
def test_chunked_quantization_is_row_exact(tmp_path):
    # The same bytes as one call.
    model = make_toy()
    res = build(model, tmp_path)
    with SlabReader(res.manifest_path, verify="full") as r:
        for name in r.layers:
            q, s, _ = r.read_layer(name)
            q_ref, s_ref = quantize_per_row(model.get_submodule(name).weight.detach(), method="mse")
            assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


# ── streaming builder ────────────────────────────────────────────────────


@pytest.mark.parametrize("single", [False, True])
@config.patch(slab_chunk_elements=500)
def test_streaming_equals_module_builder(tmp_path, single):
    model = nn.Module()  # no embedding: every 2-D weight is a Linear
    model.blocks = make_toy().blocks
    model.head = nn.Linear(72, 11).to(torch.bfloat16)
    a = build(model, tmp_path, "a")
    ck = save_sharded(model, tmp_path / "ckpt", shards=3, single=single)
    b = build_slab_from_checkpoint(ck, tmp_path / "b", "b", "toy", progress=False, print_report=False,
                                   compare_quantizers=False)
    assert a.manifest.model_signature == b.manifest.model_signature == compute_model_signature(model)
    ta, tb = load_file(a.safetensors_path), load_file(b.safetensors_path)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    ja, jb = json.load(open(a.manifest_path)), json.load(open(b.manifest_path))
    assert ja["layers"] == jb["layers"]  # same keys, shapes, crc32s, block ids
    with SlabReader(b.manifest_path) as r:
        r.check_model(model)


def test_blocks_only_and_prefixes_on_checkpoint(tmp_path):
    model = make_toy()  # has an embedding: a 2-D weight that is not a Linear
    ck = save_sharded(model, tmp_path / "ckpt")
    res = build_slab_from_checkpoint(ck / "model.safetensors.index.json", tmp_path / "o", "o", "toy",
                                     blocks_only=True, progress=False, print_report=False,
                                     compare_quantizers=False)
    assert res.manifest.signature_prefixes == ("blocks.",)
    assert all(n.startswith("blocks.") for n in res.manifest.layers) and len(res.manifest.layers) == 9
    assert res.manifest.model_signature == compute_model_signature(model, ["blocks."])
    assert res.manifest.layers["blocks.2.fc"].block_id == "blocks.2"
    with SlabReader(res.manifest_path) as r:
        r.check_model(model)  # scope taken from the manifest
    res2 = build_slab_from_checkpoint(ck, tmp_path / "p", "p", "toy", include_prefixes=["blocks.1."],
                                      blocks_only=True, progress=False, print_report=False,
                                     compare_quantizers=False)
    assert sorted(res2.manifest.layers) == ["blocks.1.fc", "blocks.1.proj", "blocks.1.qkv"]


def test_include_prefixes_module(tmp_path):
    model = make_toy()
    res = build(model, tmp_path, include_prefixes=("blocks.0.", "head"))
    assert sorted(res.manifest.layers) == ["blocks.0.fc", "blocks.0.proj", "blocks.0.qkv", "head"]
    assert res.manifest.model_signature == compute_model_signature(model, ("blocks.0.", "head"))
    assert res.manifest.model_signature != compute_model_signature(model)
    other = make_toy(seed=1)
    other.blocks[2].fc = nn.Linear(72, 99)  # outside the slab's scope: fine
    with SlabReader(res.manifest_path) as r:
        r.check_model(other)
        other.blocks[0].proj = nn.Linear(72, 64, bias=False)  # inside: names the layer
        with pytest.raises(SlabModelMismatchError, match=r"blocks\.0\.proj.*\[64, 72\]"):
            r.check_model(other)


# ── validation failures ──────────────────────────────────────────────────


@pytest.fixture
def slab(tmp_path):
    res = build(make_toy(), tmp_path)
    return res.safetensors_path, res.manifest_path


def test_truncated_file(slab):
    st, mf = slab
    size = os.path.getsize(st)
    with open(st, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(SlabTruncatedError, match="truncated") as ei:
        SlabReader(mf)
    assert st in str(ei.value)


def test_trailing_bytes(slab):
    st, mf = slab
    with open(st, "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(SlabTruncatedError, match="after the last tensor"):
        SlabReader(mf)


def test_garbage_header(slab):
    st, mf = slab
    with open(st, "r+b") as f:
        f.seek(8)
        f.write(b"#not json")
    with pytest.raises(SlabHeaderError, match="not valid JSON"):
        SlabReader(mf)


def test_flipped_bytes_in_data(slab):
    st, mf = slab
    r0 = SlabReader(mf)
    info = r0.header.tensors["blocks.1.fc.qweight"]
    r0.close()
    with open(st, "r+b") as f:
        f.seek(info.start + 1000)
        b = f.read(4)
        f.seek(info.start + 1000)
        f.write(bytes(x ^ 0xFF for x in b))
    with SlabReader(mf) as r:  # fast open reads no qweight bytes
        r.read_layer("blocks.0.fc")  # other layers still fine
        for padded in (False, True):
            with pytest.raises(SlabChecksumError, match=r"layer 'blocks\.1\.fc'.*crc32") as ei:
                r.read_layer("blocks.1.fc", padded=padded)
            assert st in str(ei.value)
    with pytest.raises(SlabChecksumError, match=r"blocks\.1\.fc"):
        SlabReader(mf, verify="full")


def test_deleted_tensor(slab):
    st, mf = slab

    def drop(hdr, data):
        b, e = hdr.pop("blocks.2.qkv.scale")["data_offsets"]
        for v in hdr.values():
            if "data_offsets" in v and v["data_offsets"][0] >= e:
                v["data_offsets"] = [x - (e - b) for x in v["data_offsets"]]
        return data[:b] + data[e:]

    rewrite_header(st, drop)
    with pytest.raises(SlabMissingTensorError, match=r"layer 'blocks\.2\.qkv'.*blocks\.2\.qkv\.scale") as ei:
        SlabReader(mf)
    assert st in str(ei.value)


def test_extra_tensor_in_file(slab):
    st, mf = slab

    def drop_layer(raw):
        raw["layers"] = [l for l in raw["layers"] if l["canonical_name"] != "head"]
        raw["layer_count"] -= 1
        raw["total_qweight_bytes"] -= 11 * 128

    edit_manifest(mf, drop_layer)
    with pytest.raises(SlabExtraTensorError, match=r"'head\.[a-z_]+' is in the file but not in the manifest"):
        SlabReader(mf)


def test_manifest_shape_edits(slab):
    st, mf = slab
    edit_manifest(mf, lambda raw: raw["layers"][0].update(packed_shape=[raw["layers"][0]["orig_shape"][0], 64]))
    with pytest.raises(SlabShapeError, match=r"layer 'blocks\.0\.fc'.*packed_shape") as ei:
        SlabReader(mf)
    assert mf in str(ei.value)

    def grow_out(raw):  # self-consistent edit: only the file disagrees
        l0 = raw["layers"][0]
        l0["orig_shape"][0] += 1
        l0["packed_shape"][0] += 1
        raw["total_qweight_bytes"] += l0["packed_shape"][1]

    edit_manifest(mf, lambda raw: raw["layers"][0].update(packed_shape=[raw["layers"][0]["orig_shape"][0], 128]))
    edit_manifest(mf, grow_out)
    with pytest.raises(SlabShapeError, match=r"layer 'blocks\.0\.fc'.*in the file, the manifest says") as ei:
        SlabReader(mf)
    assert st in str(ei.value)


@pytest.mark.parametrize("abi", [0, 2, 999])
def test_wrong_abi(slab, abi):
    _, mf = slab
    edit_manifest(mf, lambda raw: raw.update(kernel_abi_version=abi))
    with pytest.raises(SlabAbiError, match=f"kernel_abi_version {abi}"):
        SlabReader(mf)


def test_signature_checks(slab):
    _, mf = slab
    sig = load_manifest(mf).model_signature
    with pytest.raises(SlabSignatureError, match="expected 'ffff'"):
        SlabReader(mf, expected_signature="ffff")
    SlabReader(mf, expected_signature=sig, model=make_toy(seed=5)).close()  # same architecture
    with pytest.raises(SlabModelMismatchError, match=r"layer 'blocks\.0\.fc'"):
        SlabReader(mf, model=make_toy(h=80))
    bigger = make_toy()
    bigger.extra = nn.Linear(4, 4)
    with pytest.raises(SlabModelMismatchError, match=r"layer 'extra'.*slab does not"):
        SlabReader(mf, model=bigger)
    edit_manifest(mf, lambda raw: raw.update(model_signature="0123456789abcdef"))
    with pytest.raises(SlabSignatureError, match="own layer list"):
        SlabReader(mf)


def test_manifest_of_another_slab(tmp_path):
    a = build(make_toy(), tmp_path, "a")
    b = build(make_toy(), tmp_path, "b")  # same model, same shapes: only the slab id tells
    with pytest.raises(SlabMismatchError, match="do not belong together"):
        SlabReader(a.manifest_path, b.safetensors_path)
    c = build(make_toy(h=80), tmp_path, "c")
    with pytest.raises(SlabMismatchError):
        SlabReader(c.manifest_path, a.safetensors_path)
    # a tampered header (same slab id) is caught by the recorded header sha256
    rewrite_header(a.safetensors_path, lambda hdr, data: (hdr["__metadata__"].update(note="x"), data)[1])
    with pytest.raises(SlabChecksumError, match="header sha256"):
        SlabReader(a.manifest_path)


def test_nan_scale_and_nonzero_zero_point(slab):
    st, mf = slab
    r0 = SlabReader(mf)
    sc, zp = r0.header.tensors["head.scale"], r0.header.tensors["blocks.1.proj.zero_point"]
    r0.close()
    with open(st, "r+b") as f:
        f.seek(sc.start)
        f.write(struct.pack("<f", float("nan")))
    with SlabReader(mf, verify_checksums=False) as r:
        with pytest.raises(SlabValueError, match=r"layer 'head'.*NaN"):
            r.read_layer("head")
    with open(st, "r+b") as f:
        f.seek(zp.start + 8)
        f.write(struct.pack("<f", 3.0))
    with pytest.raises(SlabUnsupportedError, match=r"layer 'blocks\.1\.proj'.*zero_point is non-zero"):
        SlabReader(mf, verify_checksums=False)


def test_bad_destination_and_unknown_layer(slab):
    _, mf = slab
    with SlabReader(mf) as r:
        e = r.layers["head"]
        with pytest.raises(SlabShapeError, match=r"layer 'head'.*qweight buffer"):
            r.read_layer_into("head", torch.empty(e.out_features, 128, dtype=torch.int8),
                              torch.empty(e.out_features))
        with pytest.raises(SlabDtypeError, match="scale buffer"):
            r.read_layer_into("head", torch.empty(e.out_features, 72, dtype=torch.int8),
                              torch.empty(e.out_features, dtype=torch.float16))
        with pytest.raises(SlabShapeError, match="no bias"):
            r.read_layer_into("blocks.0.proj", torch.empty(72, 72, dtype=torch.int8), torch.empty(72),
                              torch.empty(72))
        with pytest.raises(SlabLayerNotFoundError, match="nope"):
            r.read_layer("nope")
    with pytest.raises(SlabError, match="closed"):
        r.read_layer("head")


def test_malformed_manifest(slab):
    _, mf = slab
    edit_manifest(mf, lambda raw: raw["layers"][3].pop("scale_key"))
    with pytest.raises(SlabManifestError, match="missing field 'scale_key'"):
        SlabReader(mf)


# ── SquareQ V2 compatibility ─────────────────────────────────────────────


def _squareq_slab_by_hand(model, out_dir, name="sq", pack_k=64):
    """A slab written from squareq-int8-slab.txt alone: per-row symmetric absmax INT8,
    K padded to pack_k, fp32 scale + zero zero_point (+ fp32 bias), save_file, the
    V2 manifest fields. No stagehand extras, no checksums."""
    tensors, layers = {}, []
    for n, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        w = m.weight.detach().float()
        pad = (-w.shape[1]) % pack_k
        wp = torch.nn.functional.pad(w, (0, pad))
        scale = (wp.abs().amax(1) / 127.0).clamp(min=1e-8)
        tensors[f"{n}.qweight"] = torch.round(wp / scale[:, None]).clamp(-127, 127).to(torch.int8)
        tensors[f"{n}.scale"] = scale
        tensors[f"{n}.zero_point"] = torch.zeros_like(scale)
        if m.bias is not None:
            tensors[f"{n}.bias"] = m.bias.detach().float()
        layers.append({
            "canonical_name": n, "qweight_key": f"{n}.qweight", "scale_key": f"{n}.scale",
            "zero_point_key": f"{n}.zero_point", "bias_key": f"{n}.bias" if m.bias is not None else None,
            "orig_shape": list(w.shape), "packed_shape": list(wp.shape), "pad_k": pack_k, "quant_bits": 8,
            "quant_scheme": "per_row_symmetric", "quant_axis": 0, "dtype_qweight": "int8",
            "dtype_scale": "float32", "dtype_zero_point": "float32", "block_id": None,
        })
    layers.sort(key=lambda x: x["canonical_name"])
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, str(out_dir / f"{name}.safetensors"))
    manifest = {
        "model_signature": squareq_signature(model), "architecture_id": "toy", "quant_version": "squareq_bp8_v2",
        "kernel_abi_version": 1, "min_runtime_version": "0.1.0", "layer_count": len(layers),
        "total_qweight_bytes": sum(t.numel() for k, t in tensors.items() if k.endswith(".qweight")),
        "layers": layers,
    }
    (out_dir / f"{name}.manifest.json").write_text(json.dumps(manifest, indent=2))
    return tensors, out_dir / f"{name}.manifest.json"


def test_squareq_slab_loads_here(tmp_path):
    model = make_toy()
    tensors, mf = _squareq_slab_by_hand(model, tmp_path / "sq")
    with SlabReader(mf, verify="full", model=model) as r:
        assert r.manifest.stagehand is None and len(r.layers) == 10
        for name, e in r.layers.items():
            q, s, b = r.read_layer(name, padded=True)
            assert torch.equal(q, tensors[f"{name}.qweight"]) and torch.equal(s, tensors[f"{name}.scale"])
            assert (b is None) == (f"{name}.bias" not in tensors)
            q72, _, _ = r.read_layer(name)
            assert torch.equal(q72, q[:, :72])
        # SquareQ signs the whole model: a changed Linear anywhere is a mismatch
        other = make_toy()
        other.extra = nn.Linear(3, 3)
        with pytest.raises(SlabSignatureError):
            r.check_model(other)
    # missing tensor in a plain SquareQ slab
    del tensors["head.zero_point"]
    save_file(tensors, str(tmp_path / "sq" / "sq.safetensors"))
    with pytest.raises(SlabMissingTensorError, match=r"layer 'head'.*head\.zero_point"):
        SlabReader(mf)


def test_our_slab_passes_squareq_checks(tmp_path):
    """Ours read the way SquareQ reads (gate-0 field list, load_file, signature, dequant)."""
    model = make_toy()
    del model.embed  # SquareQ signs all nn.Linear; ours too when unfiltered and no Conv1D
    res = build(model, tmp_path)
    raw = json.load(open(res.manifest_path))
    top = {"model_signature": str, "architecture_id": str, "quant_version": str, "kernel_abi_version": int,
           "min_runtime_version": str, "layer_count": int, "total_qweight_bytes": int}
    per_layer = {"canonical_name": str, "qweight_key": str, "scale_key": str, "zero_point_key": str,
                 "bias_key": (str, type(None)), "orig_shape": list, "packed_shape": list, "pad_k": int,
                 "quant_bits": int, "quant_scheme": str, "quant_axis": int, "dtype_qweight": str,
                 "dtype_scale": str, "dtype_zero_point": str, "block_id": (str, type(None))}
    for k, t in top.items():
        assert isinstance(raw[k], t), k
    assert raw["quant_version"] == "squareq_bp8_v2" and raw["kernel_abi_version"] == 1
    assert raw["model_signature"] == squareq_signature(model)
    assert raw["layer_count"] == len(raw["layers"])
    assert [l["canonical_name"] for l in raw["layers"]] == sorted(l["canonical_name"] for l in raw["layers"])
    tensors = load_file(res.safetensors_path)  # the safetensors library reads our hand-written file
    for l in raw["layers"]:
        for k, t in per_layer.items():
            assert isinstance(l[k], t), (l["canonical_name"], k)
        q = tensors[l["qweight_key"]]
        assert q.dtype == torch.int8 and list(q.shape) == l["packed_shape"]
        assert tensors[l["scale_key"]].dtype == torch.float32 and not (tensors[l["zero_point_key"]] != 0).any()
        w = model.get_submodule(l["canonical_name"]).weight.float()
        deq = q.float()[:, : w.shape[1]] * tensors[l["scale_key"]][:, None]  # SquareQ's QuantLinear math
        # 1 - cosine measured 7.4e-6 (CPU, torch 2.13, 3 seeds)
        assert torch.nn.functional.cosine_similarity(deq.flatten(), w.flatten(), dim=0) > 1 - 2e-5
        if l["bias_key"]:
            assert tensors[l["bias_key"]].dtype == torch.float32


# ── wrappers: peft, .orig, Conv1D ────────────────────────────────────────


def test_check_model_through_peft_and_orig(slab):
    _, mf = slab
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(make_toy().float(), peft.LoraConfig(r=4, target_modules=["qkv", "proj"]))
    with SlabReader(mf) as r:
        mods = r.check_model(wrapped)  # base_model.model.*.base_layer -> canonical; lora_A/B ignored
        assert isinstance(mods["blocks.0.qkv"], nn.Linear) and mods["blocks.0.qkv"].in_features == 72

        class Orig(nn.Module):  # "attn.to_q.orig" style LoRA injection
            def __init__(self, lin):
                super().__init__()
                self.orig = lin
                self.lora_down = nn.Linear(lin.in_features, 2, bias=False)

        m = make_toy()
        m.blocks[1].fc = Orig(m.blocks[1].fc)
        r.check_model(m)
        m.blocks[1].fc.orig = nn.Linear(72, 144, bias=False)
        with pytest.raises(SlabModelMismatchError, match=r"layer 'blocks\.1\.fc'.*has_bias"):
            r.check_model(m)


def test_conv1d_gpt2_style(tmp_path):
    pu = pytest.importorskip("transformers.pytorch_utils")
    torch.manual_seed(0)
    model = nn.Module()
    model.h = nn.ModuleList(nn.ModuleDict({"c_attn": pu.Conv1D(3 * 40, 40), "c_proj": pu.Conv1D(40, 40)})
                            for _ in range(2))
    model = model.to(torch.bfloat16)
    res = build(model, tmp_path)
    e = res.manifest.layers["h.0.c_attn"]
    assert (e.out_features, e.in_features, e.source_layout) == (120, 40, "conv1d")
    with SlabReader(res.manifest_path) as r:
        q, s, b = r.read_layer("h.0.c_attn")
        q_ref, s_ref = quantize_per_row(model.h[0].c_attn.weight.detach().t().contiguous(), method="mse")
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
        assert torch.equal(b, model.h[0].c_attn.bias.float())
        r.check_model(model)
    ck = save_sharded(model, tmp_path / "ck", single=True)
    res2 = build_slab_from_checkpoint(ck, tmp_path / "o", "o", "gpt2", progress=False, print_report=False,
                                      conv1d_layers=lambda n: n.endswith(("c_attn", "c_proj")),
                                      compare_quantizers=False)
    assert res2.manifest.model_signature == res.manifest.model_signature
    ta, tb = load_file(res.safetensors_path), load_file(res2.safetensors_path)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)

"""Reads moved ahead of a slab's: the compiler's module files before the first read (compiler/startup/read_ahead.py),
a meta model's resident tensors from its checkpoint beside the reads (WeightsFile.read_ahead). What each reads,
that offload waits for the first before any slab read and reads the second's exact tensors, and that the
folders it reads hold what the compiler's preparation imports."""

from __future__ import annotations

import copy
import importlib.machinery
import importlib.util
import os
import py_compile
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import save_file

import torch_stagehand as stagehand
from torch_stagehand import api, config
from torch_stagehand.compiler.startup import read_ahead as ahead
from torch_stagehand.runtime.host import weights_file
from torch_stagehand.runtime.slab.reader import SlabReader
from torch_stagehand.runtime.telemetry.stage_clock import COMPILER_PREPARATION, FILES_READ_AHEAD
from torch_stagehand.runtime.host.weights_file import WeightsFile

from _helpers import checkpoint_and_slab, toy


def _write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _module(path, text: str, compiled: bool = False):
    _write(path, text)
    if compiled:
        py_compile.compile(str(path), cfile=importlib.util.cache_from_source(str(path)), doraise=True)
    return path


def _tree(tmp_path):
    """A package with a subpackage, a folder that is not a package, an extension module and a shared library."""
    pkg = tmp_path / "pkg"
    _module(pkg / "__init__.py", "")
    _module(pkg / "a.py", "A = [i * i for i in range(100)]\n" * 20, compiled=True)
    _module(pkg / "sub" / "__init__.py", "S = 1\n", compiled=True)
    _module(pkg / "sub" / "b.py", "B = {'b': 2}\n" * 30, compiled=True)
    _module(pkg / "data" / "c.py", "C = 3\n")  # no __init__.py: not a package, not read (as torch_key skips it)
    _write(pkg / "notes.txt", "not a module\n")
    suffix = next(s for s in importlib.machinery.EXTENSION_SUFFIXES if s != ".so")
    _write(pkg / f"_native{suffix}", "an extension module's bytes\n")
    _write(pkg / "libhuge.so", "a shared library: not a module\n")
    return pkg, suffix


def test_every_modules_source_is_read_and_the_bytecode_under_the_bytecode_folders(tmp_path):
    pkg, suffix = _tree(tmp_path)
    source = _write(tmp_path / "model_source.py", "class Block: pass\n" * 7)
    pyc = lambda path: importlib.util.cache_from_source(str(path))  # noqa: E731
    expected = [pkg / "__init__.py", pkg / "a.py", pkg / f"_native{suffix}", pkg / "sub" / "__init__.py",
                pkg / "sub" / "b.py", pyc(pkg / "sub" / "__init__.py"), pyc(pkg / "sub" / "b.py"), source]
    listed = ahead.files_ahead([str(pkg), str(tmp_path / "no such package")], [str(pkg / "sub")],
                               [str(source), str(tmp_path / "gone.py")])
    assert sorted(listed) == sorted([*map(str, expected), str(tmp_path / "gone.py")])
    stats = ahead.read_ahead([str(pkg)], [str(pkg / "sub")], [str(source), str(tmp_path / "gone.py")], threads=3)
    assert stats.files == len(expected)  # nothing for what is missing
    assert stats.bytes == sum(os.path.getsize(path) for path in expected)


def test_the_thread_reads_the_same_and_says_so_once_joined(tmp_path):
    pkg, _ = _tree(tmp_path)
    expected = ahead.read_ahead([str(pkg)], [str(pkg)])
    got = ahead.ReadAhead([str(pkg)], [str(pkg)]).wait()
    assert (got.files, got.bytes) == (expected.files, expected.bytes) and got.files == 8
    assert not any(t.name == "stagehand-read-ahead" for t in threading.enumerate())


_COVERAGE = """
import os, sys, torch_stagehand
before = set(sys.modules)
from torch_stagehand.compiler.startup.read_ahead import compiler_roots, files_ahead
packages, bytecode = compiler_roots()
ahead = {os.path.realpath(f) for f in files_ahead(packages, bytecode)}
import torch._inductor.codecache as codecache
opened = []
sys.addaudithook(lambda event, args: opened.append(args[0]) if event == "open" and isinstance(args[0], str) else None)
codecache.torch_key()
hashed = {os.path.realpath(f) for f in opened if f.endswith(".py") or ".so" in f}
from torch_stagehand.compiler.inner import prewarm_compiler_imports
prewarm_compiler_imports()
imported = [f for m in set(sys.modules) - before if (f := getattr(sys.modules[m], "__file__", None))]
from importlib.util import cache_from_source
# What each import read: the module's bytecode where Python had cached it, else its source.
read = [os.path.realpath(c if os.path.exists(c := cache_from_source(f)) else f) for f in imported if f.endswith(".py")]
print(len(hashed), len(hashed - ahead), len(read), sum(r in ahead for r in read))
"""


def test_the_read_ahead_holds_what_torch_key_hashes_and_most_of_what_the_compiler_imports():
    """The compile workers' start hashes every source of torch (`torch_key`): each of those files must be read
    ahead. Most of the files `prewarm_compiler_imports` loads must be too (their bytecode, or their source where
    none was cached: CPU build, torch 2.13: 245 of 293 modules): a torch that moved its compiler's modules
    elsewhere fails here."""
    done = subprocess.run([sys.executable, "-c", _COVERAGE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    hashed, missed, imported, covered = map(int, done.stdout.split())
    assert hashed > 1000 and missed == 0, (hashed, missed)
    assert imported > 100 and covered >= 0.8 * imported, (imported, covered)


@config.patch(weights_file_chunk=1000)  # every range over a few chunks, each on a thread
def test_a_checkpoints_tensors_are_read_whole_in_ranges_merged_and_chunked(tmp_path):
    tensors = {"a": torch.randn(1000), "b": torch.randn(7), "c": torch.randn(3000), "d": torch.randn(5)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    file = WeightsFile(path)
    # Merged across the 28 bytes of "b" between "a" and "c" (the default gap): those bytes are read too.
    assert file.read_ahead(["a", "c", "not in the file"], threads=3) == 4 * (1000 + 7 + 3000)
    with config.patch(weights_file_merge_gap=0):
        assert file.read_ahead(["a", "c"], threads=3) == 4 * (1000 + 3000)
    assert file.read_ahead(["d"]) == 4 * 5 and file.read_ahead([]) == 0


def test_rows_of_a_checkpoints_views_are_read_a_range_per_row(tmp_path, monkeypatch):
    """`read_rows_ahead`: each asked row of a 2-D view of the file is one range of its bytes; a tensor of its own
    memory, a transposed view and a row past the end are left out."""
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(40, 300), "v": torch.randn(10, 20)}, str(path))
    file = WeightsFile(path)
    w, v = file.view("w"), file.view("v")
    read = []
    monkeypatch.setattr(weights_file, "_read_range", lambda p, b, e, exact: read.append((p, b, e, exact)) or e - b)
    with config.patch(weights_file_merge_gap=0):
        assert file.read_rows_ahead([(w, [0, 13, 39, 40]), (v.t(), [1]), (torch.randn(4, 4), [0])]) == 3 * 300 * 4
    raw = path.read_bytes()  # each range holds its row's bytes, as the file has them
    assert [raw[b:e] for _, b, e, _ in sorted(read)] == [w[r].numpy().tobytes() for r in (0, 13, 39)]
    assert {p for p, _, _, _ in read} == {str(path)} and file.read_rows_ahead([]) == 0
    assert all(exact for *_, exact in read)  # a row's bytes only, no readahead window around them


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here")
def test_a_rows_read_asks_for_no_readahead_and_a_tensors_read_keeps_it(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(40, 300)}, str(path))
    file = WeightsFile(path)
    advice = []
    fadvise = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, *args: advice.append(args) or fadvise(fd, *args))
    assert file.read_rows_ahead([(file.view("w"), [3])]) == 300 * 4
    assert advice == [(0, 0, os.POSIX_FADV_RANDOM)]
    advice.clear()
    assert file.read_ahead(["w"]) == 40 * 300 * 4 and advice == []


def test_offload_reads_the_identitys_sampled_rows_ahead_of_checking_them(tmp_path, monkeypatch):
    """The identity check of a model mapped from its checkpoint reads each layer's sampled rows with a read of
    their own first (not a page at a time through the mapping), then checks them."""
    from torch_stagehand.runtime.slab import checks

    model, x, path, manifest = checkpoint_and_slab(tmp_path)
    reference = copy.deepcopy(model)
    stagehand.offload(reference, device="cpu", precision="int8", slab=manifest, verbose=False)
    with SlabReader(manifest) as reader:
        sampled = {name: e.identity["rows"] for name, e in reader.layers.items()}
    events = []
    rows_ahead, check = WeightsFile.read_rows_ahead, checks.check_identity

    def record_rows(self, rows_of, *args, **kwargs):
        events.append(("rows", sorted((tuple(t.shape), tuple(rows)) for t, rows in rows_of)))
        return rows_ahead(self, rows_of, *args, **kwargs)

    monkeypatch.setattr(WeightsFile, "read_rows_ahead", record_rows)
    monkeypatch.setattr(checks, "check_identity", lambda *a, **k: events.append("checked") or check(*a, **k))
    meta = copy.deepcopy(model).to("meta")
    rt = stagehand.offload(meta, device="cpu", precision="int8", slab=manifest, checkpoint=path, keep_full="file",
                           verbose=False)
    try:
        assert [e if e == "checked" else e[0] for e in events] == ["rows", "checked"]
        shapes = {name: tuple(model.get_submodule(name).weight.shape) for name in sampled}
        assert events[0][1] == sorted((shapes[name], tuple(rows)) for name, rows in sampled.items())
        with torch.no_grad():
            assert torch.equal(meta(x), reference(x))
    finally:
        rt.restore()


class _Preparation:
    """The CUDA path's compiler preparation, on the CPU: records when each part runs against the slab's reads."""

    def __init__(self, events):
        self.events, self.seconds = events, {}

    def read_files_ahead(self):
        self.events.append("read ahead started")

    def files_read(self):
        self.events.append("read ahead waited for")
        return ahead.ReadAheadStats(files=1, bytes=10, seconds=0.25)

    def __call__(self):
        self.events.append(("prepared", threading.current_thread() is threading.main_thread()))
        self.seconds = {"compile workers started": 0.5}


def test_offload_from_a_slab_waits_for_the_files_then_reads_the_resident_tensors_pages_beside(tmp_path, monkeypatch):
    model, x, path, manifest = checkpoint_and_slab(tmp_path)
    reference = copy.deepcopy(model)
    stagehand.offload(reference, device="cpu", precision="int8", slab=manifest, verbose=False)
    events, asked = [], []
    monkeypatch.setattr(api, "compiler_preparation", lambda model, device: _Preparation(events))
    layer_job = SlabReader.layer_job  # the reads handed to the reader process (Config.slab_reads, "auto")

    def read_layer(self, *args):
        events.append("slab read")
        return layer_job(self, *args)

    read_ahead = WeightsFile.read_ahead

    def pages_ahead(self, names, *args, **kwargs):
        asked.append(sorted(names))
        return read_ahead(self, names, *args, **kwargs)

    monkeypatch.setattr(SlabReader, "layer_job", read_layer)
    monkeypatch.setattr(WeightsFile, "read_ahead", pages_ahead)
    meta = copy.deepcopy(model).to("meta")
    rt = stagehand.offload(meta, device="cpu", precision="int8", slab=manifest, checkpoint=path, keep_full="file",
                           verbose=False)
    try:
        assert events[:2] == ["read ahead started", "read ahead waited for"]  # before the first slab read
        assert ("prepared", True) in events and "slab read" in events
        streamed = {f"blocks.{b}.{name}.weight" for b in range(3) for name in ("up", "down")}
        assert asked == [sorted(set(model.state_dict()) - streamed)]  # what load_resident reads, exactly
        beside = rt.offload_summary["beside"]
        assert beside[FILES_READ_AHEAD] == 0.25 and beside["compile workers started"] == 0.5
        assert {COMPILER_PREPARATION, "resident tensors' pages read", "slab identity check"} <= set(beside)
        with torch.no_grad():
            assert torch.equal(meta(x), reference(x))
    finally:
        rt.restore()


def test_the_preparation_reads_its_files_ahead_and_times_its_parts(monkeypatch):
    from torch_stagehand.compiler.startup import preparation as module
    from torch_stagehand.compiler.startup.preparation import CompilerPreparation

    model, _ = toy(n=2)
    monkeypatch.setattr(module, "_compiler_imported", lambda: False)  # (another test may have compiled here)
    preparation = CompilerPreparation(model, torch.device("cpu"))
    assert preparation.files_read().files == 0  # nothing started: nothing to wait for
    preparation.read_files_ahead()
    assert preparation.files_read().files > 1000  # torch's sources, the compiler's bytecode
    preparation()
    assert set(preparation.seconds) == {"compile workers started", "compiler imported, sources indexed"}
    assert all(s >= 0 for s in preparation.seconds.values())


def test_a_process_that_imported_the_compiler_reads_nothing_ahead(monkeypatch):
    """A second offload: the compiler is imported and its workers' start hashed torch's sources already."""
    from torch_stagehand.compiler.startup import preparation as module

    model, _ = toy(n=2)
    monkeypatch.setattr(module, "_compiler_imported", lambda: True)
    preparation = module.CompilerPreparation(model, torch.device("cpu"))
    preparation.read_files_ahead()
    assert preparation.files_read().files == 0
    assert not any(t.name == "stagehand-read-ahead" for t in threading.enumerate())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_of_a_meta_model_from_its_files_reads_ahead_and_computes_the_same(tmp_path, monkeypatch):
    """On CUDA the real preparation runs: its files read before the slab's first read, the compile workers
    started and the compiler imported beside the reads, the resident tensors' pages read after them."""
    from torch_stagehand.compiler.startup import preparation

    model, x, path, manifest = checkpoint_and_slab(tmp_path)
    reference = copy.deepcopy(model)
    stagehand.offload(reference, device="cuda", precision="int8", slab=manifest, verbose=False)
    # The reference's offload imported the compiler: read ahead all the same, as a process's first offload does.
    monkeypatch.setattr(preparation, "_compiler_imported", lambda: False)
    meta = copy.deepcopy(model).to("meta")
    rt = stagehand.offload(meta, device="cuda", precision="int8", slab=manifest, checkpoint=path, keep_full="file",
                           verbose=False)
    try:
        beside = rt.offload_summary["beside"]
        assert {FILES_READ_AHEAD, COMPILER_PREPARATION, "compile workers started", "compiler imported, sources indexed",
                "resident tensors' pages read"} <= set(beside)
        assert beside[FILES_READ_AHEAD] > 0
        with torch.no_grad():
            assert torch.equal(meta(x.cuda()), reference(x.cuda()))
    finally:
        rt.restore()

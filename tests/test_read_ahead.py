"""Reads moved ahead of a slab's: the compiler's module files before the first read (compiler/read_ahead.py),
a meta model's resident tensors from its checkpoint beside the reads (WeightsFile.read_ahead). What each reads,
that offload waits for the first before any slab read and reads the second's exact tensors, and that the
folders it reads hold what the compiler's preparation imports."""

from __future__ import annotations

import copy
import importlib.util
import py_compile
import subprocess
import sys
import threading

import torch
from safetensors.torch import save_file

import torch_stagehand as stagehand
from torch_stagehand import api
from torch_stagehand.compiler import read_ahead as ahead
from torch_stagehand.runtime import weights_file
from torch_stagehand.runtime.slab import build_slab_from_module
from torch_stagehand.runtime.slab.reader import SlabReader
from torch_stagehand.runtime.stage_clock import COMPILER_PREPARATION, FILES_READ_AHEAD
from torch_stagehand.runtime.weights_file import WeightsFile

from _helpers import toy


def _write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_each_module_is_read_from_its_bytecode_else_its_source_and_the_given_files_whole(tmp_path):
    compiled = _write(tmp_path / "pkg" / "a.py", "A = [i * i for i in range(100)]\n" * 20)
    py_compile.compile(str(compiled), cfile=importlib.util.cache_from_source(str(compiled)), doraise=True)
    plain = _write(tmp_path / "pkg" / "sub" / "deeper" / "b.py", "B = 2\n")
    _write(tmp_path / "pkg" / "notes.txt", "not a module: not read\n")
    source = _write(tmp_path / "model_source.py", "class Block: pass\n" * 7)
    pyc = importlib.util.cache_from_source(str(compiled))

    stats = ahead.read_ahead([str(tmp_path / "pkg"), str(tmp_path / "no such folder")],
                             [str(source), str(tmp_path / "gone.py")], threads=3)
    assert stats.files == 3  # a's bytecode, b's source (no bytecode), the given file; nothing for what is missing
    assert stats.bytes == len(open(pyc, "rb").read()) + plain.stat().st_size + source.stat().st_size
    assert stats.seconds >= 0


def test_the_thread_reads_the_same_and_says_so_once_joined(tmp_path):
    _write(tmp_path / "pkg" / "a.py", "A = 1\n")
    _write(tmp_path / "pkg" / "b" / "c.py", "C = 3\n" * 50)
    expected = ahead.read_ahead([str(tmp_path / "pkg")])
    running = ahead.ReadAhead([str(tmp_path / "pkg")])
    got = running.wait()
    assert (got.files, got.bytes) == (expected.files, expected.bytes) == (2, 6 + 300)
    assert not any(t.name == "stagehand-read-ahead" for t in threading.enumerate())


def test_the_folders_hold_what_the_compilers_preparation_imports():
    """A torch that moved its compiler's modules elsewhere leaves them to wait for the disk beside the reads:
    most of the module files `prewarm_compiler_imports` loads must be under `compiler_folders()` (on the CPU
    build, torch 2.13: 225 of 250)."""
    script = (
        "import os, sys, torch_stagehand\n"
        "before = set(sys.modules)\n"
        "from torch_stagehand.compiler.inner import prewarm_compiler_imports\n"
        "from torch_stagehand.compiler.read_ahead import compiler_folders\n"
        "prewarm_compiler_imports()\n"
        "files = [os.path.realpath(f) for m in set(sys.modules) - before if (f := getattr(sys.modules[m], '__file__', None))]\n"
        "folders = tuple(os.path.realpath(f) + os.sep for f in compiler_folders())\n"
        "print(len(files), sum(f.startswith(folders) for f in files))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    imported, covered = map(int, done.stdout.split())
    assert imported > 100 and covered >= 0.8 * imported, (imported, covered)


def test_a_checkpoints_tensors_are_read_whole_in_ranges_merged_and_chunked(tmp_path, monkeypatch):
    tensors = {"a": torch.randn(1000), "b": torch.randn(7), "c": torch.randn(3000), "d": torch.randn(5)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    file = WeightsFile(path)
    monkeypatch.setattr(weights_file, "_CHUNK", 1000)  # every range over a few chunks, each on a thread
    # Merged across the 28 bytes of "b" between "a" and "c" (the default gap): those bytes are read too.
    assert file.read_ahead(["a", "c", "not in the file"], threads=3) == 4 * (1000 + 7 + 3000)
    monkeypatch.setattr(weights_file, "_MERGE_GAP", 0)
    assert file.read_ahead(["a", "c"], threads=3) == 4 * (1000 + 3000)
    assert file.read_ahead(["d"]) == 4 * 5 and file.read_ahead([]) == 0


def _files(tmp_path):
    model, x = toy(n=3, d=64)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    slab = build_slab_from_module(model, str(tmp_path), "toy", "toy", include_prefixes=("blocks.",),
                                  progress=False, print_report=False, compare_quantizers=False)
    return model, x, path, slab.manifest_path


class _Preparation:
    """The CUDA path's compiler preparation, on the CPU: records when each part runs against the slab's reads."""

    def __init__(self, events):
        self.events = events

    def read_files_ahead(self):
        self.events.append("read ahead started")

    def files_read(self):
        self.events.append("read ahead waited for")
        return ahead.ReadAheadStats(files=1, bytes=10, seconds=0.25)

    def __call__(self):
        self.events.append(("prepared", threading.current_thread() is threading.main_thread()))


def test_offload_from_a_slab_waits_for_the_files_then_reads_the_resident_tensors_pages_beside(tmp_path, monkeypatch):
    model, x, path, manifest = _files(tmp_path)
    reference = copy.deepcopy(model)
    stagehand.offload(reference, device="cpu", precision="int8", slab=manifest, verbose=False)
    events, asked = [], []
    monkeypatch.setattr(api, "compiler_preparation", lambda model, device: _Preparation(events))
    read_layer_into = SlabReader.read_layer_into

    def read_layer(self, *args):
        events.append("slab read")
        return read_layer_into(self, *args)

    read_ahead = WeightsFile.read_ahead

    def pages_ahead(self, names, *args, **kwargs):
        asked.append(sorted(names))
        return read_ahead(self, names, *args, **kwargs)

    monkeypatch.setattr(SlabReader, "read_layer_into", read_layer)
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
        assert beside[FILES_READ_AHEAD] == 0.25
        assert {COMPILER_PREPARATION, "resident tensors' pages read", "slab identity check"} <= set(beside)
        with torch.no_grad():
            assert torch.equal(meta(x), reference(x))
    finally:
        rt.restore()

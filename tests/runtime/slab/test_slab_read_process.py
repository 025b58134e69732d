"""offload(slab=...) with the reads in a reader process (`Config(slab_reads=...)`, read_process.py)."""

from __future__ import annotations

import copy
import json
import os
import pathlib
import signal
import struct
import sys
import threading
import zlib

import pytest
import torch
import torch.nn as nn

import torch_stagehand as stagehand
from torch_stagehand.runtime.config import Config, ConfigError
from torch_stagehand.runtime.precision import layer_views
from torch_stagehand.runtime.slab import SlabChecksumError, SlabError, SlabReader, SlabValueError, build_slab_from_module
from torch_stagehand.runtime.slab import loading, read_process

from _helpers import ToyModel, toy

D = 40  # rows of 40 and 80 columns, stored padded to 64 and 128: the reads narrow them
# Offload waits for every row (the rows read behind it, and their errors: the `_GatedWorker` tests below).
SYNC = Config(slab_reads="process", slab_rows_behind=False)


@pytest.fixture
def slab(tmp_path):
    model, x = toy(n=3, d=D)
    result = build_slab_from_module(model, tmp_path, "toy_int8", "toy-v1", include_prefixes=("blocks.",), pack_k=64,
                                    progress=False, print_report=False, compare_quantizers=False)
    return model, x, result.manifest_path


def _meta_model(model: nn.Module) -> nn.Module:
    """The toy model with its blocks' Linear weights and biases on the meta device (they come from the slab)."""
    with torch.device("meta"):
        meta = ToyModel(D, 3)
    resident = {k: v for k, v in model.state_dict().items() if not (".up." in k or ".down." in k)}
    meta.load_state_dict(resident, strict=False, assign=True)
    return meta.requires_grad_(False)


def _memfd_mappings() -> set[str]:
    with open("/proc/self/maps") as f:
        return {part.lstrip("/") for line in f for part in line.split() if part.startswith("/memfd:stagehand")}


def test_the_reader_process_fills_the_store_byte_for_byte_as_the_threads_do(slab):
    """Narrowed rows (stored padded), scales and biases of a meta model: the process's reads land in memfd pages
    this process maps, the same bytes the reader threads put in its own memory; the models compute the same."""
    model, x, manifest = slab
    stores, outputs = {}, {}
    for reads in ("threads", "process"):
        meta = _meta_model(model)
        rt = stagehand.offload(meta, device="cpu", precision="int8", slab=manifest,
                               config=Config(slab_reads=reads), verbose=False)
        if reads == "process":
            assert "memfd:stagehand-int8-copy" in _memfd_mappings()  # the arena's pages are the memfd's
        stores[reads] = [[t.clone() for lay in rt.store.layout(b, "int8")
                          for t in layer_views(rt.store.buffer(b, "int8"), lay)] + [meta.blocks[b].up.bias.detach()]
                         for b in range(3)]  # each layer's rows and scale (not the gaps between them), the bias
        with torch.no_grad():
            outputs[reads] = meta(x)
    for threads, process in zip(stores["threads"], stores["process"]):
        assert len(threads) == 5 and all(torch.equal(a, b) for a, b in zip(threads, process))
    assert torch.equal(outputs["threads"], outputs["process"])
    with SlabReader(manifest) as reader:  # and they are the slab's rows, narrowed
        q, s, bias = reader.read_layer("blocks.1.down")
    assert torch.equal(stores["process"][1][2], q) and torch.equal(stores["process"][1][3], s) and bias is None


def _rewrite(manifest: str, key: str, offset: int, data: bytes) -> None:
    """Write `data` into tensor `key` at `offset` and record the tensor's new crc32 (a checked slab's damage
    that only a value check can see)."""
    with SlabReader(manifest) as reader:
        info = reader.header.tensors[key]
        path = reader.path
    with open(path, "r+b") as f:
        f.seek(info.start + offset)
        f.write(data)
        f.seek(info.start)
        crc = zlib.crc32(f.read(info.end - info.start))
    doc = json.loads(pathlib.Path(manifest).read_text())
    layer = key.rsplit(".", 1)[0]
    entry = next(e for e in doc["layers"] if e["canonical_name"] == layer)
    entry["stagehand"]["crc32"][key] = f"{crc:08x}"
    pathlib.Path(manifest).write_text(json.dumps(doc))


def test_a_layer_the_process_finds_corrupt_is_named_and_the_model_is_left_as_it_was(slab):
    model, _, manifest = slab
    with SlabReader(manifest) as reader:
        info = reader.header.tensors["blocks.2.up.qweight"]
        path = reader.path
    with open(path, "r+b") as f:  # one byte of its rows flipped: the checksum
        f.seek(info.start + 5)
        byte = f.read(1)
        f.seek(info.start + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(SlabChecksumError, match=r"layer 'blocks\.2\.up'.*'blocks\.2\.up\.qweight' crc32"):
        stagehand.offload(model, device="cpu", precision="int8", slab=manifest, config=SYNC)
    assert type(model.blocks[2].up) is nn.Linear
    with open(path, "r+b") as f:
        f.seek(info.start + 5)
        f.write(byte)
    _rewrite(manifest, "blocks.0.down.scale", 0, struct.pack("<f", float("nan")))  # a checksum that matches
    with pytest.raises(SlabValueError, match=r"layer 'blocks\.0\.down'.*scale holds NaN or Inf"):
        stagehand.offload(model, device="cpu", precision="int8", slab=manifest, config=SYNC)
    assert type(model.blocks[0].down) is nn.Linear


@pytest.mark.parametrize("worker, says", [
    ("import sys\nsys.stderr.write('out of file descriptors\\n')\nsys.exit(3)\n",
     r"exit status 3 .*out of file descriptors.*slab_reads='threads'"),
    ("print('hello from the worker')\n", r"the slab reader process said 'hello from the worker'"),
], ids=["dies", "says nonsense"])
def test_a_reader_process_that_dies_or_says_nonsense_is_an_error_and_the_model_is_left_as_it_was(
        slab, tmp_path, monkeypatch, worker, says):
    model, _, manifest = slab
    script = tmp_path / "worker.py"
    script.write_text(worker)
    monkeypatch.setattr(read_process, "WORKER", str(script))
    with pytest.raises(SlabError, match=says):
        stagehand.offload(model, device="cpu", precision="int8", slab=manifest, config=SYNC)
    assert type(model.blocks[0].up) is nn.Linear


def test_a_reader_process_that_can_not_start_is_an_error_that_names_the_way_round(slab, monkeypatch):
    model, _, manifest = slab

    def no_start(*args, **kwargs):
        raise OSError(8, "Exec format error")

    monkeypatch.setattr(read_process.subprocess, "Popen", no_start)
    with pytest.raises(SlabError, match=r"could not start the slab reader process .*Exec format error.*'threads'"):
        stagehand.offload(model, device="cpu", precision="int8", slab=manifest, config=Config(slab_reads="process"))
    assert type(model.blocks[0].up) is nn.Linear


def _open_memfds() -> list[str]:
    import os

    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return [name for name in found if "memfd:stagehand" in name]


def test_a_load_that_fails_before_the_reads_leaves_no_memfd_open(slab, monkeypatch):
    model, _, manifest = slab
    before = _open_memfds()

    def failing(*args):
        raise RuntimeError("no room for the biases")

    monkeypatch.setattr(loading, "_bias_buffers", failing)
    with pytest.raises(RuntimeError, match="no room for the biases"):
        stagehand.offload(model, device="cpu", precision="int8", slab=manifest, config=Config(slab_reads="process"))
    assert _open_memfds() == before and type(model.blocks[0].up) is nn.Linear


def test_slab_reads_is_checked(slab, monkeypatch):
    model, _, manifest = slab
    with pytest.raises(ConfigError, match="slab_reads: must be 'auto', 'process' or 'threads', got 'fork'"):
        Config(slab_reads="fork").validate()
    monkeypatch.setattr(loading, "process_reads_possible", lambda: "this platform has no memfd_create")
    with pytest.raises(ConfigError, match="slab_reads: 'process' can not be used here: this platform has no memfd"):
        stagehand.offload(model, device="cpu", precision="int8", slab=manifest, config=Config(slab_reads="process"))
    assert type(model.blocks[0].up) is nn.Linear
    monkeypatch.setattr(loading, "read_in_process", lambda *args, **kwargs: pytest.fail("auto read in a process"))
    rt = stagehand.offload(model, device="cpu", precision="int8", slab=manifest, verbose=False)  # auto: threads
    rt.restore()


def test_the_process_reads_a_block_while_the_next_is_laid_out(slab):
    """Each block goes to the process as it is laid out: block 0's rows are in before block 1 is handed over."""
    model, _, manifest = slab
    pages = read_process.ProcessPages()
    first_read = threading.Event()
    heard = []
    with SlabReader(manifest) as reader:
        arena = pages.backing("toy", 1 << 16)
        blocks = []
        for b in range(2):
            group = []
            for name, layer in (("up", model.blocks[b].up), ("down", model.blocks[b].down)):
                e = reader.layers[f"blocks.{b}.{name}"]
                q = arena[(4 * b + 2 * (name == "down")) * 4096:].view(torch.int8)[: e.out_features * e.in_features]
                s = arena[(4 * b + 2 * (name == "down") + 1) * 4096:][: 4 * e.out_features].view(torch.float32)
                group.append((f"blocks.{b}.{name}", q, s, None, type("Spec", (), {"block": b})()))
            blocks.append(group)

        def laid_out():
            yield blocks[0]
            assert first_read.wait(60), "block 0 was not read before block 1 was laid out"
            yield blocks[1]

        def block_read(block):
            heard.append(block)
            if block == 0:
                first_read.set()

        read_process.read_in_process(reader, pages, laid_out(), on_block_read=block_read)
        pages.close()
        assert heard == [0, 1]
        q, s, _ = reader.read_layer("blocks.1.up")
        assert torch.equal(blocks[1][0][1].view(q.shape), q) and torch.equal(blocks[1][0][2], s)


def test_the_worker_runs_on_the_standard_library_alone():
    """It is started by path with -I -S: importing torch or this package there would cost seconds."""
    source = pathlib.Path(read_process.WORKER).read_text()
    imported = {line.split()[1].split(".")[0] for line in source.splitlines() if line.startswith(("import ", "from "))}
    assert imported and imported <= set(sys.stdlib_module_names)


class _GatedWorker:
    """The reader process held at its start until the test lets it go (a FIFO it opens and reads to its end):
    offload's return can then be seen to come before any row is in, without a sleep."""

    def __init__(self, tmp_path, monkeypatch):
        self.fifo = tmp_path / "gate"
        os.mkfifo(self.fifo)
        script = tmp_path / "gated_worker.py"
        script.write_text(
            "import os, runpy, sys\n"
            f"with open({str(self.fifo)!r}) as gate:\n    gate.read()\n"
            f"sys.argv[0] = {read_process.WORKER!r}\n"
            f"runpy.run_path({read_process.WORKER!r}, run_name='__main__')\n")
        monkeypatch.setattr(read_process, "WORKER", str(script))
        # Held open read-write (an open that waits for no reader): the worker's read ends when it is closed.
        self.fd = os.open(self.fifo, os.O_RDWR)
        # Closed after a minute if offload waits for the rows (the gated worker never reads them): the test fails.
        self.timer = threading.Timer(60, self.release)
        self.timer.daemon = True
        self.timer.start()

    def release(self) -> None:
        self.timer.cancel()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def test_offload_returns_before_the_rows_are_read_and_the_first_forward_waits_for_them(slab, tmp_path, monkeypatch):
    model, x, manifest = slab
    with torch.no_grad():
        want = stagehand.offload(copy.deepcopy(model), device="cpu", precision="int8", slab=manifest, config=SYNC,
                                 verbose=False).model(x)
    gate = _GatedWorker(tmp_path, monkeypatch)
    rt = stagehand.offload(model, device="cpu", precision="int8", slab=manifest, config=Config(slab_reads="process"),
                           verbose=False)
    behind = rt.store.rows_behind
    assert behind is not None and not behind.done and behind.blocks_in == 0  # returned with no row in
    assert "slab rows handed over (read behind offload)" in rt.offload_summary["seconds"]
    assert rt.offload_summary["rows_behind"].startswith("0 of 3 blocks in; the reader process reads the rest")
    gate.release()
    with torch.no_grad():
        got = model(x)  # its first fetch waits for the rows
    assert torch.equal(got, want)
    report = rt.stats()["slab_rows_behind"]
    assert report["done"] and report["blocks_in"] == 3 and report["error"] == "" and report["reads_s"] > 0
    rt.close()


@pytest.mark.parametrize("damage", ["checksum", "worker dies"])
def test_a_failure_found_behind_offload_is_raised_by_every_fetch(slab, tmp_path, monkeypatch, damage):
    model, x, manifest = slab
    if damage == "checksum":
        with SlabReader(manifest) as reader:
            info = reader.header.tensors["blocks.1.down.qweight"]
        with open(reader.path, "r+b") as f:
            f.seek(info.start)
            byte = f.read(1)
            f.seek(info.start)
            f.write(bytes([byte[0] ^ 0x01]))
        error, says = SlabChecksumError, r"layer 'blocks\.1\.down'.*'blocks\.1\.down\.qweight' crc32"
    else:
        error, says = SlabError, r"ended with exit status -9 before every layer was read"
    gate = _GatedWorker(tmp_path, monkeypatch)
    rt = stagehand.offload(model, device="cpu", precision="int8", slab=manifest, config=Config(slab_reads="process"),
                           verbose=False)
    if damage == "worker dies":
        os.kill(rt.store.rows_behind._worker.proc.pid, signal.SIGKILL)
    gate.release()
    for _ in range(2):  # and again: a model whose rows are not all in never computes
        with pytest.raises(error, match=says), torch.no_grad():
            model(x)
    with pytest.raises(error, match=says):  # a new precision map after offload pins by every row: it waits too
        rt.set_precision("int8")
    assert rt.stats()["slab_rows_behind"]["error"]
    rt.close()


def test_closing_before_the_rows_are_read_stops_the_reader(slab, tmp_path, monkeypatch):
    model, _, manifest = slab
    gate = _GatedWorker(tmp_path, monkeypatch)
    rt = stagehand.offload(model, device="cpu", precision="int8", slab=manifest, config=Config(slab_reads="process"),
                           verbose=False)
    behind = rt.store.rows_behind
    rt.close()  # the worker is killed where it waits; no reader writes into the freed pages
    assert behind._worker.proc.poll() is not None and "cancelled" in behind.summary()["error"]
    gate.release()
    with pytest.raises(SlabError, match="cancelled"):
        behind.wait()


def test_a_meta_model_whose_biases_come_from_the_slab_has_every_row_when_offload_returns(slab):
    model, _, manifest = slab
    meta = _meta_model(model)
    rt = stagehand.offload(meta, device="cpu", precision="int8", slab=manifest, config=Config(slab_reads="process"),
                           verbose=False)
    assert rt.store.rows_behind is None and "slab rows read" in rt.offload_summary["seconds"]
    assert not meta.blocks[0].up.bias.is_meta
    with pytest.raises(ConfigError, match="slab_rows_behind: must be True or False, got 'yes'"):
        Config(slab_rows_behind="yes").validate()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_blocks_read_by_the_process_are_page_locked_memfd_pages_and_compute_as_the_threads_read_them(slab):
    from _helpers import page_locked

    model, x, manifest = slab
    outputs = {}
    for reads in ("threads", "process"):
        meta = _meta_model(model)
        rt = stagehand.offload(meta, device="cuda", precision="int8", slab=manifest,
                               config=Config(slab_reads=reads), verbose=False)
        try:
            assert all(page_locked(rt.store.buffer(b, "int8")) for b in range(3))  # cudaHostRegister of the memfd's
            if reads == "process":
                assert "memfd:stagehand-int8-copy" in _memfd_mappings()
            with torch.no_grad():
                outputs[reads] = meta(x.cuda()).cpu()
        finally:
            del rt
    assert torch.equal(outputs["threads"], outputs["process"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rows_read_behind_offload_are_page_locked_and_compute_as_rows_read_before_it(slab, tmp_path,
                                                                                         monkeypatch):
    from _helpers import page_locked

    model, x, manifest = slab
    with torch.no_grad():
        want = stagehand.offload(copy.deepcopy(model), device="cuda", precision="int8", slab=manifest, config=SYNC,
                                 verbose=False).model(x.cuda()).cpu()
    gate = _GatedWorker(tmp_path, monkeypatch)
    rt = stagehand.offload(model, device="cuda", precision="int8", slab=manifest, config=Config(slab_reads="process"),
                           verbose=False)
    assert rt.store.rows_behind.blocks_in == 0 and not rt.store.rows_behind.done
    gate.release()
    with torch.no_grad():
        got = model(x.cuda()).cpu()  # the first fetch waits; the listener page-locked each block as it came in
    assert torch.equal(got, want)
    assert all(page_locked(rt.store.buffer(b, "int8")) for b in range(3))
    rt.close()


def test_an_interrupted_wait_for_the_rows_is_not_their_error():
    """Ctrl-C while the first step waits for the rows: the next wait waits again (the reads' own error would be
    raised by every wait after it)."""

    class Worker:
        path, blocks_in = "slab.safetensors", {0}
        calls = 0

        def finish(self):
            Worker.calls += 1
            if Worker.calls == 1:
                raise KeyboardInterrupt

        def seconds(self):
            return 1.0

    behind = read_process.RowsBehind(Worker())
    with pytest.raises(KeyboardInterrupt):
        behind.wait()
    behind.wait()
    assert behind.done and Worker.calls == 2 and behind.summary()["error"] == ""

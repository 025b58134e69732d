"""offload(slab=...) on CUDA imports the compiler's modules on its own thread while reader threads read the slab:
the callback runs once, on the calling thread, with reads still queued or running, and every layer still lands
where it belongs; a read that fails cancels the queued ones and names its layer."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import types

import pytest
import torch

from torch_stagehand.runtime.slab import loading


class _Reader:
    """Records which layers were read, on which thread; layer `fail` raises."""

    def __init__(self, fail: str | None = None, gate: threading.Event | None = None):
        self.read, self.fail, self.gate = [], fail, gate
        self.lock = threading.Lock()
        self.first_read = threading.Event()

    def read_layer_into(self, name, q, s, b):
        if self.gate is not None:
            self.gate.wait(timeout=60)
        if name == self.fail:
            raise ValueError(f"layer {name} is corrupt")
        if self.fail is not None:  # a read that takes a while (a millisecond of work), as a disk read does
            torch.linalg.qr(torch.ones(64, 64) + torch.eye(64))
        q.fill_(int(name[1:]))
        with self.lock:
            self.read.append((name, threading.current_thread().name))
        self.first_read.set()


def _reads(n: int):
    return [(f"l{i}", torch.zeros(4, dtype=torch.int8), torch.zeros(4), None, None) for i in range(n)]


def test_the_callback_runs_on_the_calling_thread_while_the_reads_are_under_way():
    gate, seen = threading.Event(), []
    reader, reads = _Reader(gate=gate), _reads(40)

    def while_reading():
        seen.append((threading.current_thread() is threading.main_thread(), len(reader.read)))
        gate.set()  # the reads wait for this: the callback ran before any of them finished

    loading._read_in_parallel(reader, [reads], while_reading)
    assert seen == [(True, 0)]
    assert sorted(n for n, _ in reader.read) == sorted(n for n, *_ in reads)
    assert all(t.startswith("stagehand-slab-read") for _, t in reader.read)
    assert all(int(q[0]) == int(n[1:]) for n, q, *_ in reads)  # each layer's rows in its own buffer


def test_the_clock_hears_when_the_reads_ended_not_when_the_callback_did():
    """The reads end while the callback still runs: offload's report must say when the last read ended (the
    stage then waited for the callback's work, not the disk), not the stage's whole time."""
    from torch_stagehand.runtime.telemetry.stage_clock import StageClock

    reader, reads, clock = _Reader(), _reads(8), StageClock()
    callback = []

    def while_reading():
        start = time.perf_counter()
        while len(reader.read) < len(reads):  # the reads end first ...
            torch.linalg.qr(torch.ones(64, 64) + torch.eye(64))
        for _ in range(2000):  # ... then the callback goes on a while
            torch.linalg.qr(torch.ones(64, 64) + torch.eye(64))
        callback.append(time.perf_counter() - start)

    loading._read_in_parallel(reader, [reads], while_reading, clock=clock)
    assert set(clock.overlapped) == {"slab reads"}
    assert 0 < clock.overlapped["slab reads"] < callback[0]


def test_each_block_is_handed_on_once_its_last_rows_are_in():
    """`on_block_read(block)` (offload page-locks the block there) runs once per block, on a reader thread, after
    every layer of that block was read, and never for a block whose rows another rank reads."""
    gate = threading.Event()
    reader = _Reader(gate=gate)
    specs = [types.SimpleNamespace(block=i // 4) for i in range(12)]  # 3 blocks of 4 layers
    reads = [(n, q, s, b, spec) for (n, q, s, b, _), spec in zip(_reads(12), specs)]
    seen = []

    def on_block_read(block):
        names = {n for n, _ in reader.read}
        seen.append((block, threading.current_thread().name, all(f"l{i}" in names for i in range(4 * block, 4 * block + 4))))

    loading._read_in_parallel(reader, [reads[:4], reads[4:8], reads[8:]], gate.set, rows=lambda block: block != 2,
                              on_block_read=on_block_read)
    assert sorted(b for b, *_ in seen) == [0, 1]
    assert all(t.startswith("stagehand-slab-read") and complete for _, t, complete in seen)


def test_a_blocks_reads_start_while_the_next_blocks_are_laid_out():
    """Offload lays out each block's buffers as the reads of the blocks before it go: the reads do not wait for
    the whole model's layout (Python work on the calling thread, 0.1-0.2 s for Flux)."""
    reader, reads = _Reader(), _reads(8)
    seen = []

    def laid_out():
        yield reads[:4]
        reader.first_read.wait(timeout=60)  # a read of the first block ends while the second is not laid out yet
        seen.append(len(reader.read))
        yield reads[4:]

    loading._read_in_parallel(reader, laid_out())
    assert seen and seen[0] > 0
    assert sorted(n for n, _ in reader.read) == sorted(n for n, *_ in reads)


def test_a_failed_read_names_its_layer_and_cancels_the_queued_ones():
    reader, reads = _Reader(fail="l0"), _reads(2000)
    with pytest.raises(ValueError, match="layer l0 is corrupt"):
        loading._read_in_parallel(reader, [reads])
    assert len(reader.read) < 1000  # most of the queued reads were cancelled when the first one failed


def test_a_read_that_failed_before_the_layout_did_is_the_error_named():
    """The layout of a later block raises after a read of an earlier one failed: the read's error (it names the
    layer) is the one offload reports, the layout's its cause."""
    failed = threading.Event()

    class Failing(_Reader):
        def read_layer_into(self, name, q, s, b):
            failed.set()
            raise ValueError(f"layer {name} is corrupt")

    reads = _reads(3)

    def laid_out():
        yield reads[:1]
        failed.wait(timeout=60)
        raise RuntimeError("block 1 could not be laid out")

    with pytest.raises(ValueError, match="layer l0 is corrupt") as caught:
        loading._read_in_parallel(Failing(), laid_out())
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_a_block_in_two_lists_is_refused():
    """`on_block_read` hands a block on when its last read ends: a block whose reads came in two lists would be
    handed on before its second list was read."""
    reads = [(n, q, s, b, types.SimpleNamespace(block=0)) for n, q, s, b, _ in _reads(4)]
    with pytest.raises(ValueError, match=r"blocks \[0\] came in two lists"):
        loading._read_in_parallel(_Reader(), [reads[:2], reads[2:]], on_block_read=lambda block: None)


def test_the_compiler_imports_load_in_the_calling_process():
    script = ("import sys; from torch_stagehand.compiler.inner import prewarm_compiler_imports as p; "
              "b = 'torch._inductor.compile_fx' in sys.modules; p(); print(b, 'torch._inductor.compile_fx' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True"]


def test_the_cache_keys_are_worked_out_on_a_thread_after_the_imports():
    """The hashes of Triton's build and torch's sources (in every compile-cache key) are computed on a thread of
    their own once the compiler is imported: the first unit's key then finds them cached."""
    script = ("import threading; from torch_stagehand.compiler.inner import prewarm_compiler_imports as p; "
              "from torch._inductor.codecache import CacheBase; "
              "before = CacheBase.get_system.cache_info().currsize; p(); "
              "[t.join() for t in threading.enumerate() if t.name == 'stagehand-cache-keys']; "
              "print(before, CacheBase.get_system.cache_info().currsize)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0", "1"]


def test_the_models_sources_are_indexed_for_dynamo_ahead_of_its_trace():
    """Every source file Dynamo indexes (the function around each line it turns into a node) while it traces a
    LoRA Flux's blocks is among the files offload indexes while the slab is read: the modules' own, their
    attention processors', the helpers they call, the streamed layer's."""
    import peft
    from torch._dynamo import funcname_cache

    import torch_stagehand as stagehand
    from torch_stagehand.app.presets import tiny_flux
    from torch_stagehand.compiler.inner import dynamo_source_files, index_sources_for_dynamo

    model, inputs = tiny_flux(dtype=torch.float32, double=2, single=2, image_tokens=16, text_tokens=8)
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v"]))
    files = dynamo_source_files(model)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    torch._dynamo.reset()
    funcname_cache.clearcache()
    stagehand.compile_blocks(model, options={"inner": "eager"})
    model(**inputs)
    traced = set(funcname_cache.cache)
    assert traced and traced <= set(files), sorted(traced - set(files))
    funcname_cache.clearcache()
    index_sources_for_dynamo(files)
    assert set(funcname_cache.cache) == set(files) and any(funcname_cache.cache.values())
    rt.restore()
    torch._dynamo.reset()

"""How fast offload reads an INT8 slab off the disk, against the disk's own speed, and what slows it.

    python benches/slab_reads.py --slab /path/to/flux.manifest.json --out benches/results/slab_reads.json

Each mode is a fresh process, after the page cache is emptied (root; otherwise the table says the reads came
from the page cache). The baseline is the disk itself: 8 threads reading the file in 32 MiB chunks into
buffers they reuse (no page to commit, no check). The other modes read the way offload does
(`runtime/slab/loading._read_in_parallel`: each layer's rows and scale into its view of one fresh host
arena, with the crc32 check and the scale checks), alone or with what runs beside it in offload on a GPU
machine: the compiler's imports on the calling thread (`prewarm_compiler_imports`). The modes that change
one thing (pages committed before the reads, no crc32, a shorter GIL switch interval) say what each costs.
The process modes read as offload does with `Config(slab_reads="process")` (its default where memfd exists).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = {
    "disk": "the disk: 8 threads, 32 MiB chunks into reused buffers",
    "store": "offload's reads into a fresh host arena (crc32 and scale checks)",
    "store+imports": "the same, the compiler's imports on the calling thread (offload on a GPU machine)",
    "store+imports, switch 0.5 ms": "the same, the GIL's switch interval 0.5 ms (5 ms by default)",
    "store, prefaulted": "offload's reads into an arena whose pages were committed before the timer",
    "store, no crc32": "offload's reads without the crc32 check",
    "store, 16 threads": "offload's reads on 16 threads (8 by default)",
    "store, huge pages": "offload's reads into an arena advised MADV_HUGEPAGE (fewer page faults)",
    "process": "offload's reads by a reader process into memfd pages (Config.slab_reads 'process', read_process.py)",
    "process+imports": "the same, the compiler's imports on the calling thread (offload on a GPU machine)",
}


def read_disk(path: str, threads: int = 8, chunk: int = 32 << 20) -> int:
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    offsets, lock = list(range(0, size, chunk)), threading.Lock()

    def work():
        buf = memoryview(bytearray(chunk))
        while True:
            with lock:
                if not offsets:
                    return
                offset = offsets.pop(0)
            os.preadv(fd, [buf[: min(chunk, size - offset)]], offset)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    os.close(fd)
    return size


def read_store(manifest: str, mode: str) -> tuple[int, float, float]:
    """Offload's read path into one fresh arena; returns (bytes, the reads' seconds, the call's seconds)."""
    import torch

    from torch_stagehand.runtime.host.arena import HostArena, NoPinner
    from torch_stagehand.runtime.slab import loading
    from torch_stagehand.runtime.slab.reader import SlabReader
    from torch_stagehand.runtime.telemetry.stage_clock import StageClock

    from torch_stagehand.runtime.slab.read_process import ProcessPages, read_in_process

    reader = SlabReader(manifest)
    entries = list(reader.layers.values())
    sizes = [n for e in entries for n in (e.out_features * e.in_features, 4 * e.out_features)]
    pages = ProcessPages() if mode.startswith("process") else None
    arena = HostArena("int8", sizes, NoPinner(), backing=pages)
    biases = iter(pages.backing("biases", 4 * sum(e.out_features for e in entries if e.has_bias)).view(
        torch.float32).split([e.out_features for e in entries if e.has_bias])) if pages is not None else None
    if mode == "store, prefaulted":
        arena.base.fill_(0)  # every page committed: the reads only copy
    if mode == "store, 16 threads":
        loading._READ_THREADS = 16
    if mode == "store, huge pages":
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(arena.base.data_ptr(), arena.capacity, 14) != 0:  # MADV_HUGEPAGE
            raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE) failed")
    if mode == "store, no crc32":
        import zlib

        reader._compare_crc = lambda *a: None
        zlib.crc32 = lambda data, *a: 0  # (this process only reads)
    reads = []
    for e in entries:
        q = arena.carve(e.out_features * e.in_features).view(torch.int8).view(e.out_features, e.in_features)
        s = arena.carve(4 * e.out_features).view(torch.float32)
        bias = (next(biases) if pages is not None else torch.empty(e.out_features)) if e.has_bias else None
        reads.append((e.name, q, s, bias, SimpleNamespace(block=len(reads) // 10)))  # blocks of 10 layers
    while_reading = None
    if "imports" in mode:
        from torch_stagehand.compiler.inner import prewarm_compiler_imports

        while_reading = prewarm_compiler_imports
    if "switch" in mode:
        sys.setswitchinterval(0.0005)
    clock = StageClock()
    start = time.perf_counter()
    blocks = [reads[i: i + 10] for i in range(0, len(reads), 10)]
    if pages is not None:
        read_in_process(reader, pages, blocks, while_reading, clock=clock)
        pages.close()
    else:
        loading._read_in_parallel(reader, blocks, while_reading, clock=clock)
    total = time.perf_counter() - start
    reader.close()
    # The reads' own seconds: until the last one ended (the imports beside them may go on longer).
    return sum(sizes), clock.overlapped["slab reads"], total


def child(args) -> dict:
    start = time.perf_counter()
    if args.mode == "disk":
        nbytes = read_disk(args.data)
        seconds = call = time.perf_counter() - start
    else:
        nbytes, seconds, call = read_store(args.slab, args.mode)
    return {"mode": args.mode, "bytes": nbytes, "seconds": round(seconds, 2),
            "gb_s": round(nbytes / 1e9 / seconds, 2), "call_s": round(call, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slab", required=True, help="the slab's .manifest.json")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.data = args.slab.removesuffix(".manifest.json") + ".safetensors"
    if args.child:
        print(json.dumps(child(args)))
        return
    sys.path.insert(0, HERE)
    from _common import print_header, print_rows, write_json
    from start_time import drop_page_cache

    env = print_header()
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            env["transparent_hugepage"] = f.read().strip()
    except OSError:
        env["transparent_hugepage"] = "unknown"
    rows = []
    for mode in args.modes:
        page_cache = drop_page_cache()
        done = subprocess.run([sys.executable, __file__, "--child", "--mode", mode, "--slab", args.slab],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            rows.append({"mode": mode, "error": done.stderr.strip().splitlines()[-1:]})
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row.update(page_cache=page_cache, what=MODES[mode])
        rows.append(row)
        print(f"{mode}: {row['seconds']} s, {row['gb_s']} GB/s (the call {row['call_s']} s)", flush=True)
    disk = next((r["seconds"] for r in rows if r["mode"] == "disk" and "seconds" in r), None)
    for r in rows:
        if disk and "seconds" in r:
            r["x_disk"] = round(r["seconds"] / disk, 2)
    print_rows(rows, ["mode", "seconds", "gb_s", "x_disk", "call_s", "page_cache", "what"],
               title=f"reading {os.path.getsize(args.data) / 1e9:.1f} GB of slab (seconds: until the last read ended; "
                     "call_s: with what ran beside; x disk: seconds over the disk's)")
    if args.out:
        write_json(args.out, {"env": env, "slab": args.slab, "rows": rows})


if __name__ == "__main__":
    main()

"""The slab reader process: reads INT8 layers from a slab into memory its parent maps (read_process.py starts it).

Why a process: offload reads the slab while the calling thread imports and
prepares the compiler, which holds the GIL. Reader threads in that process
need the GIL between their reads and checks (a few handoffs per layer, each
waiting for the busy thread's switch interval), so the reads took 1.15-1.6x
the disk's time there. This process has a GIL of its own and nothing else to
do.

It runs by path (``python -I -S read_worker.py ...``), on the standard library
alone: no torch, no package import, so it starts in a few tens of
milliseconds. Arguments: the slab file's descriptor, the comma-separated
descriptors of the parent's memfds (the regions a read's ``to: [region,
offset]`` names), the number of reader threads.

Input, one JSON line per block: ``{"block": b, "layers": [job, ...]}`` with
each job from `SlabReader.layer_job`. It makes the checks `read_layer_into`
makes, in the same order and with the same messages: each tensor's crc32 where
recorded, scales finite and not all zero, zero points zero, a file not cut
short. Output, one JSON line per event: ``["read", block]`` once a block's
layers are all in; ``["error", block, kind, layer, message]`` for the first
layer that failed (no layer is started after it; those already reading may
still say "read"); ``["end"]`` when every block sent was read. It dies with
its parent (``PR_SET_PDEATHSIG``): a parent killed mid-offload leaves no
reader writing into pages nobody else maps.
"""

import json
import math
import mmap
import os
import sys
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

_CHUNK_BYTES = 8 << 20  # narrowed rows (stored padded, wanted unpadded) go through a scratch buffer of this size


class LayerError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind, self.message = kind, message


# pread_into and check_crc say what safetensors_io.pread_into and SlabReader._compare_crc say: this file imports
# nothing of the package (a torch import would cost the process seconds), so it has its own copies.
def pread_into(fd: int, buf: memoryview, offset: int) -> None:
    done, n = 0, len(buf)
    while done < n:
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got <= 0:
            raise LayerError("truncated", f"file ended at byte {offset + done} while reading {n} bytes at {offset}")
        done += got


def check_crc(part: dict, crc: int) -> None:
    want = part["crc"]
    if want is not None and f"{crc & 0xFFFFFFFF:08x}" != want:
        raise LayerError("checksum", f"tensor {part['key']!r} crc32 {crc & 0xFFFFFFFF:08x} differs from the "
                                     f"manifest's {want} (corrupt data)")


class Worker:
    def __init__(self, slab_fd: int, region_fds: list[int], threads: int):
        self.slab_fd = slab_fd
        self.regions = [memoryview(mmap.mmap(fd, 0)) for fd in region_fds]
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="stagehand-slab-read")
        self.lock = threading.Lock()
        self.left: dict[int, int] = {}  # per block, its layers not read yet
        self.failed = threading.Event()

    def say(self, *event) -> None:
        with self.lock:
            sys.stdout.write(json.dumps(event) + "\n")
            sys.stdout.flush()

    def into(self, part: dict) -> memoryview:
        region, offset = part["to"]
        return self.regions[region][offset: offset + part["nbytes"]]

    def read(self, part: dict, buf: memoryview) -> None:
        pread_into(self.slab_fd, buf, part["start"])
        check_crc(part, zlib.crc32(buf))

    def read_narrowed(self, part: dict) -> None:
        out, stored, width = part["rows"]
        region, offset = part["to"]
        dst = self.regions[region][offset: offset + out * width]
        rows = max(1, _CHUNK_BYTES // stored)
        scratch = memoryview(bytearray(min(rows, out) * stored))
        crc = 0
        for r0 in range(0, out, rows):
            r1 = min(out, r0 + rows)
            n = (r1 - r0) * stored
            pread_into(self.slab_fd, scratch[:n], part["start"] + r0 * stored)
            crc = zlib.crc32(scratch[:n], crc)
            for r in range(r0, r1):
                dst[r * width: (r + 1) * width] = scratch[(r - r0) * stored: (r - r0) * stored + width]
        check_crc(part, crc)

    def read_layer(self, job: dict) -> None:
        q = job["qweight"]
        if "rows" in q:
            self.read_narrowed(q)
        else:
            self.read(q, self.into(q))
        scale = self.into(job["scale"])
        self.read(job["scale"], scale)
        values = scale.cast("f")  # float32 (slabs are little-endian, as is every host that reads them)
        if not all(map(math.isfinite, values)):
            raise LayerError("value", "scale holds NaN or Inf")
        if not any(values):
            raise LayerError("value", "scale is all zero (the layer would dequantize to zeros)")
        zero_point = memoryview(bytearray(job["zero_point"]["nbytes"]))
        self.read(job["zero_point"], zero_point)
        if any(zero_point.cast("f")):
            raise LayerError("unsupported", "zero_point is non-zero")
        if job["bias"] is not None:
            self.read(job["bias"], self.into(job["bias"]))

    def run_layer(self, block: int, job: dict) -> None:
        if self.failed.is_set():
            return
        try:
            self.read_layer(job)
        except LayerError as e:
            fail = (e.kind, e.message)
        except Exception as e:  # noqa: BLE001 - an OSError of the read, a bad job: the parent names the layer
            fail = ("os", f"{type(e).__name__}: {e}")
        else:
            with self.lock:
                self.left[block] -= 1
                last = self.left[block] == 0
            if last:
                self.say("read", block)
            return
        if not self.failed.is_set():
            self.failed.set()
            self.say("error", block, fail[0], job["layer"], fail[1])

    def serve(self, lines) -> None:
        for line in lines:
            if self.failed.is_set():
                break
            blocks = json.loads(line)
            with self.lock:
                self.left[blocks["block"]] = len(blocks["layers"])
            for job in blocks["layers"]:
                self.pool.submit(self.run_layer, blocks["block"], job)
        self.pool.shutdown(wait=True)
        if not self.failed.is_set():
            self.say("end")


def die_with_parent() -> None:
    """SIGKILL when the parent dies (Linux); a parent already gone: exit now."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):  # not Linux: the parent kills it on every error path
        pass
    if os.getppid() != parent:
        sys.exit(1)


def main(argv: list[str]) -> None:
    die_with_parent()
    slab_fd, regions, threads = int(argv[1]), [int(fd) for fd in argv[2].split(",") if fd], int(argv[3])
    Worker(slab_fd, regions, threads).serve(sys.stdin)


if __name__ == "__main__":
    main(sys.argv)

"""The slab reader process (read_process.py starts it): INT8 layers read from a slab into memory its parent maps.

Run by path (``python -I -S read_worker.py SLAB_FD REGION_FDS THREADS``, REGION_FDS the memfds a job's ``to:
[region, offset]`` names) on the standard library alone, to start in milliseconds; so this file holds the package's
one ``pread`` loop. Input, a JSON line per block: ``{"block": b, "layers": [job, ...]}`` (`SlabReader.layer_job`;
each layer gets `read_layer_into`'s checks and messages). Output, a JSON line per event: ``["read", block]``;
``["error", block, kind, layer, message]`` for the first failed layer (none starts after it); ``["end"]``. It dies
with its parent (``PR_SET_PDEATHSIG``)."""

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


def pread_into(fd: int, buf: memoryview, offset: int) -> None:
    """Fill `buf` from `offset` of `fd`; a file that ends first is a "truncated" LayerError."""
    done, n = 0, len(buf)
    while done < n:
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got <= 0:
            raise LayerError("truncated", f"file ended at byte {offset + done} while reading {n} bytes at {offset}")
        done += got


def check_crc(part: dict, crc: int) -> None:  # says what SlabReader._compare_crc says
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

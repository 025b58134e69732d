"""`offload(model, slab=path)`: INT8 blocks read from a slab straight into the host store.

Each streamed layer's rows and scale go from the file into views of the
block's (pinned) INT8 buffer; no BF16 copy is made. A model built on the meta
device (no full-precision weights at all) works too: its blocks are INT8-only,
and asking for "bf16" on them is an error. Every mismatch between slab and
model (a layer missing from the slab, another shape, a bad file) is a
`SlabError` naming the layer and the file; nothing is zero-filled and a load
that fails leaves the model as it was.

While the rows are read, a worker thread checks the model's full-precision
weights (where it has them) against the identity the slab records of its source
weights (`identity.py`), beside the calling thread's own work (offload's
compiler imports): a slab quantized from other weights of the same shapes
is a `SlabIdentityError` naming the first such layer (the reads still queued are
cancelled, or the reader process killed, and offload puts the model back); a
slab that records no identity loads with a `SlabIdentityWarning`, or is refused
when ``Config(require_slab_identity=True)``. Each block streamed in INT8 is
page-locked as soon as its rows are in, beside the reads still going.

Who reads the rows (`Config.slab_reads`): a reader process of its own, into
memfd pages both map (`read_process.py`: the calling thread's compiler imports
hold this process's GIL, which reader threads here wait for between reads), or
reader threads here (`_read_in_parallel`: the ranks of a node that share the
store, platforms without memfd).

The reader process's reads go on behind offload (`Config.slab_rows_behind`,
`read_process.RowsBehind`): offload returns once every block is handed over,
the identity checked and the compiler prepared; the host store waits for the
rest before an INT8 buffer is read or written (the first step's first fetch,
after its capture and compile). A layer found bad after offload returned is
raised by that fetch, and by every one after it.

This is the one module of the slab package that knows the streaming engine,
because its job is to fill the engine's host store: it writes into the INT8
buffers the store allocates (`precision.layer_views` names each layer's rows
and scale in a block buffer) and is called back by `Runtime` (typed only). The
rest of `slab/` (reader, builder, manifest, I/O) never imports the engine (only
the shared Linear-like rule, `runtime/linear_like.py`), and the package's
`__init__` does not import this module: the import graph has its one edge from
the slab format to the engine here, and the engine has none back.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from torch_stagehand.runtime.beside import run_beside
from torch_stagehand.runtime.config import ConfigError
from torch_stagehand.runtime.host.setup import resident_file_names
from torch_stagehand.runtime.precision import INT8, layer_views
from torch_stagehand.runtime.telemetry.stage_clock import COMPILER_PREPARATION, FILES_READ_AHEAD, StageClock

from torch_stagehand.runtime.slab import checks
from torch_stagehand.runtime.slab.errors import SlabLayerNotFoundError
from torch_stagehand.runtime.slab.layers import canonical_name
from torch_stagehand.runtime.slab.read_process import ProcessPages, process_reads_possible, read_in_process
from torch_stagehand.runtime.slab.reader import SlabReader

if TYPE_CHECKING:
    from torch_stagehand.runtime.runtime import Runtime

# Offload's stage when the reader process reads on behind it (Config.slab_rows_behind): the blocks laid out and
# handed over, the identity checked, the compiler prepared; the rows still coming in.
ROWS_HANDED_OVER = "slab rows handed over (read behind offload)"
ZERO_POINTS = "slab zero points checked"  # beside the reads, with the identity, when the rows are read behind
_ZERO_POINT_THREADS = 16  # small reads at once: a cold disk's seeks overlap (as the identity's rows, host/weights_file.py)
_READ_THREADS = 8  # enough to saturate a page cache or an NVMe drive; each thread holds no buffer of its own


def resolve_manifest(slab: str | os.PathLike) -> str:
    path = os.fspath(slab)
    if path.endswith(".manifest.json"):
        return path
    if path.endswith(".safetensors"):
        return path[: -len(".safetensors")] + ".manifest.json"
    if os.path.exists(path + ".manifest.json"):
        return path + ".manifest.json"
    raise FileNotFoundError(
        f"offload: slab {path!r} is neither a .manifest.json, a .safetensors, nor a prefix with a manifest beside it"
    )


def slab_loader_for(slab: str | os.PathLike, while_reading: Callable[[], None] | None = None,
                    before_reading: Callable[[], float] | None = None) -> Callable[["Runtime", list[int]], None]:
    """The loader `Runtime` calls to fill its INT8 buffers from `slab`: `load(rt, pin)`, where `pin` lists the
    blocks that stream INT8 (each is page-locked as soon as its rows are in, beside the reads still going).
    `while_reading()` runs on the calling thread while the rows are read (work that would otherwise wait
    for the slab, or make the slab wait), and the slab's identity check on a worker thread beside it; then,
    for a model built on the meta device, its resident tensors' pages are read from its checkpoint (they are
    loaded next). `before_reading()` is waited for before the first read (offload's read-ahead of the files
    `while_reading` will ask for; it returns the seconds that work took on its own thread)."""
    manifest = resolve_manifest(slab)

    def load(rt: "Runtime", pin: list[int] = ()) -> None:
        stacks = [spec.fqn for spec in rt.layers if spec.experts]
        if stacks:  # the slab format holds Linear layers (builder.iter_linear_layers): none of these
            raise SlabLayerNotFoundError(
                f"streamed expert stack {stacks[0]} (and {len(stacks) - 1} more) can not come from a slab: the "
                "slab format holds Linear layers only; offload this model without slab=", path=manifest,
                layer=stacks[0])
        # Zero points are checked by each layer's read (`read_layer_into`), not in a pass of their own at open: one
        # small read per layer, scattered over the file, each a seek on a cold disk before the first row is read.
        # Not on the ranks of a node that share the store: each reads some blocks' rows, and a bad zero point must
        # stop every one of them at open, as before.
        with SlabReader(manifest, check_zero_points=rt.store.node is not None) as reader:
            reader.check_model(rt.model)

            def check_identity() -> None:
                weights = _live_weights(rt, reader)
                if rt.checkpoint is not None:  # weights mapped from it: their sampled rows' pages, a read per row
                    rt.checkpoint.read_rows_ahead([(w, reader.layers[name].identity["rows"]) for name, w in weights
                                                   if reader.layers[name].identity is not None])
                # Anything else of theirs is read without readahead (host/weights_file.py).
                with rt.checkpoint.random_access() if rt.checkpoint is not None else contextlib.nullcontext():
                    checks.check_identity(reader.manifest, weights, reader.manifest_path,
                                          require=rt.config.require_slab_identity)

            if rt.config.int8_tier == "disk":  # no rows to read: the check is a stage of its own
                check_identity()
                rt.clock.mark("slab opened, identity checked")
                return _attach_disk_tier(rt, reader, manifest)
            for bb in rt.store.blocks:  # every streamed layer is in the slab, before any buffer or read
                missing = next((spec.fqn for spec in bb.layers if canonical_name(spec.fqn) not in reader.layers), None)
                if missing is not None:
                    raise SlabLayerNotFoundError(f"streamed layer {missing} is not in the slab", path=reader.path,
                                                 layer=canonical_name(missing))
            pages = _process_pages(rt)  # None: reader threads here
            try:
                rt.store.reserve(INT8, list(range(len(rt.store.blocks))), backing=pages)
                bias_into = _bias_buffers(rt, reader, pages)
                # A meta model's biases from the slab are Parameters before offload returns: no reads behind then.
                behind = pages is not None and rt.config.slab_rows_behind and not bias_into
                reads = []  # (layer name, qweight view, scale view, bias buffer or None, spec), as laid out

                def blocks_laid_out():
                    """Each block's buffer and reads, laid out while the blocks before it are read already."""
                    for block, bb in enumerate(rt.store.blocks):
                        buf = rt.store.allocate(block, INT8)  # a slab holds per-row INT8 rows + fp32 scales
                        group = []
                        for spec, lay in zip(bb.layers, rt.store.layout(block, INT8)):
                            q, s = layer_views(buf, lay)
                            group.append((canonical_name(spec.fqn), q, s, bias_into.get(id(spec)), spec))
                        reads.extend(group)
                        yield group

                rt.clock.mark("slab opened")
                if before_reading is not None:
                    rt.clock.beside(FILES_READ_AHEAD, before_reading())
                    rt.clock.mark(FILES_READ_AHEAD + " (the wait)")

                def calling_thread() -> None:
                    if while_reading is not None:
                        start = time.perf_counter()
                        while_reading()
                        rt.clock.beside(COMPILER_PREPARATION, time.perf_counter() - start)
                    if rt.checkpoint is not None:  # the resident tensors, loaded from it once the reads end
                        start = time.perf_counter()
                        streamed = {spec.weight_name for spec in rt.layers}
                        rt.checkpoint.read_ahead(resident_file_names(rt.model, rt.checkpoint, streamed))
                        rt.clock.beside("resident tensors' pages read", time.perf_counter() - start)

                def beside_the_reads() -> None:
                    # The identity check goes beside the reads, not before them: a slab of other weights still fails
                    # offload (the reads are cancelled, the model put back), and a right one costs no wait. Its sampled
                    # rows come off the disk too (a checkpoint's pages), on threads of its own, while this thread
                    # imports the compiler: the two one after the other took longer than the reads (Flux int8 from
                    # files: 4.8 s + 3.6 s against 6.7 s).
                    seconds: dict[str, float] = {}
                    on_calling_thread = calling_thread if while_reading is not None or rt.checkpoint is not None else None
                    run_beside(check_beside, on_calling_thread, "stagehand-identity", seconds)

                def check_beside() -> None:
                    # Rows read behind offload: a slab this runtime can not compute with (non-zero zero points, a
                    # SquareQ slab's) still fails offload, not the first step. Each read checks its layer's too.
                    # A small read per layer, scattered: on threads of their own, beside the identity's reads (one
                    # after the other, on one thread, took 4.4 s + 3.2 s beside Flux's reads on an H200 machine).
                    if not behind:  # each layer's read checks its zero points before offload returns
                        rt.clock.beside("slab identity check", _timed(check_identity))
                        return
                    with ThreadPoolExecutor(1, thread_name_prefix="stagehand-zero-points") as one:
                        zero_points = one.submit(_timed, reader.check_zero_points, _ZERO_POINT_THREADS)
                        rt.clock.beside("slab identity check", _timed(check_identity))
                        rt.clock.beside(ZERO_POINTS, zero_points.result())

                streams_int8 = set(pin)

                def block_read(block: int) -> None:  # on a reader (or listener) thread, while other blocks are read
                    if block in streams_int8:  # read behind: a refused lock leaves it pageable (offload may be done)
                        rt.store.lock_filled(block, INT8, refuse=False if behind else None)

                rows_behind = None
                if pages is None:
                    _read_in_parallel(reader, blocks_laid_out(), beside_the_reads, clock=rt.clock,
                                      on_block_read=block_read, rows=lambda block: rt.store.writes(block, INT8))
                else:
                    rows_behind = read_in_process(reader, pages, blocks_laid_out(), beside_the_reads, clock=rt.clock,
                                                  on_block_read=block_read, threads=_read_threads(), behind=behind)
                for _name, _q, _s, bias_out, spec in reads:
                    if bias_out is not None:
                        bias = spec.module.bias
                        value = bias_out if pages is None else bias_out.to(bias.dtype, copy=True)  # out of the staging
                        spec.module._parameters["bias"] = torch.nn.Parameter(value, requires_grad=bias.requires_grad)
                for block in range(len(rt.store.blocks)):
                    rt.store.mark_built(block, INT8)
                rt.store.rows_behind = rows_behind  # the store waits for them before an INT8 buffer is used
                rt.clock.mark("slab rows read" if rows_behind is None else ROWS_HANDED_OVER)
            finally:  # the memfds' descriptors (the mappings keep the pages), however the load ends
                if pages is not None:
                    pages.close()

    return load


def _process_pages(rt: "Runtime") -> ProcessPages | None:
    """Pages for a reader process (`Config.slab_reads`), or None: reader threads in this process."""
    choice = rt.config.slab_reads
    why_not = process_reads_possible() or ("the ranks of this node share the store (their reads go into the "
                                           "node's pages)" if rt.store.node is not None else None)
    if choice == "threads" or (choice == "auto" and why_not):
        return None
    if why_not:
        raise ConfigError(f"slab_reads: 'process' can not be used here: {why_not}; 'threads' or 'auto' can")
    return ProcessPages()


def _bias_buffers(rt: "Runtime", reader: SlabReader, pages: ProcessPages | None) -> dict[int, torch.Tensor]:
    """id(spec) -> where a meta bias is read from the slab: its new tensor (reader threads), or float32 in pages
    the reader process maps (cast into its new tensor once the reads end). Not a bias the model's checkpoint
    holds: the resident tensors come from there (`load_resident`), and the rows can then be read behind."""
    specs = [spec for spec in rt.layers if spec.module.bias is not None and spec.module.bias.is_meta
             and canonical_name(spec.fqn) in reader.layers and reader.layers[canonical_name(spec.fqn)].has_bias
             and (rt.checkpoint is None or f"{spec.fqn}.bias" not in rt.checkpoint)]
    if pages is None:
        return {id(spec): torch.empty(spec.module.bias.shape, dtype=spec.module.bias.dtype) for spec in specs}
    if not specs:
        return {}
    sizes = [spec.module.bias.numel() for spec in specs]
    staged = pages.backing("slab biases", 4 * sum(sizes)).view(torch.float32).split(sizes)
    return {id(spec): view for spec, view in zip(specs, staged)}


def _timed(work: Callable, *args) -> float:
    start = time.perf_counter()
    work(*args)
    return time.perf_counter() - start


def _read_threads() -> int:
    return max(1, min(_READ_THREADS, os.cpu_count() or 1))


def _read_in_parallel(reader: SlabReader, blocks: Iterable[list], while_reading: Callable[[], None] | None = None,
                      rows: Callable[[int], bool] | None = None, clock: StageClock | None = None,
                      on_block_read: Callable[[int], None] | None = None) -> None:
    """Every layer's rows, scale and bias from the file into its buffer, on a few threads: `preadv` and the crc32
    check release the GIL, so the reads go at the page cache's (or the disk's) speed, not one memcpy core's.
    `blocks` yields the reads a list at a time (a block's reads all in one list), each list submitted as it
    comes: the caller lays out the next block's buffers while the first blocks are read.
    The first error (a SlabError naming the layer) is raised once the reads under way finish; the queued ones
    are cancelled, and no block is laid out after it. `rows(block)` False: only the layer's bias (another rank
    of the node reads the block's rows into the shared store). `on_block_read(block)` runs on the reader thread that read a block's last rows.
    `clock` hears when the last read ended (beside `while_reading`, which may end before or after)."""
    left: Counter = Counter()  # per block, its reads not yet done
    lock = threading.Lock()
    failed: list[BaseException] = []  # the reads' errors, in the order they ended

    def read_rows(name, q, s, b, spec) -> None:
        reader.read_layer_into(name, q, s, b)
        if on_block_read is not None and spec is not None:
            with lock:
                left[spec.block] -= 1
                last = left[spec.block] == 0
            if last:
                on_block_read(spec.block)

    pool = ThreadPoolExecutor(_read_threads(), thread_name_prefix="stagehand-slab-read")

    def ended(future) -> None:
        last_read.append(time.perf_counter())
        if not future.cancelled() and future.exception() is not None:
            failed.append(future.exception())

    try:
        start = time.perf_counter()
        last_read = [start]
        futures, submitted = [], set()
        try:
            for group in blocks:
                if failed:  # a read failed: no more layout, no more reads
                    break
                group = [(r, rows is None or rows(r[4].block)) for r in group]
                group = [(r, whole) for r, whole in group if whole or r[3] is not None]
                blocks_in = {r[4].block for r, _ in group if r[4] is not None}
                if blocks_in & submitted:  # on_block_read would run before the block's later reads
                    raise ValueError(f"slab reads: blocks {sorted(blocks_in & submitted)} came in two lists")
                submitted |= blocks_in
                with lock:  # counted before any of the block's reads can end
                    left.update(r[4].block for r, whole in group if whole and r[4] is not None)
                for r, whole in group:
                    future = pool.submit(read_rows, *r) if whole else pool.submit(reader.read_bias_into, r[0], r[3])
                    future.add_done_callback(ended)
                    futures.append(future)
        except BaseException as e:  # the layout failed: a read that failed before it is the error to name
            for future in futures:
                future.cancel()
            wait(futures)
            first = next((f.exception() for f in futures if not f.cancelled() and f.exception() is not None), None)
            if first is not None:
                raise first from e
            raise
        if failed:
            raise failed[0]
        if while_reading is not None:
            while_reading()
        for done in futures:
            done.result()
        if clock is not None:
            clock.beside("slab reads", max(last_read) - start)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _attach_disk_tier(rt: "Runtime", reader: SlabReader, manifest: str) -> None:
    """Config(int8_tier="disk"): the INT8 rows stay in the file; only meta biases are read now."""
    from torch_stagehand.runtime.host.disk_tier import DiskTier

    names = {}
    for block, bb in enumerate(rt.store.blocks):
        names[block] = []
        for spec in bb.layers:
            name = canonical_name(spec.fqn)
            if name not in reader.layers:
                raise SlabLayerNotFoundError(f"streamed layer {spec.fqn} is not in the slab", path=reader.path, layer=name)
            names[block].append(name)
            bias = spec.module.bias
            if bias is not None and bias.is_meta and reader.layers[name].has_bias:
                value = reader.read_layer(name)[2].to(bias.dtype)
                spec.module._parameters["bias"] = torch.nn.Parameter(value, requires_grad=bias.requires_grad)
    tier_reader = SlabReader(manifest)  # its own: the tier reads on its worker thread for the Runtime's life
    try:
        rt.store.attach_disk_tier(DiskTier(tier_reader, rt.store, names), INT8)
    except BaseException:
        tier_reader.close()
        raise
    for block in range(len(rt.store.blocks)):
        rt.store.mark_built(block, INT8)


def _live_weights(rt: "Runtime", reader: SlabReader) -> list[tuple[str, torch.Tensor]]:
    """(canonical name, [out, in] full-precision weight) of the streamed layers the slab holds."""
    out = []
    for spec in rt.layers:
        name, w = canonical_name(spec.fqn), spec.module.weight
        if name in reader.layers and not w.is_meta:
            out.append((name, w.detach().t() if spec.transposed else w.detach()))
    return out

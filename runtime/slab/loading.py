"""`offload(model, slab=path)`: INT8 blocks read from a slab straight into the host store (no BF16 copy).

A meta model works too. A mismatch is a `SlabError` naming the layer and the file, and leaves the model as it was.
Beside the reads, the model's weights are checked against the slab's identity (`identity.py`) and each block is
page-locked once its rows are in. The rows are read by a process of their own (`read_process.py`), maybe behind
offload, or by threads here. The one module of `slab/` that imports the engine; `slab/__init__` does not import it."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Iterable

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

# Offload's stage when the rows are read behind it (Config.slab_rows_behind): handed over, still coming in.
ROWS_HANDED_OVER = "slab rows handed over (read behind offload)"
ZERO_POINTS = "slab zero points checked"  # beside the reads, with the identity, when the rows are read behind
_ZERO_POINT_THREADS = 16  # small reads at once: a cold disk's seeks overlap
_READ_THREADS = 8  # enough to saturate a page cache or an NVMe drive (capped at the cores where it is read)


def _read_threads() -> int:
    return max(1, min(_READ_THREADS, os.cpu_count() or 1))


def resolve_manifest(slab: str | os.PathLike) -> str:
    path = os.fspath(slab)
    if path.endswith(".manifest.json"):
        return path
    if path.endswith(".safetensors"):
        return path[: -len(".safetensors")] + ".manifest.json"
    if os.path.exists(path + ".manifest.json"):
        return path + ".manifest.json"
    raise FileNotFoundError(
        f"offload: slab {path!r} is neither a .manifest.json, a .safetensors, nor a prefix with a manifest beside it")


def slab_loader_for(slab: str | os.PathLike, while_reading: Callable[[], None] | None = None,
                    before_reading: Callable[[], float] | None = None) -> Callable[..., None]:
    """The loader `Runtime` calls to fill its INT8 buffers from `slab`: `load(model, layers, store, checkpoint,
    config, clock, pin)`, `pin` the blocks that stream INT8 (each page-locked as soon as its rows are in).
    `while_reading()` runs on the calling thread while the rows are read, the identity check on a worker thread
    beside it; then a meta model's resident tensors' pages are read from its checkpoint. `before_reading()`
    (offload's read-ahead; returns the seconds it took on its own thread) is waited for before the first read."""
    manifest = resolve_manifest(slab)

    def load(model, layers, store, checkpoint, config, clock: StageClock, pin: list[int] = ()) -> None:
        stacks = [spec.fqn for spec in layers if spec.experts]
        if stacks:  # the slab format holds Linear layers (builder.iter_linear_layers): none of these
            raise SlabLayerNotFoundError(f"streamed expert stack {stacks[0]} (and {len(stacks) - 1} more) can not "
                                         "come from a slab: the slab format holds Linear layers only; offload this "
                                         "model without slab=", path=manifest, layer=stacks[0])
        # Zero points are checked by each layer's read, not at open (a seek per layer before the first row); but at
        # open on the ranks of a node sharing the store: each reads some blocks' rows, and all must stop.
        with SlabReader(manifest, check_zero_points=store.node is not None) as reader:
            reader.check_model(model)

            def check_identity() -> None:
                weights = _live_weights(layers, reader)
                if checkpoint is not None:  # weights mapped from it: their sampled rows' pages, a read per row
                    checkpoint.read_rows_ahead([(w, reader.layers[name].identity["rows"]) for name, w in weights
                                                   if reader.layers[name].identity is not None])
                # Anything else of theirs is read without readahead.
                with checkpoint.random_access() if checkpoint is not None else contextlib.nullcontext():
                    checks.check_identity(reader.manifest, weights, reader.manifest_path,
                                          require=config.require_slab_identity)

            # Every streamed layer is in the slab, before any buffer or read.
            missing = next((spec.fqn for spec in layers if canonical_name(spec.fqn) not in reader.layers), None)
            if missing is not None:
                raise SlabLayerNotFoundError(f"streamed layer {missing} is not in the slab", path=reader.path,
                                             layer=canonical_name(missing))
            if config.int8_tier == "disk":  # no rows to read: the check is a stage of its own
                check_identity()
                clock.mark("slab opened, identity checked")
                return _attach_disk_tier(store, reader, manifest)
            pages = _process_pages(config.slab_reads, store.node)  # None: reader threads here
            try:
                store.reserve(INT8, list(range(len(store.blocks))), backing=pages)
                bias_into = _bias_buffers(layers, checkpoint, reader, pages)
                # A meta model's biases from the slab are Parameters before offload returns: no reads behind then.
                behind = pages is not None and config.slab_rows_behind and not bias_into

                def blocks_laid_out():
                    """Each block's reads (layer name, qweight view, scale view, bias buffer or None, spec), laid out
                    while the blocks before it are read already."""
                    for block, bb in enumerate(store.blocks):
                        buf = store.allocate(block, INT8)  # a slab holds per-row INT8 rows + fp32 scales
                        yield [(canonical_name(spec.fqn), *layer_views(buf, lay), bias_into.get(id(spec)), spec)
                               for spec, lay in zip(bb.layers, store.layout(block, INT8))]

                clock.mark("slab opened")
                if before_reading is not None:
                    clock.beside(FILES_READ_AHEAD, before_reading())
                    clock.mark(FILES_READ_AHEAD + " (the wait)")

                def calling_thread() -> None:
                    if while_reading is not None:
                        clock.beside(COMPILER_PREPARATION, _timed(while_reading))
                    if checkpoint is not None:  # the resident tensors, loaded from it once the reads end
                        streamed = {spec.weight_name for spec in layers}
                        clock.beside("resident tensors' pages read", _timed(
                            lambda: checkpoint.read_ahead(resident_file_names(model, checkpoint, streamed))))

                def beside_the_reads() -> None:
                    # The identity check beside the reads: a wrong slab still fails offload, a right one costs no wait.
                    on_calling_thread = calling_thread if while_reading is not None or checkpoint is not None else None
                    run_beside(check_beside, on_calling_thread, "stagehand-identity")

                def check_beside() -> None:
                    # Rows read behind offload: non-zero zero points still fail offload (threads of their own).
                    if not behind:  # each layer's read checks its zero points before offload returns
                        clock.beside("slab identity check", _timed(check_identity))
                        return
                    with ThreadPoolExecutor(1, thread_name_prefix="stagehand-zero-points") as one:
                        zero_points = one.submit(_timed, reader.check_zero_points, _ZERO_POINT_THREADS)
                        clock.beside("slab identity check", _timed(check_identity))
                        clock.beside(ZERO_POINTS, zero_points.result())

                streams_int8 = set(pin)

                def block_read(block: int) -> None:  # on a reader (or listener) thread, while other blocks are read
                    if block in streams_int8:  # read behind: a refused lock leaves it pageable (offload may be done)
                        store.lock_filled(block, INT8, refuse=False if behind else None)

                rows_behind = None
                if pages is None:
                    _read_in_parallel(reader, blocks_laid_out(), beside_the_reads, clock=clock,
                                      on_block_read=block_read, rows=lambda block: store.writes(block, INT8))
                else:
                    rows_behind = read_in_process(reader, pages, blocks_laid_out(), beside_the_reads, clock=clock,
                                                  on_block_read=block_read, threads=_read_threads(), behind=behind)
                for spec in layers:
                    bias_out, bias = bias_into.get(id(spec)), spec.module.bias
                    if bias_out is not None:
                        value = bias_out if pages is None else bias_out.to(bias.dtype, copy=True)  # out of the staging
                        spec.module._parameters["bias"] = torch.nn.Parameter(value, requires_grad=bias.requires_grad)
                for block in range(len(store.blocks)):
                    store.mark_built(block, INT8)
                store.rows_behind = rows_behind  # the store waits for them before an INT8 buffer is used
                clock.mark("slab rows read" if rows_behind is None else ROWS_HANDED_OVER)
            finally:  # the memfds' descriptors (the mappings keep the pages), however the load ends
                if pages is not None:
                    pages.close()

    return load


def _process_pages(choice: str, node) -> ProcessPages | None:
    """Pages for a reader process (`Config.slab_reads`: `choice`), or None: reader threads in this process
    (`node`: the store's node store, or None)."""
    why_not = process_reads_possible() or ("the ranks of this node share the store (their reads go into the "
                                           "node's pages)" if node is not None else None)
    if choice == "threads" or (choice == "auto" and why_not):
        return None
    if why_not:
        raise ConfigError(f"slab_reads: 'process' can not be used here: {why_not}; 'threads' or 'auto' can")
    return ProcessPages()


def _bias_buffers(layers, checkpoint, reader: SlabReader, pages: ProcessPages | None) -> dict[int, torch.Tensor]:
    """id(spec) -> where a meta bias is read from the slab: its new tensor (reader threads), or float32 in pages
    the reader process maps (cast once the reads end). Not a bias the model's checkpoint holds (`load_resident`)."""
    specs = [spec for spec in layers if spec.module.bias is not None and spec.module.bias.is_meta
             and canonical_name(spec.fqn) in reader.layers and reader.layers[canonical_name(spec.fqn)].has_bias
             and (checkpoint is None or f"{spec.fqn}.bias" not in checkpoint)]
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


def _read_in_parallel(reader: SlabReader, blocks: Iterable[list], while_reading: Callable[[], None] | None = None,
                      rows: Callable[[int], bool] | None = None, clock: StageClock | None = None,
                      on_block_read: Callable[[int], None] | None = None) -> None:
    """Every layer's rows, scale and bias from the file into its buffer, on a few threads (`preadv` and the crc32
    release the GIL). `blocks` yields a block's reads as one list, submitted as it comes (the next block is laid
    out while the first are read). The first error (a SlabError naming the layer) is raised once the reads under
    way finish; the queued ones are cancelled and no block is laid out after it. `rows(block)` False: only the
    layer's bias (another rank of the node reads the rows). `on_block_read(block)` runs on the thread that read a
    block's last rows; `clock` hears when the last read ended."""
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


def _attach_disk_tier(store, reader: SlabReader, manifest: str) -> None:
    """Config(int8_tier="disk"): the INT8 rows stay in the file; only meta biases are read now."""
    from torch_stagehand.runtime.host.disk_tier import DiskTier

    names = {}
    for block, bb in enumerate(store.blocks):
        names[block] = [canonical_name(spec.fqn) for spec in bb.layers]
        for spec, name in zip(bb.layers, names[block]):
            bias = spec.module.bias
            if bias is not None and bias.is_meta and reader.layers[name].has_bias:
                value = reader.read_layer(name)[2].to(bias.dtype)
                spec.module._parameters["bias"] = torch.nn.Parameter(value, requires_grad=bias.requires_grad)
    tier_reader = SlabReader(manifest)  # its own: the tier reads on its worker thread for the Runtime's life
    try:
        store.attach_disk_tier(DiskTier(tier_reader, store, names), INT8)
    except BaseException:
        tier_reader.close()
        raise
    for block in range(len(store.blocks)):
        store.mark_built(block, INT8)


def _live_weights(layers, reader: SlabReader) -> list[tuple[str, torch.Tensor]]:
    """(canonical name, [out, in] full-precision weight) of the streamed layers the slab holds."""
    out = []
    for spec in layers:
        name, w = canonical_name(spec.fqn), spec.module.weight
        if name in reader.layers and not w.is_meta:
            out.append((name, w.detach().t() if spec.transposed else w.detach()))
    return out

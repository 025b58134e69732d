"""The front door: `offload`, `compile_blocks`, `explain`, `runtime_of`."""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys

import torch
import torch.nn as nn

from torch_stagehand.compiler import block_frames
from torch_stagehand.compiler.block_frames import RegionalCompileWarning  # noqa: F401 (re-exported)
from torch_stagehand.compiler.startup.preparation import compiler_preparation
from torch_stagehand.config import Config
from torch_stagehand.runtime.attention_guard import disable_unsafe_sdpa_backends
from torch_stagehand.runtime.blocks import find_blocks, streamed_layers
from torch_stagehand.runtime.experts.lora import adopt_expert_adapters, release_expert_adapters
from torch_stagehand.runtime.precision import FULL, validate_precision_map
from torch_stagehand.runtime.runtime import Runtime
from torch_stagehand.runtime.selective.controller import AUTO, selective_precision_requested
from torch_stagehand.runtime.streamed import is_streamed
from torch_stagehand.environment import env

log = logging.getLogger(__name__)


def offload(
    model: nn.Module,
    device: str | torch.device | None = None,
    blocks: str | list[str] = "auto",
    precision: str | dict = FULL,
    slab=None,
    config: Config | None = None,
    verbose: bool = True,
    vram_budget: int | str | None = None,
    keep_full: str | None = None,
    checkpoint=None,
) -> Runtime:
    """Stream the Linear weights of `model`'s blocks from host memory; keep the rest on `device`.

    precision: "bf16" (the weights as the model holds them), "int8", "fp8", or a map
    {block index or block FQN: precision}; blocks the map leaves out get "bf16".
    "auto" turns selective precision on (starting all bf16, `ambiguous_default` placing the
    blocks scored between the thresholds); so does a config whose selective_precision sets a
    mode, with `precision` as the starting map (a block scored between the thresholds keeps
    its starting precision, as the seed's ambiguous zone does). Otherwise the map stays
    exactly as given.
    slab: path to an INT8 slab (`{name}.manifest.json` or its directory + name)
    whose rows are read straight into the host store.
    vram_budget: device memory the plan may use, a string with its unit ("20GiB", "512MB"; a bare
    "20" is refused) or a number of bytes (at least 4 KiB: 20 is refused as a unit mistake); the
    runtime keeps as many blocks resident and recomputes as few as fit (`rt.plan`). On the CPU it
    bounds the device copy of the streamed weights. Same as `Config.conductor.vram_soft_cap_mb`.
    keep_full: where the full-precision master of a block that streams INT8 is
    kept: "pinned", "ram" (pageable), "file" (not in RAM: read from
    `checkpoint` when needed) or "auto" (default: `config.keep_full`).
    checkpoint: the model's safetensors (a file, an index json, or a
    transformers / diffusers folder). A model built on the meta device
    (`accelerate.init_empty_weights()`) is loaded from it tensor by tensor
    straight into the host store and the device, never whole in RAM.
    Before anything is allocated, the host copies are checked against the
    machine's memory: a `HostMemoryError` says what does not fit and what to change.
    verbose: print what offload did to stderr, once (block lists found and skipped, blocks per
    precision, bytes per step, host bytes, seconds per stage) and one line after the first step
    (what the first call's compile cost). The same summary is in `rt.stats()["offload"]`.
    """
    from torch_stagehand.runtime.telemetry.stage_clock import StageClock

    from torch_stagehand.offload_report import FirstCallProgress, report_offload, summarize

    clock = StageClock()
    if any(is_streamed(m) for m in model.modules()):
        raise RuntimeError("offload: this model is already offloaded (call restore() on its Runtime first)")
    config = (config or Config()).validate()
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("offload: device='cuda' but CUDA is not available")
    block_fqns = find_blocks(model, blocks)
    layers = streamed_layers(model, block_fqns)
    auto = isinstance(precision, str) and precision == AUTO
    if auto and not config.selective_precision.enabled:
        raise ValueError("offload: precision='auto' asks for selective precision, but "
                         "selective_precision.enabled is false in the config")
    precision_map = validate_precision_map(FULL if auto else precision, block_fqns, context="offload: precision map")
    clock.mark("find blocks")
    # While the slab's rows are read, or a worker thread fills the host store, this thread prepares the compiler.
    prepare_compiler = compiler_preparation(model, device)
    slab_loader = None
    if slab is not None:
        from torch_stagehand.runtime.slab.loading import slab_loader_for

        files_read = None
        if prepare_compiler is not None:  # its files read now, on threads: beside the slab's reads each would wait
            prepare_compiler.read_files_ahead()
            files_read = lambda: prepare_compiler.files_read().seconds  # noqa: E731
        slab_loader = slab_loader_for(slab, while_reading=prepare_compiler, before_reading=files_read)
    weights_file = None
    if checkpoint is not None:
        from torch_stagehand.runtime.host.weights_file import WeightsFile, pipeline_component

        checkpoint, note = pipeline_component(checkpoint, _class_names(model))
        if note is not None:
            _say(note, verbose)
        weights_file = WeightsFile(checkpoint)
    on_device = weights_off_host(layers)  # a model already on the GPU: its streamed weights move to the host store
    ahead = _ahead_workers(device, block_fqns, layers, precision_map, auto)
    clock.mark("sources indexed, files opened, workers started")
    try:
        rt = Runtime(model, device, block_fqns, layers, precision_map, config, slab_loader=slab_loader,
                     while_filling=None if slab_loader is not None else prepare_compiler, keep_full=keep_full,
                     checkpoint=weights_file, vram_budget=vram_budget, clock=clock)
    except BaseException:
        if ahead is not None:
            ahead.close()
        raise
    for part, seconds in (prepare_compiler.seconds.items() if prepare_compiler is not None else ()):
        clock.beside(part, seconds)  # the parts of the compiler's preparation, beside the host store's fill
    if ahead is not None:
        from torch_stagehand.compiler.variants import variant_cache

        variant_cache(rt).adopt_ahead(ahead)
    clock.mark("ahead workers adopted")
    if on_device is not None:
        _say(moved_to_host_line(*on_device, pinned=bool(rt.store.pin)), verbose)
    if selective_precision_requested(config.selective_precision, auto):
        try:
            rt.start_selective_precision(precision_map, start_given=not auto)
        except BaseException:
            rt.restore()
            raise
    undo_attention_guard = disable_unsafe_sdpa_backends(device)
    if undo_attention_guard is not None:
        rt.on_close(undo_attention_guard)
    rt.prepare_ddp(model)  # DistributedDataParallel(model) leaves the streamed weights alone (train/ddp.py)
    if adopt_expert_adapters(model):  # peft target_parameters on streamed experts read the stream
        rt.on_close(functools.partial(release_expert_adapters, model))
    clock.mark("policy, attention guard, DDP, adapters")
    summary = summarize(model, rt, clock)
    rt.offload_summary = summary.as_dict()
    log.info("%s", summary)
    report_offload(summary, auto=blocks == "auto", verbose=verbose)
    if verbose:
        FirstCallProgress(rt)  # says when the first call compiles, and what the first step cost
    block_frames.install(rt, model)  # each block its own Dynamo frame: one trace per block structure
    rt.collector.freeze_before_compile()  # last: what offload made is frozen too (collector.py)
    return rt


def weights_off_host(layers) -> tuple[int, str, torch.device] | None:
    """The streamed weights `layers` hold on an accelerator (a model moved to the GPU before offload): how many,
    the first one's name and its device; None when every one is in host memory or on the meta device."""
    off = [spec for spec in layers if spec.weight.device.type not in ("cpu", "meta")]
    return (len(off), off[0].weight_name, off[0].weight.device) if off else None


def moved_to_host_line(count: int, first: str, device: torch.device, pinned: bool) -> str:
    """What offload says once when the model's streamed weights were on `device`."""
    return (f"stagehand offload: {count} streamed weights were on {device} (first {first}): they now live in host "
            f"memory, the host store{' (page-locked where they stream)' if pinned else ''}, and stream from there; "
            f"restore() puts them back on {device}")


def _class_names(model: nn.Module) -> set[str]:
    """The class names `model` answers to: its own, a peft wrapper's base model's, a compiled module's original's
    (to find its subfolder in a diffusers pipeline folder)."""
    names, module = set(), model
    for _ in range(4):
        names.add(type(module).__name__)
        inner = getattr(module, "_orig_mod", None)
        if inner is None and callable(getattr(module, "get_base_model", None)):
            inner = module.get_base_model()
        if not isinstance(inner, nn.Module) or inner is module:
            break
        module = inner
    return names


def _say(line: str, verbose: bool) -> None:
    """One line of offload's: to the log, and to stderr unless verbose=False."""
    log.info("%s", line)
    if verbose:
        print(line, file=sys.stderr, flush=True)


def _ahead_workers(device: torch.device, block_fqns: list[str], layers, precision_map: dict, auto: bool):
    """The ahead-compile workers (two on CUDA unless `STAGEHAND_AHEAD_WORKERS` says otherwise), started now while
    the host store fills, or None."""
    from torch_stagehand.compiler.context import BackendOptions
    from torch_stagehand.compiler.variants import start_ahead_at_offload

    workers = BackendOptions().workers_ahead(device)
    if not workers:
        return None
    return start_ahead_at_offload(device, block_fqns, layers, workers,
                                  _w8a16_ahead(device, layers, precision_map, auto))


def _w8a16_ahead(device: torch.device, layers, precision_map: dict, auto: bool):
    """Where blocks may stream INT8 on CUDA, what the ahead-compile workers compile of the W8A16 kernels
    (compiler/startup/ahead.py's `w8a16`): the device, the activation dtype, and the INT8 Linears' shapes whose
    tuning candidates they compile (none under precision="auto", which starts in bf16). None elsewhere."""
    from torch_stagehand import kernels

    if device.type != "cuda" or not kernels.HAS_TRITON or not (auto or "int8" in precision_map.values()):
        return None  # (without Triton the W8A16 calls take the reference twin: nothing to compile)
    from torch_stagehand.kernels.tuning.ahead import tuning_shapes

    # The activations' dtype is the streamed Linears' (a LoRA adapter or a norm kept in fp32 is not).
    dtype = next((lay.module.weight.dtype for lay in layers if not getattr(lay, "experts", 0)), None)
    if dtype is None:
        return None
    ahead_tuning = not auto and env("STAGEHAND_AHEAD_TUNING")
    return {"device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "shapes": tuning_shapes(layers, precision_map) if ahead_tuning else []}


def runtime_of(model: nn.Module) -> Runtime:
    from torch_stagehand.runtime import registry

    for module in model.modules():
        if is_streamed(module):
            return registry.layer(module._sh_layer)[0]
    raise RuntimeError(f"{type(model).__name__} is not offloaded: call torch_stagehand.offload(model) first")


def compile_blocks(model: nn.Module, **compile_kwargs) -> nn.Module:
    """Compile each block of an offloaded model on its own, in place, and run the code around the blocks
    (embeddings, the head, the loss) eagerly; returns the model. `torch.compile(model, backend="stagehand")`
    compiles the blocks the same way (one trace per block structure) and compiles the code around them too.

    `compile_kwargs` go to `torch.compile` (`backend="stagehand"` unless given). A model's own activation
    checkpointing (HF's or diffusers' `gradient_checkpointing`) is switched off and done by the block units
    instead, so no block runs its forward three times.
    """
    from torch_stagehand.compiler.block_frames import frames_of

    compile_kwargs.setdefault("backend", "stagehand")
    frames_of(runtime_of(model)).compile_each(**compile_kwargs)
    return model


def explain(model: nn.Module, *args, **kwargs):
    """Compile and run `model(*args, **kwargs)` once; report what the backend did.

    Uses the inner compiler "eager" so the graphs are readable ATen. With grad enabled the report includes the
    backward graphs and backward schedule (compiled with the forward; no backward is run, so the backward rows
    are predicted and say so). Runs one forward, which streams the blocks like any other call; the forward rows
    are the slot pool's trace of that call. The call compiles through a backend callable made for this call
    alone: Dynamo guards each cache entry on the backend that made it, so explain never hits, evicts or resets
    the entries of the model being trained.
    """
    from torch._dynamo.utils import counters

    from torch_stagehand.compiler import stagehand_backend
    from torch_stagehand.compiler.units import BlockUnit
    from torch_stagehand.compiler.variants import variant_cache
    from torch_stagehand.runtime.conductor.predict import predict_backward
    from torch_stagehand.runtime.conductor.trace import WAIT, recording

    from torch_stagehand.report import Report, rows_from_trace

    rt = runtime_of(model)
    breaks_before = dict(counters["graph_break"])
    first_record = len(rt.graph_records)
    compiled = torch.compile(model, backend=lambda gm, inputs: stagehand_backend(gm, inputs, {"inner": "eager"}))
    with recording(rt.pool) as trace:
        compiled(*args, **kwargs)
    if len(rt.graph_records) == first_record:  # e.g. Dynamo's recompile limit for this code was reached
        raise RuntimeError("explain(): Dynamo compiled no graph for this call (its recompile limit for the "
                           "model's forward may be reached: torch._dynamo.config.recompile_limit), so there is "
                           "nothing to report; the model's compiled code was left as it was")
    records = rt.graph_records[first_record:]
    graph_breaks = [
        f"{reason} (x{count - breaks_before.get(reason, 0)})"
        for reason, count in counters["graph_break"].items()
        if count > breaks_before.get(reason, 0)
    ]
    graphs: dict[str, str] = {}
    segments: list[dict] = []
    passes: list[dict] = []
    with_backward = False
    variant_info = variant_cache(rt).info
    for i, record in enumerate(records):
        prefix = "" if len(records) == 1 else f"graph{i}."
        graphs[prefix + "forward"] = record.outer.print_readable(print_output=False)
        passes += [dict(dataclasses.asdict(r), graph=i, unit="") for r in record.passes]
        for name, unit in record.outer.named_children():
            # A block unit runs every block of its structure: each variant (precision, grad mode) its calls ran.
            ran = unit.variants_ran.items() if isinstance(unit, BlockUnit) else [(unit.last_key, None)]
            for key, precision in ran:
                info = variant_info.get(key)
                if info is None:
                    continue
                if isinstance(unit, BlockUnit):
                    label = f"block_variant[{key[0]}, {precision}]"
                    graphs.setdefault(label + ".scheduled", info["scheduled"])
                else:
                    label = prefix + name
                if not any(p["unit"] == label for p in passes):  # a shared variant's passes are listed once
                    passes += [dict(p, graph=i, unit=label) for p in info.get("passes", [])]
                for kind, code in info["graphs"].items():
                    graphs.setdefault(f"{label}.{kind}", code)
                    with_backward |= kind == "backward" and isinstance(unit, BlockUnit)
        for seg in record.segments:
            sources = sorted(u for u, _ in record.dag.in_edges(seg.index))
            segments.append({"graph": i, "segment": seg.index, "kind": seg.kind,
                             "block": "" if seg.block is None else f"{seg.block} {rt.blocks[seg.block]}",
                             "ops": len(seg.nodes), "streamed": record.dag.nodes[seg.index]["streamed"],
                             "inputs_from": ", ".join(map(str, sources)) or "inputs"})
    schedule = rows_from_trace(trace.rows)
    if with_backward:
        forward_blocks = [r.block for r in trace.rows if r.action == WAIT and r.phase == "forward"]
        predicted = predict_backward(rt.pool, forward_blocks, rt.precision, len(rt.blocks))
        schedule += rows_from_trace(predicted, predicted=True, start=len(schedule))
    return Report(blocks=list(rt.blocks), graphs=graphs, schedule=schedule, graph_breaks=graph_breaks,
                  graph_count=max(1, len(records)), stats=rt.stats(), segments=segments, passes=passes,
                  offload=dict(rt.offload_summary), plan=rt.plan, expert_bytes=expert_bytes_per_block(rt))


def expert_bytes_per_block(rt) -> dict[int, int]:
    """The bytes of each block's expert stacks in the precision it streams (blocks with none left out)."""
    from torch_stagehand.runtime import precision as precisions

    out: dict[int, int] = {}
    for spec in rt.layers:
        if spec.experts:
            out[spec.block] = out.get(spec.block, 0) + sum(precisions.get(rt.precision[spec.block]).layer_nbytes(spec))
    return out

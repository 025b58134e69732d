"""The Runtime: what `offload()` returns and what the ops call into.

It builds the engine's parts in order and holds them, and implements the compiler's `StreamingRuntime`
protocol (compiler/interface.py); the compiled variants live in the compiler's own cache.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import torch
import torch.nn as nn

from torch_stagehand.runtime.collector import CollectorFreeze
from torch_stagehand.runtime.config import Config
from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime import registry
from torch_stagehand.runtime.blocks import StreamedLayerSpec, layer_slots
from torch_stagehand.runtime.conductor.cost_cache import KeptCostModel, job_key
from torch_stagehand.runtime.conductor.fetch_order import FetchOrder
from torch_stagehand.runtime.conductor.costs import CostModel, budget_from
from torch_stagehand.runtime.conductor.phases import PhaseTracker
from torch_stagehand.runtime.conductor.telemetry import TelemetryWriter
from torch_stagehand.runtime.eager_path import EagerFallbackWarning, EagerPath  # noqa: F401 (the warning's home)
from torch_stagehand.runtime.experts.cache import ExpertCache
from torch_stagehand.runtime.experts.stacks import attach_streamed
from torch_stagehand.runtime.telemetry.events import RuntimeEvents, progress, unwrap_optimizer
from torch_stagehand.runtime.train.grads import GradLane
from torch_stagehand.runtime.train.ddp import check_not_sharded, ignore_streamed
from torch_stagehand.runtime.device.allocator import use_expandable_segments
from torch_stagehand.runtime.host import node_store
from torch_stagehand.runtime.train.shards import GradShards
from torch_stagehand.runtime.host.setup import fill_masters, load_resident, make_host_store, missing_stack
from torch_stagehand.runtime.host.store import KEEP_FILE
from torch_stagehand.runtime.host.plan import check_master_dtypes
from torch_stagehand.runtime.host.undo import OffloadUndo
from torch_stagehand.runtime.conductor.oom_recovery import OomRecovery
from torch_stagehand.runtime.precision import PrecisionMapError
from torch_stagehand.runtime.conductor.driver import PlanDriver
from torch_stagehand.runtime.telemetry.stats import planner_step_record, runtime_stats
from torch_stagehand.runtime.telemetry.stage_clock import StageClock
from torch_stagehand.runtime.selective.runtime_api import SelectivePrecisionAPI
from torch_stagehand.runtime.streamed import guard_conversions, make_plain, unguard


class Runtime(SelectivePrecisionAPI):
    def __init__(self, model: nn.Module, device: torch.device, block_fqns: list[str], layers: list[StreamedLayerSpec],
                 precision: dict[int, str], config: Config, slab_loader=None,
                 while_filling: Callable[[], None] | None = None,  # beside the masters' copies
                 vram_budget: int | str | None = None, cost_model: CostModel | None = None,
                 keep_full: str | None = None,
                 checkpoint=None,  # a WeightsFile (a meta model loads from it)
                 clock: StageClock | None = None):  # offload's stages, for its report
        check_master_dtypes(layers)
        budget = budget_from(config, vram_budget)  # a budget that cannot be read fails before the model is touched
        self.model = model
        self.device = torch.device(device)
        self.blocks = list(block_fqns)
        self.layers = layers
        self.config = config
        self._closed = self._restored = False
        self._hooks: list[Any] = []
        self._attached: list[torch.optim.Optimizer] = []  # optimizers whose steps end a step (attach)
        self._conversion_guards: list[nn.Module] = []
        self._on_close: list[Callable[[], None]] = []
        self.checkpoint, self._keep_full = checkpoint, keep_full if keep_full is not None else config.keep_full
        self.telemetry = TelemetryWriter(config.telemetry_path)
        self._block_first_layer: dict[int, int] = {}
        for index, spec in enumerate(layers):
            self._block_first_layer.setdefault(spec.block, index)
        self._undo = OffloadUndo(model, layers)
        self.id = registry.register_runtime(self)
        self.node = self.shards = None
        self.plan_driver: PlanDriver | None = None  # made in _offload; it owns the slot pool
        self.clock = clock or StageClock()
        self.fetch_order = FetchOrder(len(self.blocks))
        try:
            self._offload(precision, slab_loader, budget, cost_model, while_filling)
        except BaseException as e:
            self._abandon(e)  # offload is a transaction: the model is left exactly as it was
            raise

        self.phases = PhaseTracker(on_step_end=self._record_step)
        self.phases.listeners.append(lambda old, new: self.plan_driver.on_phase(new, self.phases.step))
        self.graph_records: list[Any] = []  # what the backend did to each Dynamo graph (record_graph)
        reads = dict(first_layer=self._block_first_layer, precision=lambda: self._precision, device=self.device)
        cache = ExpertCache(model, layers, self.store, self.plan_driver, self.pool,
                            capacity_bytes=config.expert_cache_bytes, **reads)
        self.eager = EagerPath(layers, self.store, self.pool, self.plan_driver, self.fetch_order, self.phases, cache,
                               layer_slots=layer_slots(model, layers),  # adapters wrapped around a layer after offload
                               block_names=self.blocks, forward_ran=self.grads.forward_ran, check_open=self._check_open,
                               graph_records=self.graph_records, max_routed_tokens=config.routed_experts_max_tokens,
                               **reads)
        self.on_close(self.eager.release)
        self.oom = OomRecovery(self.device, self.blocks, self.phases, self.plan_driver, self.abort_held_blocks,
                               self._attached, allocator=getattr(self, "allocator", ""))
        self.recover_from_oom = self.oom.recover  # (the StreamingRuntime protocol's name for it)
        self.collector = CollectorFreeze(self.config.freeze_gc_after_compile, self.phases, lambda: self.compile_count)
        if self.config.freeze_gc_after_compile:
            self._hooks.append(self.collector)  # close() calls remove(): it unfreezes
        self._step_base = self._counters()
        self.compile_seconds, self.compile_count = 0.0, 0  # every compiled unit (block variants and glue)
        self.units_first_run = 0  # compiled units that have run once (record_first_run)
        self.units_loaded = 0  # of those, loaded from the compile caches (a warm start), not compiled
        self.block_variant_count = self.recomputed_blocks = 0
        self.offload_summary: dict[str, Any] = {}  # what offload() reported (the front door fills it)
        self.events = RuntimeEvents()  # step ends and compiles, for the front door's reports

    def _offload(self, precision: dict[int, str], slab_loader, budget, cost_model, while_filling=None) -> None:
        """Every step of offload that changes the model or allocates; any of them may raise."""
        model, layers = self.model, self.layers
        # Before the first device allocation: the slots and resident blocks then live in expandable segments.
        self.allocator = use_expandable_segments(self.device) if self.config.expandable_segments else "left as it is"
        self.node = node_store.join(self.config, self.device)  # a collective of every rank: before any allocation
        # Its process group now, while every rank is here (a rank that fails later meets the others only at the
        # node's exchanges, which tell them).
        self.shards = GradShards.create(layers, self.node, self.device)
        if self.node is not None:
            self._undo.defer_releases()  # the weights of blocks other ranks write stay until they are written (seal)
        self.store, _ = make_host_store(layers, len(self.blocks), precision, self.config, self.device, self._keep_full,
                                        self.checkpoint, slab_loader is not None, node=self.node)
        self.store.on_replaced = self._undo.replaced
        self.clock.mark("host store planned")
        meta_blocks = fill_masters(self.store, self.checkpoint, progress, while_filling, self.clock)
        self.clock.mark("masters " + ("mapped from the checkpoint" if self.store.keep_full == KEEP_FILE
                                      else "to the host store"))
        if slab_loader is not None:  # it reserves the INT8 copies' host allocation (none for the disk tier)
            slab_loader(model, layers, self.store, self.checkpoint, self.config, self.clock,
                        pin=[b for b, p in precision.items() if p == precisions.INT8])
        elif meta_blocks:
            raise RuntimeError(f"offload: block {self.blocks[meta_blocks[0]]} has weights on the meta device and no "
                               "slab was given (nor a checkpoint= holding them)"
                               + missing_stack(self.store, self.checkpoint, meta_blocks[0]))
        self.grads = GradLane(layers, self.store, self.device, self._block_first_layer)
        self.grads.shards = self.shards  # several ranks: a block's gradients go to its owner alone
        if self.shards is not None:
            self.on_close(self.shards.close)
        self.trainable_positions = self.grads.trainable_positions
        self.block_tokens = [registry.make_token(self.id, b) for b in range(len(self.blocks))]
        self.no_block_token = registry.make_token(self.id, registry.NO_BLOCK)
        for index, spec in enumerate(layers):
            attach_streamed(spec, registry.new_layer_id(self.id, index), self.grads.anchors[spec.block],
                            functools.partial(self.grads.sync_anchor, spec.block), self.block_tokens[spec.block],
                            index - self._block_first_layer[spec.block], self.device, self.id)
            self._hooks.append(spec.module.register_load_state_dict_post_hook(self._after_load_state_dict))
        self._conversion_guards = guard_conversions(model, [spec.fqn for spec in layers])
        self.clock.mark("streamed layers attached")
        if self.checkpoint is not None:  # a model built on the meta device: its resident tensors, one by one
            load_resident(model, self.checkpoint, self.device, {s.weight_name for s in layers}, progress)
        model.to(self.device)  # everything but the streamed weights becomes resident
        self.grads.sync_all()
        self.clock.mark("resident tensors to the device")

        self._precision: dict[int, str] = {}
        self.plan_driver = PlanDriver(
            self.device, len(self.blocks), self.config, self.store, self.grads, self.fetch_order,
            precision=lambda: self._precision, step=lambda: self.phases.step if hasattr(self, "phases") else None,
            compiled_units=lambda: self.compile_count + self.units_first_run,
            kept=KeptCostModel(self._job_key, len(self.blocks)), budget=budget, cost_model=cost_model)
        self.set_precision(precision)
        self.clock.mark("precision copies built, host store pinned")
        if self.node is not None:  # every block's owner has filled its pages
            self.node.seal(self.device, self.store.pin, keep_group=self.grads.shards is not None)
            self._undo.release_deferred()
        self.plan_driver.make_pool()
        # Token outputs are allocated once: a prefetch / evict returns its block's.
        self._fetch_tokens, self._free_tokens = ([torch.zeros((), dtype=torch.int64) for _ in self.blocks]
                                                 for _ in range(2))
        self.store.offloaded = True  # from here a refused page-lock leaves the buffer pageable, and says so
        self.clock.mark("device slots")

    def _job_key(self) -> dict:
        """What this runtime's cost model is a model of, as it is now (the cost cache's key, but the inputs)."""
        return job_key(self.device, self.blocks, self.layers, self._precision, self.grads.grad_bytes(), self.store.node)

    def _abandon(self, error: BaseException) -> None:
        """Undo a failed offload: plain layers and weights back, no hooks, nothing registered, nothing held
        (and the other ranks of a shared node store told why)."""
        if self.node is not None:
            self.node.abort(error)
        if self.shards is not None:
            self.shards.close()  # its process group (on_close callbacks do not run for an offload that failed)
        self._remove_hooks()
        unguard(self._conversion_guards)
        registry.unregister_runtime(self.id)
        self._undo.undo()
        self.telemetry.close()
        getattr(self, "store", None) is not None and self.store.free()
        self.store = self.checkpoint = None  # the pinned store and slots are freed with the exception
        if self.plan_driver is not None:
            self.plan_driver.pool = None
        self._closed = True

    # ---- public API -----------------------------------------------------------------

    @property
    def pool(self):
        """The device slots (`SlotPool`), owned by the plan driver, which sizes them; None before and after."""
        return None if self.plan_driver is None else self.plan_driver.pool

    @property
    def precision(self) -> dict[int, str]:
        return dict(self._precision)

    def set_precision(self, precision: str | dict[int, str]) -> None:
        """Set the precision of every block (a registered name: "bf16", "int8") or of the blocks a map names.
        The next call runs the new map; compiled variants are re-linked, new ones compiled once. Derived copies
        (INT8) missing from the host store are built now, off the hot path."""
        self._check_open()
        new = precisions.validate_precision_map(precision, self.blocks, base=self._precision)
        for block, value in new.items():
            if not self.store.can_stream(block, value):
                raise PrecisionMapError(f"precision map: block {block} ({self.blocks[block]}) has no full-precision "
                                        f"weights to stream {value} from (it was loaded from an INT8 slab only)")
        self._check_precision_devices(new)  # fp8 needs FP8 tensor cores unless emulation was asked for
        self.store.build_missing(new, progress)
        self._precision = new
        self.store.set_pins(new)  # what streams is locked, what no longer does is not
        if self.pool is not None:
            self.plan_driver.apply("precision map changed")

    @property
    def plan(self):
        """The per-block decisions the runtime runs (conductor/planner.py; `print(rt.plan)` shows the table)."""
        return self.plan_driver.plan

    def replan(self, cost_model: CostModel | None = None, vram_budget: int | str | None = None):
        """Plan again now, between steps: under a new `vram_budget` if given ("12GiB"); `cost_model`
        replaces the measured one (tests inject constants)."""
        self._check_open()
        return self.plan_driver.replan(cost_model, vram_budget)

    def stats(self) -> dict[str, Any]:
        """Counters since offload: transfers, slots, host memory, compiles, the plan (telemetry/stats.py)."""
        return runtime_stats(self)

    def start_selective_precision(self, precision_map: dict[int, str], start_given: bool) -> None:
        """Turn the policy on (offload does, when asked): a controller from here on, closed with the runtime."""
        from torch_stagehand.runtime.selective.controller import SelectivePrecision

        self.selective = SelectivePrecision(precision_map, start_given, config=self.config, model=self.model,
                                            device=self.device, blocks=self.blocks, layers=self.layers,
                                            store=self.store, pool=self.pool, precision=lambda: self._precision,
                                            set_precision=self.set_precision)
        self.on_close(self.selective.close)

    def attach(self, optimizer: torch.optim.Optimizer):
        """Phases from the optimizer: OPTIMIZER before its step, STEP_END after (a wrapper: its inner one; once)."""
        self._check_open()
        optimizer = unwrap_optimizer(optimizer)
        if any(o is optimizer for o in self._attached):
            return self
        self._attached.append(optimizer)
        pre = optimizer.register_step_pre_hook(lambda *_: self.phases.optimizer_begin())
        post = optimizer.register_step_post_hook(lambda *_: self._optimizer_stepped())
        self.grads.step_syncs = True  # several ranks: they sync at this step (train/shards.py), not at a later fetch
        self._hooks += [pre, post]
        self._hooks += self._selective_hooks(optimizer)  # selective precision runs before the step
        return self

    def _optimizer_stepped(self) -> None:
        self.grads.optimizer_stepped()  # several ranks: every owner's update is in the store before anyone reads
        self.phases.end_step()

    def streamed_parameters(self) -> set[nn.Parameter]:
        """The streamed weights: what FSDP2's `fully_shard(..., ignored_params=...)` must leave alone (train/ddp.py)."""
        return {spec.weight for spec in self.layers}

    def prepare_ddp(self, module: nn.Module) -> nn.Module:
        """Call before `DistributedDataParallel(module)` when `module` wraps the offloaded model under other
        names (a peft model made after offload): DDP then leaves the streamed weights alone (train/ddp.py)."""
        self.on_close(ignore_streamed(module, self.layers))
        return module

    def restore(self) -> nn.Module:
        """Put the model back: plain modules, weights as tensors on their original devices, bit-exact.
        Idempotent. Every hook and reference to the host store and slots is dropped, so they are freed with this
        Runtime."""
        if self._restored:
            return self.model
        self._check_open()
        int8_only = [self.blocks[b] for b, bb in enumerate(self.store.blocks) if not bb.has_master]
        if int8_only:
            raise RuntimeError(f"restore: block {int8_only[0]} was loaded from an INT8 slab only; "
                               "its full-precision weights were never in memory")
        with torch.no_grad():
            for spec in self.layers:
                make_plain(spec.module)
                self._undo.plain_weight(spec, restoring=True)
            self._undo.move_back(restoring=True)
        unguard(self._conversion_guards)
        self.close()
        self._restored = True
        return self.model

    def close(self) -> None:
        if self._closed:
            return
        self._remove_hooks()
        self.phases.end_step()
        self.telemetry.close()
        self.store.free()  # unlock the pinned ranges; the memory goes when the last view does
        registry.unregister_runtime(self.id)
        for callback in self._on_close:
            callback()  # e.g. the compiler drops its compiled variants
        self._on_close.clear()
        self._closed = True

    # ---- called by the compiler (the StreamingRuntime protocol) -------------------------

    def layer_at(self, block: int, position: int) -> int:
        return self._block_first_layer[block] + position

    def abort_held_blocks(self) -> None:
        """A compiled unit raised before its evict ran: release every slot it held."""
        self.pool.release_all()

    def record_compile(self, seconds: float, block_variant: bool, loaded: bool = False) -> None:
        self.compile_seconds, self.compile_count, self.units_loaded = (
            self.compile_seconds + seconds, self.compile_count + 1, self.units_loaded + loaded)
        self.block_variant_count += block_variant
        self.events.compiled("block variant" if block_variant else "unit", seconds, loaded)

    def model_call_began(self) -> None:
        """The offloaded model's forward was entered: a step's forward phase starts here, before its first block
        traces or compiles (the first step's time then is the whole first call)."""
        self.phases.forward_op()

    def record_first_run(self) -> None:
        """Count a compiled unit's first run (`units_first_run`: a calibration step that holds one is measured
        again, conductor/driver.py)."""
        self.units_first_run += 1

    def record_graph(self, record: Any) -> None:
        check_not_sharded(self.layers)  # before a graph runs: no streamed weight in FSDP's hands
        self.graph_records.append(record)
        self.plan_driver.on_graph(getattr(record, "input_shapes", []))  # the first graph's inputs key the kept cost model
        self.events.compiled("graph", 0.0)

    def on_close(self, callback: Callable[[], None]) -> None:
        self._on_close.append(callback)

    # ---- called by the ops -------------------------------------------------------------

    # Each schedule op reports its host time to the planner (calibration).
    def op_prefetch(self, block: int) -> torch.Tensor:
        t0 = time.perf_counter()
        self.plan_driver.prefetch(block)
        self.plan_driver.schedule_op_took(t0)
        return self._fetch_tokens[block]

    def op_wait(self, block: int, precision_code: int, nbytes: int, backward: bool) -> torch.Tensor:
        # A forward `wait` inside a backward is a block recompute: it belongs to the backward phase.
        kind = "backward" if backward else "recompute" if torch._C._current_graph_task_id() != -1 else "forward"
        t0 = time.perf_counter()
        self.phases.forward_op(block) if kind == "forward" else self.phases.backward_op()
        if kind == "forward":
            self.grads.forward_ran()
        precision = precisions.by_code(precision_code).name
        slot = self.pool.acquire(block, precision)
        self.plan_driver.on_wait(block, kind)  # after the stream waited for the copy: calibration times compute
        self.plan_driver.schedule_op_took(t0)
        if slot.numel() != nbytes:
            raise RuntimeError(
                f"stagehand: block {block} ({self.blocks[block]}, {precision}) holds {slot.numel()} bytes but the "
                f"compiled graph expects {nbytes}: the block's layout changed after compilation")
        return slot

    def op_release(self, block: int, precision_code: int) -> torch.Tensor:
        t0 = time.perf_counter()
        self.pool.release(block, precisions.by_code(precision_code).name)
        self.plan_driver.on_release(block)
        self.plan_driver.schedule_op_took(t0)
        return self._free_tokens[block]

    def eager_linear(self, index: int, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.eager.linear(index, x, bias)

    def eager_grad_input(self, index: int, dy: torch.Tensor) -> torch.Tensor:
        return self.eager.grad_input(index, dy)

    def planned_recompute(self, block: int) -> bool | None:
        """The plan's activation decision for a block (None: the model's own checkpointing decides)."""
        return self.plan_driver.recompute_of(block)

    def spill_hooks(self, block: int):
        return self.plan_driver.spill_hooks(block)

    def record_recompute(self, block: int) -> None:  # a block re-ran its forward in backward, compiled
        self.recomputed_blocks += 1

    # ---- helpers ---------------------------------------------------------------------

    def layer_layout(self, index: int, precision: str) -> list[int]:
        spec = self.layers[index]
        return self.store.layout(spec.block, precision)[index - self._block_first_layer[spec.block]].as_ints()

    def block_nbytes(self, block: int, precision: str) -> int:
        return self.store.nbytes(block, precision)

    def _after_load_state_dict(self, module, incompatible_keys) -> None:
        # load_state_dict wrote the host master in place: drop stale device copies (INT8 copies notice themselves).
        self.pool.invalidate(self.layers[registry.layer(module._sh_layer)[1]].block)

    def _counters(self) -> dict[str, int]:
        return {k: getattr(self.pool.stats, k) for k in ("h2d_bytes", "fetches", "prefetches", "sync_fetches", "hits")}

    def _record_step(self, step: int, durations: dict[str, float]) -> None:
        if self.grads.host:  # full fine-tuning: resident blocks the optimizer stepped are copied in ahead
            self.pool.refresh_resident()
        now = self._counters()
        record: dict[str, Any] = {"step_id": step, "phase_durations": {k: round(v, 6) for k, v in durations.items()},
                                  **{k: now[k] - self._step_base[k] for k in now},
                                  "peak_streamed_bytes": self.pool.stats.peak_resident_bytes,
                                  "denials": dict(self.pool.stats.denials),
                                  "precision": {str(b): p for b, p in self._precision.items()}}
        if self.device.type == "cuda":
            record["vram_allocated_mb"] = round(torch.cuda.memory_allocated(self.device) / 2**20, 1)
            record["vram_peak_mb"] = round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1)
        self._step_base = now
        record = dict(record, **planner_step_record(self.plan_driver))
        self.telemetry.write(record)
        self.plan_driver.on_step_end(step)
        self.events.step(record)

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("stagehand: this Runtime was closed (restore() or close() was called); "
                               "offload the model again to stream it")

"""`Runtime.stats()`: one dict of what the runtime did since offload (the benches and tests read it)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from torch_stagehand import kernels
from torch_stagehand.runtime.device.slots import SlotPool
from torch_stagehand.runtime.host.plan import host_report


def runtime_stats(rt: Any) -> dict[str, Any]:
    """`rt`: the Runtime (not imported: runtime.py imports this module)."""
    s, spill = rt.pool.stats, rt.plan_driver.spill
    return {
        "blocks": len(rt.blocks),
        "streamed_layers": len(rt.layers),
        "slots": len(rt.pool.slots),
        "slot_bytes": rt.pool.slot_bytes,
        "h2d_bytes": s.h2d_bytes,
        "d2h_bytes": 0,  # the host copy is the master: nothing is ever copied back
        "fetches": s.fetches,
        "prefetches": s.prefetches,
        "sync_fetches": s.sync_fetches,
        "hits": s.hits,
        "stale_slots": s.stale_slots,  # slot copies dropped because their block's weights were written
        "requantized_blocks": rt.store.requantized_blocks,  # derived (INT8) copies rebuilt for the same reason
        "denials": dict(s.denials),
        "streamed_bytes_resident": s.resident_bytes,
        "peak_streamed_bytes": s.peak_resident_bytes,
        "host_bytes": rt.store.host_bytes(),
        "host": host_report(rt.store),  # pinned bytes asked for / locked, bytes per copy kind, keep_full
        "compiled_variants": rt.block_variant_count,
        "compiled_units": rt.compile_count,
        # each Dynamo graph the backend got, as its units' kinds ("block": one block; "glue+block+...": a graph
        # holding the code around blocks too)
        "compiled_graphs": ["+".join(s.kind for s in r.segments) for r in rt.graph_records],
        "units_first_run": rt.units_first_run,
        "units_loaded": rt.units_loaded,  # of those, loaded from the compile caches (compiler/startup/compile_cache.py)
        "units_compiled_cold": rt.compile_count - rt.units_loaded,
        "compile_seconds": round(rt.compile_seconds, 3),
        "autotune_seconds": round(kernels.tuning_seconds(), 3),  # process-wide (W8A16 tuning)
        "steps": rt.phases.step,
        "precision_counts": dict(Counter(rt.precision.values())),
        "eager_linear_calls": rt.eager.linear_calls,
        "eager_blocks": [rt.blocks[b] for b in sorted(rt.eager.blocks_taken)],
        # generation's routed reads (eager_path.py): stacks read routed or whole, and the expert cache
        "routed_reads": {"direct_reads": rt.eager.direct_reads, "whole_stacks": rt.eager.whole_stacks,
                         "expert_cache": rt.eager.cache.stats()},
        "recomputed_blocks": rt.recomputed_blocks,  # block recomputes run (a count over all steps)
        **_plan_stats(rt.plan_driver.plan, rt.pool),
        **({} if spill is None else {"d2h_bytes": spill.d2h_bytes, "restored_bytes": spill.h2d_bytes,
                                     "restored_ahead_bytes": spill.restored_ahead_bytes,
                                     "spilled_tensors": spill.spilled_tensors}),
        "plan_corrections": rt.plan_driver.shrinks + rt.plan_driver.peak_corrections,  # budgets shrunk, peaks learned
        "plan_reservations": list(rt.plan_driver.reservations),  # memory held ahead for a made plan's peak, and its s
        "calibration_remeasured": list(rt.plan_driver.remeasured),  # steps with one-time unit work: measured again
        "host_refinements": rt.plan_driver.host_refinements,  # host issue times later plans' steps lowered
        "compute_refinements": rt.plan_driver.compute_refinements,  # GPU times per block they lowered
        "oom_recoveries": list(rt.oom.records),  # an OOM in a step: where, budgets, plan (conductor/oom_recovery.py)
        "gc_freezes": list(rt.collector.freezes),  # after compiling: objects frozen, ms (collector.py)
        "allocator": rt.allocator,  # what offload did to the CUDA allocator (device/allocator.py)
        "cost_model_cache": rt.plan_driver.kept.note,  # a calibrated cost model loaded from an earlier run, or why not
        "offload": rt.offload_summary,
        # a slab's rows read behind offload (read_process.RowsBehind): their seconds, the fetches' wait for them
        "slab_rows_behind": None if rt.store.rows_behind is None else rt.store.rows_behind.summary(),
    }


def _plan_stats(plan: Any, pool: SlotPool | None) -> dict:
    if plan is None:
        return {}
    counts = plan.counts()
    return {"plan": plan.kind, "resident_blocks": counts["resident_blocks"], "spilled_blocks": counts["spilled_blocks"],
            "planned_recompute_blocks": counts["recomputed_blocks"], "lookahead": plan.lookahead,
            "predicted_step_ms": round(plan.predicted_step_s * 1e3, 3),
            # the weight bytes the plan must copy up a step (each streamed block's fetches, the slots' reuse counted)
            "planned_h2d_bytes": plan.h2d_bytes_per_step(),
            "cost_model": plan.cost_model,  # what predicted_step_ms rests on: "default", "measured" or "given"
            "predicted_peak_bytes": plan.predicted_peak_bytes, "measured_peak_bytes": plan.measured_peak_bytes,
            "streamed_device_bytes": None if pool is None else pool.device_bytes()}


def planner_step_record(planner: Any) -> dict:
    """The plan's and the conductor's part of a telemetry line (`planner`: runtime/conductor/driver.py's PlanDriver)."""
    record = {"plan": planner.plan.counts() if planner.plan is not None else {}}
    if planner.conductor.enabled:
        record.update(planner.conductor.snapshot())
    if planner.device.type == "cuda":
        record["peak_reserved_mb"] = round(torch.cuda.max_memory_reserved(planner.device) / 2**20, 1)
    return record

"""The conductor: fetch order (per graph and learned from eager calls) and the schedule trace explain prints."""

from __future__ import annotations

import torch

import torch_stagehand as stagehand
from torch_stagehand.config import Config, ConductorConfig
from torch_stagehand.runtime.conductor import FetchOrder, Lookahead, ScheduleTrace, recording
from torch_stagehand.runtime.conductor.trace import WAIT
from torch_stagehand.runtime.conductor import trace as tr
from torch_stagehand.runtime.registry import NO_BLOCK

from _helpers import ToyModel, assert_exact, toy

# ---- fetch order: the pure rule ------------------------------------------------------------


def test_graph_order_1_0_2_fetches_in_that_order():
    got = FetchOrder.for_graph([1, 0, 2], n_blocks=3)
    assert [la.block for la in got] == [1, 0, 2]
    assert [la.next_fwd for la in got] == [0, 2, NO_BLOCK]
    assert [la.next_bwd for la in got] == [NO_BLOCK, 1, 0]
    assert all(la.depth == 1 for la in got)


def test_graph_ends_fetch_the_registration_neighbour_across_a_graph_break():
    # Blocks 0-1 in one graph, 2-3 in the next: each graph's end fetches into the other one.
    first, second = FetchOrder.for_graph([0, 1], 4), FetchOrder.for_graph([2, 3], 4)
    assert first == [Lookahead(0, 1, NO_BLOCK), Lookahead(1, 2, 0)]
    assert second == [Lookahead(2, 3, 1), Lookahead(3, NO_BLOCK, 2)]
    # A block split over two units appears twice; the neighbour rule still skips blocks of this order.
    split = FetchOrder.for_graph([0, 1, 1, 2], 3)
    assert [la.next_fwd for la in split] == [1, 1, 2, NO_BLOCK]
    assert [la.next_bwd for la in split] == [NO_BLOCK, 0, 1, 1]


def test_eager_order_is_learned_from_the_calls():
    order = FetchOrder(3)
    # Nothing recorded yet: registration order.
    assert [order.eager_next(b, backward=False) for b in range(3)] == [1, 2, NO_BLOCK]
    assert [order.eager_next(b, backward=True) for b in range(3)] == [NO_BLOCK, 0, 1]
    for block in (1, 0, 2):
        order.record_forward(block)
    assert order.learned_order() == [1, 0, 2]
    # The backward of this step runs the forward it just saw in reverse.
    assert [order.eager_next(b, backward=True) for b in (2, 0, 1)] == [0, 1, NO_BLOCK]
    order.record_forward(1)  # block 1 again: the next forward pass began
    assert [order.eager_next(b, backward=False) for b in (1, 0, 2)] == [0, 2, NO_BLOCK]


class _Reordered(ToyModel):
    """Runs its blocks 1, 0, 2: registration order is not the order of use."""

    def forward(self, x):
        x = self.embed(x)
        for i in (1, 0, 2):
            x = self.blocks[i](x)
        return self.head(x)


def test_eager_calls_prefetch_in_the_order_blocks_ran():
    torch.manual_seed(0)
    model = _Reordered(n=3).requires_grad_(False)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        ref = model(x)
    rt = stagehand.offload(model, device="cpu")
    with torch.no_grad():
        with recording(rt.pool) as first:
            model(x)
        with recording(rt.pool) as second:
            out = model(x)
    assert_exact(out, ref)  # measured 0 (CPU, torch 2.13, 3 seeds): the same ops, whatever the prefetch order
    # First call: registration order (1 -> 2, 0 -> 1); then the recorded order (1 -> 0, 0 -> 2, 2 -> none).
    assert [r.block for r in first.rows if r.action == tr.PREFETCH] == [2, 1]
    assert [r.block for r in second.rows if r.action == tr.PREFETCH] == [0, 2]
    # Prefetching in the order of use: every eager read of the second call after its first block
    # (which nothing fetches ahead of a call) finds its block fetched.
    reads = [r for r in second.rows if r.action == tr.EAGER]
    assert first.count(outcome=tr.SYNC_FETCH) > 0
    assert all(r.outcome != tr.SYNC_FETCH for r in reads if r.block != reads[0].block)


# ---- the schedule trace ----------------------------------------------------------------------


def test_trace_records_sync_fetch_hit_in_flight_and_denial():
    model, _ = toy(n=3)
    rt = stagehand.offload(model, device="cpu")
    pool = rt.pool
    assert pool.trace is None  # off by default
    with recording(pool) as trace:
        pool.acquire(0, "bf16")  # nothing prefetched it: a synchronous fetch
        pool.release(0, "bf16")
        pool.acquire(0, "bf16")  # still resident: a hit
        pool.prefetch(1, "bf16")  # a free slot: an H2D copy ahead of its wait
        pool.acquire(1, "bf16")  # finds the copy in flight
        pool.prefetch(2, "bf16")  # both slots held: denied
        pool.release(1, "bf16")
        pool.release(1, "bf16")  # nothing held any more
    assert pool.trace is None  # switched off again
    got = [(r.action, r.block, r.outcome) for r in trace.rows]
    assert got == [
        (tr.WAIT, 0, tr.SYNC_FETCH), (tr.EVICT, 0, tr.RELEASED), (tr.WAIT, 0, tr.HIT), (tr.PREFETCH, 1, tr.H2D_COPY),
        (tr.WAIT, 1, tr.IN_FLIGHT), (tr.PREFETCH, 2, tr.DENIED), (tr.EVICT, 1, tr.RELEASED), (tr.EVICT, 1, tr.NOT_HELD),
    ]
    denied = trace.rows[5]
    assert denied.reason == "all_slots_busy" and denied.slot is None and denied.bytes == rt.block_nbytes(2, "bf16")
    assert trace.rows[0].slot is not None and trace.rows[0].bytes == rt.block_nbytes(0, "bf16")
    assert {r.phase for r in trace.rows} == {"forward"}
    assert pool.stats.sync_fetches == 1 and pool.stats.hits == 1 and pool.stats.prefetches == 1


def test_trace_is_bounded():
    trace = ScheduleTrace(capacity=2)
    for block in range(5):
        trace.record(tr.PREFETCH, block, "bf16", 0, 10, tr.H2D_COPY)
    assert [r.block for r in trace.rows] == [0, 1] and trace.dropped == 3


def test_explain_forward_rows_are_what_the_pool_counted():
    model, x = toy(n=4)
    rt = stagehand.offload(model, device="cpu", precision={2: "int8"})
    with torch.no_grad():
        model(x)  # eager: the slots now hold the last blocks, so explain's call starts from a warm pool
        before = rt.stats()
        report = stagehand.explain(model, x)
    after = rt.stats()
    delta = {k: after[k] - before[k] for k in ("h2d_bytes", "fetches", "prefetches", "sync_fetches", "hits")}
    rows = report.schedule
    assert rows and {r.phase for r in rows} == {"forward"} and not [r for r in rows if "predicted" in r.note]
    assert [r.block for r in rows if r.action == "wait"] == [0, 1, 2, 3]
    assert sum(r.note == "H2D copy" for r in rows) == delta["prefetches"]
    assert sum("sync fetch" in r.note for r in rows) == delta["sync_fetches"]
    assert sum(r.note == "resident" for r in rows) == delta["hits"]
    assert sum(r.moved_bytes for r in rows) == delta["fetches"] > 0
    assert sum(r.bytes for r in rows if r.moved_bytes) == delta["h2d_bytes"]
    assert next(r for r in rows if r.action == "wait" and r.block == 2).precision == "int8"


def test_explain_with_grad_predicts_the_backward_the_pool_then_runs():
    # Blocks run 1, 0, 2: a prediction that reversed the registration order would say 2, 1, 0.
    torch.manual_seed(0)
    model, x = _Reordered(32, 3), torch.randn(2, 5, 32)
    model.requires_grad_(False).embed.requires_grad_(True)
    rt = stagehand.offload(model, device="cpu")
    report = stagehand.explain(model, x)
    forward = [r for r in report.schedule if r.phase == "forward"]
    backward = [r for r in report.schedule if r.phase == "backward"]
    assert forward and not [r for r in forward if "predicted" in r.note]
    assert backward and all(r.note.startswith("predicted") for r in backward)
    assert "backward predicted" in report.summary()
    predicted = [r.block for r in backward if r.action == "wait"]
    # What the slot pool records when a compiled training step really runs its backward.
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    with recording(rt.pool) as trace:
        compiled(x).square().sum().backward()
    ran = [r.block for r in trace.rows if r.phase == "backward" and r.action == WAIT]
    assert predicted == ran == [2, 0, 1]


# ---- the config knobs the conductor section shadows ------------------------------------------


def test_conductor_section_knobs_reach_the_runtime(tmp_path):
    path = tmp_path / "t.jsonl"
    config = Config(conductor=ConductorConfig(h2d_slots=3, telemetry_file=str(path)))
    model, x = toy(n=4)
    rt = stagehand.offload(model, device="cpu", config=config)
    assert len(rt.pool.slots) == 3
    with torch.no_grad():
        model(x)
    rt.close()
    assert path.read_text().count("\n") == 1

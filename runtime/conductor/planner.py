"""The planner: one VRAM budget in, the fastest plan that fits out (pure; no device needed).

Per block: resident or streamed weights, kept, recomputed or spilled activations; the rotating slots. For every
count of resident blocks (spread evenly, so streamed copies overlap resident compute) and of slots, the fewest
recomputed blocks (streamed first) that bring `predicted_peak` under the cap; `simulate` predicts the step. The
fastest under the soft cap wins, else under the hard cap, else `BudgetError` with the smallest peak reachable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Sequence

from tabulate import tabulate

from torch_stagehand.runtime.conductor.costs import DEFAULT, BlockCost, Budget, BudgetError, CostModel, human

KEEP, RECOMPUTE, SPILL, MODEL = "keep", "recompute", "spill", "model"  # MODEL: the model's checkpointing decides
MAX_SLOTS = 4
DEFAULT_COST_NOTE = " (default cost model)"


@dataclass(frozen=True)
class BlockPlan:
    block: int
    resident: bool  # weights kept on the device (no fetch, no slot)
    precision: str
    activations: str  # KEEP / RECOMPUTE / SPILL / MODEL
    bytes: int  # streamed weight bytes in its precision
    predicted_s: float = 0.0  # forward + backward (recompute included) + the stall predicted before it
    h2d_bytes: int = 0  # predicted per step


@dataclass
class Plan:
    blocks: list[BlockPlan]
    slots: int  # rotating device slots
    slot_bytes: int
    lookahead: int  # streamed blocks fetched ahead of the computing one
    predicted_step_s: float
    predicted_peak_bytes: int
    budget: Budget = field(default_factory=Budget)
    kind: str = "fixed"  # "fixed" (no budget: the two-slot plan) or "planned"
    over_soft_cap: bool = False  # nothing fitted the soft cap; this plan fits the hard cap
    notes: list[str] = field(default_factory=list)
    costs: list[BlockCost] | None = field(default=None, repr=False)  # what it was predicted from (timeline)
    h2d_bps: float = 0.0
    d2h_bps: float | None = None
    measured_peak_bytes: int | None = None  # the first step under this plan (CUDA; conductor/driver.py checks it)
    cost_model: str = DEFAULT  # `CostModel.source` of the model its predictions came from
    # Spilled blocks whose activations come back while the block after them runs its backward (the rest: at use).
    restored_ahead: frozenset[int] = frozenset()

    @property
    def cost_note(self) -> str:
        """What follows a predicted time shown to a person: nothing, or that it is the default model's guess."""
        return DEFAULT_COST_NOTE if self.cost_model == DEFAULT else ""

    @property
    def resident(self) -> set[int]:
        return {p.block for p in self.blocks if p.resident}

    @property
    def recomputed(self) -> set[int]:
        return {p.block for p in self.blocks if p.activations == RECOMPUTE}

    @property
    def spilled(self) -> set[int]:
        return {p.block for p in self.blocks if p.activations == SPILL}

    def recompute_of(self, block: int) -> bool | None:
        """The plan's activation decision for `block`: True / False, or None when the model decides."""
        a = self.blocks[block].activations
        return None if a == MODEL else a == RECOMPUTE

    @property
    def weight_bytes(self) -> int:
        """Device bytes of streamed weights the plan holds: its rotating slots and its resident blocks."""
        return self.slots * self.slot_bytes + sum(p.bytes for p in self.blocks if p.resident)

    def h2d_bytes_per_step(self) -> int:
        """The weight bytes a steady training step copies up: the predicted fetches, less the forward's first streamed
        blocks that the previous backward left in the slots (unless their weights train: refreshed, so fetched)."""
        streamed = [p for p in self.blocks if not p.resident]
        trains = {b for b, c in enumerate(self.costs or ()) if c.grad_bytes}
        kept = [p for p in streamed[:self.slots] if p.block not in trains]
        return sum(p.h2d_bytes for p in self.blocks) - sum(p.bytes for p in kept)

    def counts(self) -> dict[str, int]:
        return {"resident_blocks": len(self.resident), "streamed_blocks": len(self.blocks) - len(self.resident),
                "recomputed_blocks": len(self.recomputed), "spilled_blocks": len(self.spilled)}

    def summary(self) -> str:
        c = self.counts()
        over = " (over the soft cap: nothing fitted it)" if self.over_soft_cap else ""
        return (f"{self.kind} plan{over}: {c['resident_blocks']} resident, {c['streamed_blocks']} streamed, "
                f"{c['recomputed_blocks']} recomputed, {c['spilled_blocks']} spilled; {self.slots} slots of {human(self.slot_bytes)}, "
                f"lookahead {self.lookahead}; predicted step {self.predicted_step_s * 1e3:.1f} ms{self.cost_note}, "
                f"peak {human(self.predicted_peak_bytes)}; budget {self.budget.describe()}")

    def rows(self, names: Sequence[str] | None = None) -> list[list]:
        return [[p.block, names[p.block] if names else "", p.precision, "resident" if p.resident else "streamed",
                 f"{p.bytes / 2**20:.3f}", p.activations + (", restored ahead" if p.block in self.restored_ahead else ""),
                 f"{p.predicted_s * 1e3:.2f}", f"{p.h2d_bytes / 2**20:.3f}"] for p in self.blocks]

    def headers(self) -> list[str]:
        """The columns of `rows`; the predicted time's header carries `cost_note`."""
        return ["block", "name", "precision", "weights", "MiB", "activations", f"predicted ms{self.cost_note}",
                "H2D MiB/step"]

    def table(self, names: Sequence[str] | None = None, tablefmt: str = "simple") -> str:
        return tabulate(self.rows(names), headers=self.headers(), tablefmt=tablefmt)

    def __str__(self) -> str:
        return f"{self.summary()}\n{self.table()}"

    def timeline(self) -> list[tuple[str, int, float, float]]:
        """The predicted step as (lane, block, start s, end s) on the "host", "h2d", "d2h" and "compute" lanes."""
        lanes: list = []
        if self.costs:
            simulate(self.costs, self.resident, self.recomputed, self.slots, self.h2d_bps,
                     spill=frozenset(self.spilled), d2h_bps=self.d2h_bps, lanes=lanes, ahead=self.restored_ahead)
        return lanes


# ---- the model of a step ----------------------------------------------------------------------


def predicted_peak(costs: Sequence[BlockCost], resident: set[int], recompute: set[int], slots: int,
                   slot_bytes: int, base: int, spill: frozenset[int] = frozenset(),
                   ahead: frozenset[int] = frozenset()) -> int:
    return (base + sum(costs[b].bytes for b in resident) + slots * slot_bytes
            + activation_peak(costs, recompute, spill, ahead))


def activation_peak(costs: Sequence[BlockCost], recompute: set[int], spill: frozenset[int] = frozenset(),
                    ahead: frozenset[int] = frozenset()) -> int:
    """The most saved-for-backward bytes alive at once: while block b runs its backward, blocks 0..b-1 still hold
    what they saved (a recomputed block its inputs, a spilled one nothing, but block b-1's activations are back
    when it is restored `ahead`) and b its activations (recomputed: its inputs too)."""
    return max(_activation_levels(costs, recompute, spill, ahead), default=0)


def _activation_levels(costs: Sequence[BlockCost], recompute: set[int], spill: frozenset[int],
                       ahead: frozenset[int] = frozenset()) -> list[int]:
    """activation_peak's bytes alive during each block's backward."""
    levels, held = [], 0
    for b, c in enumerate(costs):
        now = c.input_bytes + c.activation_bytes if b in recompute else c.activation_bytes
        now += costs[b - 1].activation_bytes if b and b - 1 in ahead else 0
        levels.append(held + now)
        held += c.input_bytes if b in recompute else 0 if b in spill else c.activation_bytes
    return levels


def _restores_ahead(costs: Sequence[BlockCost], resident: set[int], recompute: set[int], spill: frozenset[int],
                    fixed: int, limit: int) -> frozenset[int]:
    """The spilled, streamed blocks whose activations come back ahead (while the block after them runs its
    backward, on the H2D lane with the weights) rather than when their backward reads them (on the compute
    stream): each, in the backward's order, while the peak it raises still fits `limit`."""
    levels = _activation_levels(costs, recompute, spill)
    ahead = set()
    for b in sorted(spill - resident, reverse=True):
        if b + 1 < len(costs) and fixed + levels[b + 1] + costs[b].activation_bytes <= limit:
            levels[b + 1] += costs[b].activation_bytes
            ahead.add(b)
    return frozenset(ahead)


def simulate(costs: Sequence[BlockCost], resident: set[int], recompute: set[int], slots: int, h2d_bps: float,
             spill: frozenset[int] = frozenset(), d2h_bps: float | None = None,
             lanes: list | None = None, ahead: frozenset[int] = frozenset()) -> tuple[float, list[float], list[int]]:
    """Predicted seconds of the blocks' forward + backward, per-block seconds, per-block H2D bytes.

    One host issuing the blocks in order, one copy engine, one compute stream. A block computes between the host's
    start and end of issuing it (`BlockCost.host_*_s`; a resident block's loses its schedule ops' share) and after
    the block before it. A streamed block's copy starts once issued (`lookahead_of(slots)` streamed blocks ahead),
    the copy engine is free and its slot released; the forward's last `slots` streamed blocks are still in their
    slots at the turn. A spilled block's activations go out on the D2H lane after its forward and come back on the
    H2D lane with its weights when restored `ahead`, else on the compute stream when its backward reads them. Full fine-tuning: a resident block whose weights train is fetched each step; gradients go home
    on the D2H lane and the host optimizer steps a block once they landed (`_gradient_lanes`). `lanes` receives
    (lane, block, start s, end s) on the "host", "h2d", "d2h", "optimizer" and "compute" lanes.
    """
    n = len(costs)
    per_block, h2d = [0.0] * n, [0] * n
    order = list(range(n))
    host = [1.0 - costs[b].host_fetch_share if b in resident else 1.0 for b in order]  # resident: no fetch work
    forward = [(b, costs[b].forward_s, costs[b].bytes if b not in resident or costs[b].grad_bytes else None,
                costs[b].host_forward_s * host[b]) for b in order]
    t, host_t = _pass(forward, slots, h2d_bps, per_block, h2d, 0.0, 0.0, lanes)
    if spill:
        t = max(t, _d2h_lane(costs, spill, d2h_bps or h2d_bps, per_block, lanes))
    streamed_fw = [b for b in order if b not in resident]
    still_in_slots = set(streamed_fw[-slots:]) if slots else set()
    items = [(b, costs[b].backward_s + (costs[b].forward_s if b in recompute else 0.0)
              + (costs[b].activation_bytes / h2d_bps if b in spill and b not in ahead else 0.0),
              None if b in resident else ((0 if b in still_in_slots else costs[b].bytes)
                                          + (costs[b].activation_bytes if b in ahead else 0)),
              (costs[b].host_backward_s + (costs[b].host_recompute_s if b in recompute else 0.0)) * host[b])
             for b in reversed(order)]
    ends: dict[int, float] = {}
    t, _ = _pass(items, slots, h2d_bps, per_block, h2d, t, host_t, lanes, ends)
    for b in ahead - resident:  # their copies took the H2D lane; the per-block bytes stay the weights'
        h2d[b] -= costs[b].activation_bytes
    if any(c.grad_bytes for c in costs):
        t = max(t, _gradient_lanes(costs, ends, d2h_bps or h2d_bps, lanes, h2d_bps))
    return t, per_block, h2d


def lookahead_of(slots: int) -> int:
    """Streamed blocks fetched ahead: one per spare slot; one slot still prefetches while a resident block runs."""
    return max(slots - 1, 1) if slots else 0


def _d2h_lane(costs, spill, d2h_bps: float, per_block: list[float], lanes: list | None = None) -> float:
    """When the last spill copy is done: each starts after its block's forward, one at a time."""
    lane = 0.0
    for b in sorted(spill):
        finish = sum(per_block[:b + 1])  # the forward's end of block b (per_block holds the forward alone here)
        start = max(lane, finish)
        lane = start + costs[b].activation_bytes / d2h_bps
        if lanes is not None:
            lanes.append(("d2h", b, start, lane))
    return lane


def _gradient_lanes(costs, ends: dict[int, float], d2h_bps: float, lanes: list | None = None,
                    h2d_bps: float | None = None) -> float:
    """When the host optimizer is done: gradients (or states) go home on the D2H lane, then the host steps."""
    d2h = host = 0.0
    for b in sorted(ends, key=ends.get):  # backward order
        if not costs[b].grad_bytes:
            continue
        start = max(d2h, ends[b])
        d2h = start + max(costs[b].grad_bytes / d2h_bps, costs[b].update_in_bytes / (h2d_bps or d2h_bps))
        if lanes is not None:
            lanes.append(("d2h", b, start, d2h))
        if costs[b].optimizer_s:
            begin = max(host, d2h)
            host = begin + costs[b].optimizer_s
            if lanes is not None:
                lanes.append(("optimizer", b, begin, host))
    return max(d2h, host)


def _pass(items, slots: int, bps: float, per_block: list[float], h2d: list[int], t0: float, host_t: float,
          lanes: list | None = None, ends: dict | None = None) -> tuple[float, float]:
    """One pass (forward or backward) of (block, GPU s, bytes or None if resident, host s) items from `t0`
    on the GPU and `host_t` on the host: (the GPU's end, the host's end). `ends` receives each block's end."""
    depth = lookahead_of(slots)
    streamed_before = list(accumulate(int(nbytes is not None) for _, _, nbytes, _ in items))  # in [0, j]
    copy_free, compute_end = t0, t0
    starts, releases = [0.0] * len(items), []  # compute start per item; release time per streamed ordinal
    issuer = 0
    for j, (block, seconds, nbytes, host_s) in enumerate(items):
        host_start, host_t = host_t, host_t + host_s
        if lanes is not None and host_s:
            lanes.append(("host", block, host_start, host_t))
        ready = max(compute_end, host_start)
        if nbytes is not None:
            ordinal = streamed_before[j]  # 1-based
            # Issued at the start of the earliest earlier item within `depth` streamed blocks of this one.
            while issuer < j and streamed_before[issuer] < ordinal - depth:
                issuer += 1
            issued = starts[issuer] if issuer < j else ready  # else fetched by its own wait
            slot_free = releases[ordinal - 1 - slots] if slots and ordinal > slots else t0
            begin = max(issued, copy_free, slot_free)
            copy_free = begin + nbytes / bps
            h2d[block] += nbytes
            if lanes is not None and nbytes:
                lanes.append(("h2d", block, begin, copy_free))
            ready = max(ready, copy_free)
        starts[j] = ready
        end = max(ready + seconds, host_t)  # a host slower than the GPU stretches the block to its issue
        per_block[block] += end - compute_end
        if ends is not None:
            ends[block] = end
        if lanes is not None:
            lanes.append(("compute", block, ready, end))
        compute_end = end
        if nbytes is not None:
            releases.append(compute_end)
    return compute_end, host_t


# ---- the search ---------------------------------------------------------------------------------


def spread(k: int, n: int) -> set[int]:
    """`k` of `n` block indices, evenly spaced."""
    return {min(n - 1, int((j + 0.5) * n / k)) for j in range(k)} if k else set()


def make_plan(costs: Sequence[BlockCost], precision: Sequence[str], budget: Budget, model: CostModel) -> Plan:
    """The plan with the least predicted step time under the soft cap (else the hard cap)."""
    if budget.limit is None:
        raise BudgetError("planner: no VRAM budget (vram_budget, conductor.vram_soft_cap_mb or vram_hard_cap_mb)")
    best = _search(costs, budget.limit, model)
    over_soft = False
    if best is None and budget.hard is not None and budget.soft is not None and budget.hard > budget.soft:
        best, over_soft = _search(costs, budget.hard, model), True
    if best is None:
        floor = predicted_peak(costs, set(), {b for b, c in enumerate(costs) if c.activation_bytes > c.input_bytes},
                               1, max(c.bytes for c in costs), model.base_bytes)
        raise BudgetError(f"planner: no plan fits the VRAM budget ({budget.describe()}); the smallest plan (every "
                          f"block streamed through one slot, recomputed where that saves bytes) needs "
                          f"{human(floor)}")
    _, resident, (recompute, spill, ahead), slots, _, _ = best
    plan = build_plan(costs, precision, resident, recompute, slots, model, kind="planned", budget=budget, spill=spill,
                      ahead=ahead)
    plan.over_soft_cap = over_soft
    return plan


def build_plan(costs: Sequence[BlockCost], precision: Sequence[str], resident: set[int], recompute: set[int] | None,
               slots: int, model: CostModel, kind: str, budget: Budget = Budget(),
               spill: frozenset[int] = frozenset(), ahead: frozenset[int] = frozenset()) -> Plan:
    """A Plan for given decisions, with its predictions (`recompute=None`: the model's checkpointing decides;
    `ahead`: the spilled blocks restored ahead of their backward)."""
    streamed = [b for b in range(len(costs)) if b not in resident]
    slot_bytes = max((costs[b].bytes for b in streamed), default=0)
    decided = recompute or set()
    step_s, per_block, h2d = simulate(costs, resident, decided, slots, model.h2d_bps, spill=spill,
                                      d2h_bps=model.d2h_bps, ahead=ahead)
    peak = predicted_peak(costs, resident, decided, slots, slot_bytes, model.base_bytes, spill, ahead)
    blocks = [BlockPlan(b, b in resident, precision[b], MODEL if recompute is None else
                        (RECOMPUTE if b in recompute else SPILL if b in spill else KEEP), c.bytes, per_block[b], h2d[b])
              for b, c in enumerate(costs)]
    return Plan(blocks, slots, slot_bytes, lookahead_of(slots), step_s + model.other_s, peak, budget, kind,
                costs=list(costs), h2d_bps=model.h2d_bps, d2h_bps=model.d2h_bps, cost_model=model.source,
                restored_ahead=frozenset(ahead))


def _search(costs: Sequence[BlockCost], limit: int, model: CostModel):
    n = len(costs)
    best = None
    for k in range(n, -1, -1):
        resident = spread(k, n)
        streamed = [b for b in range(n) if b not in resident]
        slot_bytes = max((costs[b].bytes for b in streamed), default=0)
        # Recompute candidates: those that save bytes; streamed blocks first, then the largest saving, then
        # the earliest (its recompute runs when the fewest saved bytes are still alive).
        candidates = sorted((b for b in range(n) if costs[b].activation_bytes > costs[b].input_bytes),
                            key=lambda b: (b in resident, costs[b].input_bytes - costs[b].activation_bytes, b))
        for slots in ([0] if not streamed else range(1, min(MAX_SLOTS, len(streamed)) + 1)):
            decided = _fewest_savers(costs, resident, candidates, slots, slot_bytes, model, limit)
            if decided is None:
                continue
            recompute, spill = decided
            fixed = model.base_bytes + sum(costs[b].bytes for b in resident) + slots * slot_bytes
            ahead = _restores_ahead(costs, resident, recompute, spill, fixed, limit)
            decided = recompute, spill, ahead
            time_s, _, h2d = simulate(costs, resident, recompute, slots, model.h2d_bps, spill=spill,
                                      d2h_bps=model.d2h_bps, ahead=ahead)
            peak = predicted_peak(costs, resident, recompute, slots, slot_bytes, model.base_bytes, spill, ahead)
            # Equal predicted times (the copies hidden either way): the fewer bytes over PCIe, then the lower peak.
            key = (round(time_s, 6), sum(h2d), peak)
            if best is None or key < best[0]:
                best = (key, resident, decided, slots, slot_bytes, peak)
    return best


def _fewest_savers(costs, resident, candidates, slots, slot_bytes, model: CostModel, limit):
    """(recompute, spill): the fewest blocks, in candidate order, whose saving brings the peak under `limit`. Each
    recomputes, or spills where its activations' way back (H2D) costs less than re-running its forward (spill
    needs a measured `CostModel.d2h_bps`) and the host has room for them (`CostModel.spill_room_bytes`). The peak is `predicted_peak`'s, kept as per-block lists each added
    block edits in place (the search calls this often). Restores ahead are `_restores_ahead`'s, after it."""
    recompute: set[int] = set()
    spill: set[int] = set()
    fixed = model.base_bytes + sum(costs[b].bytes for b in resident) + slots * slot_bytes
    during = [c.activation_bytes for c in costs]  # held while the block's backward runs
    left = list(during)  # held from its forward until its backward (what the blocks after it see)

    def peak() -> int:  # activation_peak's walk over the two lists
        top = held = 0
        for now, keep in zip(during, left):
            if held + now > top:
                top = held + now
            held += keep
        return top

    if fixed + peak() <= limit:
        return recompute, frozenset()
    room = model.spill_room_bytes
    for b in candidates:
        c = costs[b]
        if (model.d2h_bps and c.activation_bytes / model.h2d_bps < c.forward_s
                and (room is None or c.activation_bytes <= room)):
            if room is not None:
                room -= c.activation_bytes
            spill.add(b)
            left[b] = 0
        else:
            recompute.add(b)
            during[b], left[b] = c.input_bytes + c.activation_bytes, c.input_bytes
        if fixed + peak() <= limit:
            return recompute, frozenset(spill)
    return None

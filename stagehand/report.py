"""`explain()`'s result: the blocks, the rewritten graphs, the passes that ran, the schedule table.

The schedule rows are the conductor's trace of the call explain made; rows the call did not run (the backward)
are marked "predicted" in their note.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tabulate import tabulate

from torch_stagehand.runtime.conductor import trace as tr

_HEADERS = ["phase", "pos", "action", "block", "slot", "MB", "precision", "note"]
_NOTES = {
    tr.H2D_COPY: "H2D copy",
    tr.SYNC_FETCH: "sync fetch (stall)",
    tr.HIT: "resident",
    tr.IN_FLIGHT: "",  # the wait found the copy its prefetch issued: the plan working
    tr.RELEASED: "slot released, bytes kept",
    tr.NOT_HELD: "already released",
}
PREDICTED = "predicted"


@dataclass
class ScheduleRow:
    phase: str
    position: int
    action: str
    block: int
    slot: int | None
    bytes: int
    precision: str
    note: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    @property
    def moved_bytes(self) -> bool:
        return "H2D copy" in self.note or "sync fetch" in self.note


def rows_from_trace(trace_rows: list[tr.TraceRow], predicted: bool = False, start: int = 0) -> list[ScheduleRow]:
    """Table rows from conductor trace rows; `predicted` marks rows no call ran."""
    rows = []
    for i, r in enumerate(trace_rows):
        note = f"denied: {r.reason}" if r.outcome == tr.DENIED else _NOTES[r.outcome]
        if predicted:
            note = f"{PREDICTED}; {note}" if note else PREDICTED
        rows.append(ScheduleRow(r.phase, start + i, r.action, r.block, r.slot, r.bytes, r.precision, note))
    return rows


@dataclass
class Report:
    blocks: list[str]
    graphs: dict[str, str]
    schedule: list[ScheduleRow]
    graph_breaks: list[str]
    graph_count: int = 1
    stats: dict = field(default_factory=dict)
    segments: list[dict] = field(default_factory=list)
    # The compiler passes that ran, in order: {"graph", "unit" ("" for the graph-level passes), "name", "notes"}.
    passes: list[dict] = field(default_factory=list)
    # What offload() did (`rt.stats()["offload"]`): block lists, blocks per precision, bytes per step, host bytes.
    offload: dict = field(default_factory=dict)
    plan: Any = None  # the runtime's Plan (runtime/conductor/planner.py) the call ran under
    expert_bytes: dict = field(default_factory=dict)  # block -> its expert stacks' bytes (MoE), in its precision

    def plan_table(self, tablefmt: str = "simple") -> str:
        """The plan per block, its predictions, and the H2D bytes this call actually moved per block."""
        if self.plan is None:
            return ""
        moved: dict[int, int] = {}
        for r in self.schedule:
            if r.moved_bytes:
                moved[r.block] = moved.get(r.block, 0) + r.bytes
        rows = [row + [f"{moved.get(p.block, 0) / 2**20:.3f}"] for row, p in zip(self.plan.rows(self.blocks),
                                                                               self.plan.blocks)]
        headers = self.plan.headers()[:-1] + ["predicted H2D MiB/step", "H2D MiB this call"]
        if self.expert_bytes:  # a MoE model: how much of each block's weights are its experts
            at = headers.index("MiB") + 1
            headers.insert(at, "of which experts MiB")
            for row, p in zip(rows, self.plan.blocks):
                row.insert(at, f"{self.expert_bytes.get(p.block, 0) / 2**20:.3f}")
        return f"{self.plan.summary()}\n" + tabulate(rows, headers=headers, tablefmt=tablefmt)

    def table(self, tablefmt: str = "simple") -> str:
        rows = [[r.phase, r.position, r.action, f"{r.block} {self.blocks[r.block]}",
                 "-" if r.slot is None else "R" if r.slot < 0 else r.slot,  # R: the block's own resident slot
                 f"{r.bytes / 1e6:.2f}", r.precision, r.note] for r in self.schedule]
        return tabulate(rows, headers=_HEADERS, tablefmt=tablefmt)

    def segment_table(self, tablefmt: str = "simple") -> str:
        rows = [[s["graph"], s["segment"], s["kind"], s.get("block", ""), s["ops"], s["streamed"], s["inputs_from"]]
                for s in self.segments]
        return tabulate(rows, headers=["graph", "segment", "kind", "block", "ops", "streamed linears", "reads from"],
                        tablefmt=tablefmt)

    def pass_table(self, tablefmt: str = "simple") -> str:
        rows = [[p["graph"], p["unit"] or "(graph)", p["name"], "; ".join(p["notes"])] for p in self.passes]
        return tabulate(rows, headers=["graph", "unit", "pass", "notes"], tablefmt=tablefmt)

    def summary(self) -> str:
        fetches = sum(1 for r in self.schedule if r.moved_bytes)
        stalls = sum(1 for r in self.schedule if "sync fetch" in r.note)
        moved = sum(r.bytes for r in self.schedule if r.moved_bytes)
        what = "forward as run" + (", backward predicted" if any(PREDICTED in r.note for r in self.schedule) else "")
        return (f"{len(self.blocks)} blocks, {self.graph_count} graph(s), {len(self.graph_breaks)} graph break(s); "
                f"this call ({what}): {fetches} H2D fetches ({moved / 1e6:.1f} MB), {stalls} synchronous")

    def host_summary(self) -> str:
        """Where the host copies are (stats()["host"]): pinned bytes asked for and locked, bytes per copy kind."""
        host = self.stats.get("host")
        if not host:
            return ""
        kinds = ", ".join(f"{kind} {n / 1e9:.2f} GB" for kind, n in host["bytes_by_kind"].items())
        return (f"host memory (keep_full={host['keep_full']!r}): {kinds}; pinned {host['pinned_requested_bytes'] / 1e9:.2f}"
                f" GB asked, {host['pinned_locked_bytes'] / 1e9:.2f} GB locked, {host['host_allocations']} allocation(s)")

    def offload_line(self) -> str:
        o = self.offload
        if not o:
            return ""
        lists = "; ".join(b["fqn"] + (f" ({b['children']} blocks)" if b["streamed"] else f" skipped: {b['reason']}")
                          for b in o["block_lists"])
        precision = ", ".join(f"{p} x{n}" for p, n in o["precision_blocks"].items())
        return (f"offload: {lists}; precision {precision}; {o['forward_bytes'] / 1e6:,.1f} MB per forward, "
                f"host store {o['host_bytes'] / 1e6:,.1f} MB, {o['slots']} slots of {o['slot_bytes'] / 1e6:,.1f} MB")

    def __str__(self) -> str:
        head = "\n".join(x for x in (self.offload_line(), self.summary(), self.host_summary()) if x)
        plan = f"\n\n{self.plan_table()}" if self.plan is not None else ""
        return f"{head}\n\n{self.table()}{plan}"

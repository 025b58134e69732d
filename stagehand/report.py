"""`explain()`'s result: the blocks, the rewritten graphs, the schedule table, the passes that ran."""

from __future__ import annotations

from dataclasses import dataclass, field

from tabulate import tabulate

from torch_stagehand.compiler.plan import ScheduleRow

_HEADERS = ["phase", "pos", "action", "block", "slot", "MB", "precision", "note"]


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

    def schedule_rows(self) -> list[list]:
        return [
            [r.phase, r.position, r.action, f"{r.block} {self.blocks[r.block]}", "-" if r.slot is None else r.slot,
             f"{r.bytes / 1e6:.2f}", r.precision, r.note]
            for r in self.schedule
        ]

    def table(self, tablefmt: str = "simple") -> str:
        return tabulate(self.schedule_rows(), headers=_HEADERS, tablefmt=tablefmt)

    def segment_table(self, tablefmt: str = "simple") -> str:
        rows = [[s["graph"], s["segment"], s["kind"], s.get("block", ""), s["ops"], s["streamed"], s["inputs_from"]]
                for s in self.segments]
        return tabulate(rows, headers=["graph", "segment", "kind", "block", "ops", "streamed linears", "reads from"],
                        tablefmt=tablefmt)

    def pass_table(self, tablefmt: str = "simple") -> str:
        rows = [[p["graph"], p["unit"] or "(graph)", p["name"], "; ".join(p["notes"])] for p in self.passes]
        return tabulate(rows, headers=["graph", "unit", "pass", "notes"], tablefmt=tablefmt)

    def summary(self) -> str:
        fetches = sum(1 for r in self.schedule if r.note == "H2D copy" or r.note.startswith("sync"))
        stalls = sum(1 for r in self.schedule if r.note.startswith("sync"))
        moved = sum(r.bytes for r in self.schedule if r.note == "H2D copy" or r.note.startswith("sync"))
        return (
            f"{len(self.blocks)} blocks, {self.graph_count} graph(s), {len(self.graph_breaks)} graph break(s); "
            f"first step (from empty slots): {fetches} H2D fetches ({moved / 1e6:.1f} MB), {stalls} synchronous"
        )

    def __str__(self) -> str:
        return f"{self.summary()}\n\n{self.table()}"

"""The Conductor: fetch order and lookahead, phases, telemetry, the VRAM plan and its rules.

`planner` makes the plan from `costs` and `calibrate`'s measured step; `driver` (`PlanDriver`, the one owner of the
budget) applies it; `oom_recovery` re-plans through the driver; `conductor` admits prefetches under its budget
and transfer managers and its prefetch rules; `trace` / `predict` record and predict the schedule `explain()` prints.
"""

from torch_stagehand.runtime.conductor.fetch_order import LOOKAHEAD_DEPTH, FetchOrder, Lookahead
from torch_stagehand.runtime.conductor.phases import Phase, PhaseTracker
from torch_stagehand.runtime.conductor.telemetry import TelemetryWriter
from torch_stagehand.runtime.conductor.trace import ScheduleTrace, TraceRow, recording

__all__ = ["LOOKAHEAD_DEPTH", "FetchOrder", "Lookahead", "Phase", "PhaseTracker", "ScheduleTrace",
           "TelemetryWriter", "TraceRow", "recording"]

"""The Conductor: the one owner of fetch order and lookahead, phases, telemetry, the VRAM plan and its rules.

`fetch_order` says which block is fetched next (compiled graphs and eager
calls alike), `phases` tracks the training step, `telemetry` writes what each
step moved, `trace` records what the slot pool did for `explain()`.
`planner` makes the plan for a VRAM budget from `costs` (and `calibrate`'s
measured step); `driver` applies it (`PlanDriver`, the one owner of the
budget), `oom_recovery` re-plans through the driver when the device runs out;
`conductor` is the run-time Conductor over `budget`, `transfer` and `policy`
(the seed's modes, priorities, tokens and rules).
"""

from torch_stagehand.runtime.conductor.fetch_order import LOOKAHEAD_DEPTH, FetchOrder, Lookahead
from torch_stagehand.runtime.conductor.phases import Phase, PhaseTracker
from torch_stagehand.runtime.conductor.telemetry import TelemetryWriter
from torch_stagehand.runtime.conductor.trace import ScheduleTrace, TraceRow, recording

__all__ = ["LOOKAHEAD_DEPTH", "FetchOrder", "Lookahead", "Phase", "PhaseTracker", "ScheduleTrace",
           "TelemetryWriter", "TraceRow", "recording"]

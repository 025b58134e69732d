"""The Conductor: the one owner of fetch order and lookahead, phases and telemetry (the planner lands here).

`fetch_order` says which block is fetched next (compiled graphs and eager
calls alike), `phases` tracks the training step, `telemetry` writes what each
step moved, `trace` records what the slot pool did for `explain()`.
"""

from .fetch_order import LOOKAHEAD_DEPTH, FetchOrder, Lookahead
from .phases import Phase, PhaseTracker
from .telemetry import TelemetryWriter
from .trace import ScheduleTrace, TraceRow, recording

__all__ = ["LOOKAHEAD_DEPTH", "FetchOrder", "Lookahead", "Phase", "PhaseTracker", "ScheduleTrace",
           "TelemetryWriter", "TraceRow", "recording"]

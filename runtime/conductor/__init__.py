"""The Conductor: the one owner of fetch order and lookahead, phases and telemetry (the planner lands here)."""

"""Host store, device slots, streams and tokens, the custom ops, phases and telemetry."""

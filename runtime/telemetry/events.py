"""Who else wants to know when a step ends or a unit compiles (the front door's reports), and the progress bar of
offload's slow loops."""

from __future__ import annotations

from typing import Any, Callable

import torch


class RuntimeEvents:
    def __init__(self):
        self.step_listeners: list[Callable[[dict[str, Any]], None]] = []  # each step's telemetry record
        # ("graph" | "unit" | "block variant", seconds, loaded from the compile caches)
        self.compile_listeners: list[Callable[[str, float, bool], None]] = []

    def step(self, record: dict[str, Any]) -> None:
        for listener in list(self.step_listeners):
            listener(record)

    def compiled(self, kind: str, seconds: float, loaded: bool = False) -> None:
        for listener in list(self.compile_listeners):
            listener(kind, seconds, loaded)


def unwrap_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that really steps: accelerate's AcceleratedOptimizer (the HF Trainer's too) wraps one."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def progress(items, label: str):
    """A progress bar on a terminal for the slow loops of offload (a 12B model takes a minute); silent elsewhere."""
    items = list(items)
    if len(items) < 8:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=label, unit="block", disable=None, leave=False)

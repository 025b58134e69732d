"""What a Runtime offers for selective precision (a mixin): forwards to `rt.selective`, the controller, when on."""

from __future__ import annotations

import torch
import torch.nn as nn

from torch_stagehand.runtime import precision as precisions


class SelectivePrecisionAPI:
    selective = None  # the controller, set by offload when the policy is on (Runtime.start_selective_precision)

    def _selective_hooks(self, optimizer) -> list:
        return [] if self.selective is None else self.selective.attach(optimizer)

    def _check_precision_devices(self, new: dict[int, str]) -> None:
        for value in sorted(set(new.values())):
            precisions.get(value).check_device(self.device, self.config.selective_precision.fp8_emulate)

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Selective precision's loss feedback (optional): kept on the device, read once per update."""
        if self.selective is not None:
            self.selective.observe_loss(loss)

    def calibrate(self, batches, model: nn.Module | None = None):
        """Selective precision's calibration on real batches, cached on disk (runtime/selective/calibration.py)."""
        if self.selective is None:
            raise RuntimeError("calibrate: selective precision is off (offload with precision='auto' or a "
                               "config whose selective_precision sets a mode)")
        return self.selective.calibrate(batches, model)

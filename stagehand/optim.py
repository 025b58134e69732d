"""`torch_stagehand.optim`: the public name of the host optimizer (runtime/train/optimizer.py)."""

from torch_stagehand.runtime.train.optimizer import HostAdamW, HostUpdateWarning

__all__ = ["HostAdamW", "HostUpdateWarning"]

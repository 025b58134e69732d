"""The configuration, as the front door names it: `torch_stagehand.config.Config` (the dataclass tree lives in
`runtime/config.py`: the runtime never imports the front door)."""

from torch_stagehand.environment import patch
from torch_stagehand.runtime.config import ConductorConfig, Config, ConfigError, PrecisionConfig

__all__ = ["ConductorConfig", "Config", "ConfigError", "PrecisionConfig", "patch"]

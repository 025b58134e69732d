"""The configuration, as the front door names it: `torch_stagehand.config.Config`.

The dataclass tree lives in `runtime/config.py` (the runtime reads it, and the
runtime never imports the front door); this module is its public name.
"""

from torch_stagehand.runtime.config import ConductorConfig, Config, ConfigError, PrecisionConfig

__all__ = ["ConductorConfig", "Config", "ConfigError", "PrecisionConfig"]

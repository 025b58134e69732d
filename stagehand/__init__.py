"""torch-stagehand: stream transformer block weights host-to-GPU inside one compiled program.

    rt = torch_stagehand.offload(model, device="cuda", precision={0: "int8"})
    compiled = torch.compile(model, backend="stagehand")
"""

from torch_stagehand.compiler.backend import NotOffloadedWarning
from torch_stagehand.runtime import ops as _ops  # noqa: F401  (registers the custom ops)
from torch_stagehand.runtime.conductor.oom_recovery import BackwardIncompleteError, OutOfMemoryWarning
from torch_stagehand.runtime.runtime import EagerFallbackWarning, Runtime

from torch_stagehand.api import RegionalCompileWarning, compile_blocks, explain, offload, runtime_of
from torch_stagehand.runtime.config import ConductorConfig, Config, ConfigError, PrecisionConfig
from torch_stagehand.version import __version__

__all__ = ["__version__", "BackwardIncompleteError", "Config", "ConductorConfig", "ConfigError", "EagerFallbackWarning",
           "NotOffloadedWarning", "OutOfMemoryWarning", "PrecisionConfig", "RegionalCompileWarning", "Runtime",
           "compile_blocks", "explain", "offload", "runtime_of"]

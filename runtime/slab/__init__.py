"""The SquareQ-compatible INT8 slab file format: reader, builder, manifest, safetensors I/O, errors, report.

A slab is ``{name}.safetensors`` + ``{name}.manifest.json`` (SquareQ V2's schema plus our checksums and ids).
`loading` (offload's slab loader, the one module here that depends on the streaming engine) is not re-exported."""

from torch_stagehand.runtime.slab.builder import build_slab_from_module
from torch_stagehand.runtime.slab.checkpoint import build_slab_from_checkpoint
from torch_stagehand.runtime.slab.errors import (
    SlabAbiError, SlabChecksumError, SlabDtypeError, SlabError, SlabExtraTensorError, SlabHeaderError,
    SlabIdentityError, SlabIdentityWarning, SlabLayerNotFoundError, SlabManifestError, SlabMismatchError,
    SlabMissingTensorError, SlabModelMismatchError, SlabPathError, SlabShapeError, SlabSignatureError,
    SlabTruncatedError, SlabUnsupportedError, SlabValueError,
)
from torch_stagehand.runtime.slab.layers import canonical_name, compute_model_signature
from torch_stagehand.runtime.slab.manifest import CURRENT_KERNEL_ABI_VERSION, LayerEntry, SlabManifest, load_manifest
from torch_stagehand.runtime.slab.reader import SlabReader, slab_paths
from torch_stagehand.runtime.slab.report import BuildResult, LayerReport

__all__ = [
    "BuildResult", "CURRENT_KERNEL_ABI_VERSION", "LayerEntry", "LayerReport", "SlabManifest", "SlabReader",
    "build_slab_from_checkpoint", "build_slab_from_module", "canonical_name", "compute_model_signature",
    "load_manifest", "slab_paths",
    # errors
    "SlabError", "SlabAbiError", "SlabChecksumError", "SlabDtypeError", "SlabExtraTensorError", "SlabHeaderError",
    "SlabIdentityError", "SlabIdentityWarning", "SlabLayerNotFoundError", "SlabManifestError", "SlabMismatchError",
    "SlabMissingTensorError", "SlabModelMismatchError", "SlabPathError", "SlabShapeError", "SlabSignatureError",
    "SlabTruncatedError", "SlabUnsupportedError", "SlabValueError",
]

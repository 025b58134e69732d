"""The SquareQ-compatible INT8 slab file format: reader, builder, manifest, safetensors I/O, errors, report.

A slab is ``{name}.safetensors`` + ``{name}.manifest.json`` (SquareQ V2's
schema plus our checksums and ids). The modules, each with one job:

    reader.py          SlabReader: validated, bounded-memory reads into caller buffers
    checks.py          what a slab is checked against at open, and a live model against a slab
    identity.py        which weights a slab was quantized from (sampled-row hashes), checked on load
    manifest.py        the manifest schema, parsed and validated
    layers.py          canonical layer names, the Linear-like layers of a model, the signature
    builder.py         the one slab writer, and the builder from a live module
    checkpoint.py      the builder streamed from a (sharded) safetensors checkpoint
    report.py          the per-layer build report (BuildResult)
    safetensors_io.py  safetensors header parsing and writing, pread, no mmap
    errors.py          the SlabError hierarchy
    loading.py         offload(model, slab=...): a slab into the runtime's host store

This surface is what the front door, tests and benches use. `loading` is not
re-exported: it is the one module that depends on the streaming engine (its
docstring says why), imported by `api.offload` where it needs it.
"""

from torch_stagehand.runtime.slab.builder import build_slab_from_module
from torch_stagehand.runtime.slab.checkpoint import build_slab_from_checkpoint
from torch_stagehand.runtime.slab.errors import (
    SlabAbiError,
    SlabChecksumError,
    SlabDtypeError,
    SlabError,
    SlabExtraTensorError,
    SlabHeaderError,
    SlabIdentityError,
    SlabIdentityWarning,
    SlabLayerNotFoundError,
    SlabManifestError,
    SlabMismatchError,
    SlabMissingTensorError,
    SlabModelMismatchError,
    SlabPathError,
    SlabShapeError,
    SlabSignatureError,
    SlabTruncatedError,
    SlabUnsupportedError,
    SlabValueError,
)
from torch_stagehand.runtime.slab.layers import canonical_name, compute_model_signature
from torch_stagehand.runtime.slab.manifest import CURRENT_KERNEL_ABI_VERSION, LayerEntry, SlabManifest, load_manifest
from torch_stagehand.runtime.slab.reader import SlabReader, slab_paths
from torch_stagehand.runtime.slab.report import BuildResult, LayerReport

__all__ = [
    "BuildResult",
    "CURRENT_KERNEL_ABI_VERSION",
    "LayerEntry",
    "LayerReport",
    "SlabManifest",
    "SlabReader",
    "build_slab_from_checkpoint",
    "build_slab_from_module",
    "canonical_name",
    "compute_model_signature",
    "load_manifest",
    "slab_paths",
    # errors
    "SlabError",
    "SlabAbiError",
    "SlabChecksumError",
    "SlabDtypeError",
    "SlabExtraTensorError",
    "SlabHeaderError",
    "SlabIdentityError",
    "SlabIdentityWarning",
    "SlabLayerNotFoundError",
    "SlabManifestError",
    "SlabMismatchError",
    "SlabMissingTensorError",
    "SlabModelMismatchError",
    "SlabPathError",
    "SlabShapeError",
    "SlabSignatureError",
    "SlabTruncatedError",
    "SlabUnsupportedError",
    "SlabValueError",
]

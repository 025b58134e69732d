"""The slab error hierarchy: every error names the file and, where there is one, the layer. All derive from
`SlabError` (a RuntimeError, as SquareQ raises); nothing zero-fills or skips on error: an error stops the load."""

from __future__ import annotations

import os


class SlabError(RuntimeError):
    """A slab or manifest cannot be used; the message names the file and the layer."""

    def __init__(self, message: str, *, path: str | os.PathLike | None = None, layer: str | None = None):
        self.path = None if path is None else str(path)
        self.layer = layer
        self.detail = message
        where = [self.path] if self.path else []
        if layer is not None:
            where.append(f"layer '{layer}'")
        super().__init__(": ".join(where + [message]))


class SlabManifestError(SlabError):
    """The manifest JSON is malformed or inconsistent with itself."""


class SlabHeaderError(SlabError):
    """The safetensors header is unreadable or describes impossible byte ranges."""


class SlabTruncatedError(SlabError):
    """The file is shorter (or longer) than its header / manifest say."""


class SlabChecksumError(SlabError):
    """Bytes do not match a checksum or hash recorded in the manifest."""


class SlabMissingTensorError(SlabError):
    """The manifest lists a tensor that the safetensors file lacks."""


class SlabExtraTensorError(SlabError):
    """The safetensors file holds a tensor that the manifest does not list."""


class SlabShapeError(SlabError):
    """A shape disagrees (manifest vs file, manifest vs itself, or vs a buffer)."""


class SlabDtypeError(SlabError):
    """A dtype disagrees with the manifest or with what the format requires."""


class SlabSignatureError(SlabError):
    """The model signature is not the expected one."""


class SlabAbiError(SlabError):
    """The kernel ABI version is not one this runtime supports."""


class SlabMismatchError(SlabError):
    """The manifest belongs to another slab file (slab id or header hash differ)."""


class SlabUnsupportedError(SlabError):
    """Valid SquareQ, but not something we compute with (non-zero zero_point, 4 bits...)."""


class SlabValueError(SlabError):
    """Tensor values that cannot be right (NaN / Inf / all-zero scale)."""


class SlabModelMismatchError(SlabError):
    """A live model does not match the slab (missing layer, shape, bias)."""


class SlabLayerNotFoundError(SlabError, KeyError):
    """A layer name the slab does not hold."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return RuntimeError.__str__(self)


class SlabIdentityError(SlabError):
    """The slab was quantized from other weights than the model's (or records none, when one is required)."""


class SlabPathError(SlabError):
    """A path that a manifest, a checkpoint index or a caller names would leave its folder."""


class SlabIdentityWarning(UserWarning):
    """The slab records no identity of its source weights, so it cannot be checked against the model."""

"""The SquareQ-compatible INT8 slab file format: reader, builder, manifest, safetensors I/O, errors, report."""

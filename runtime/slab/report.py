"""Per-layer build report of a slab: a tabulate table on stdout and JSON beside the slab."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from torch_stagehand.runtime.atomic_file import write_atomic
from torch_stagehand.runtime.slab.manifest import SlabManifest


@dataclass
class LayerReport:
    name: str
    shape: list[int]  # [out, in] of the source weight
    bf16_bytes: int  # the weight at 2 bytes an element
    int8_bytes: int  # this layer's bytes in the slab: qweight (padded) + scale + zero_point + bias
    cosine: float  # dequantized vs original weight, with the build's quantizer
    cosine_alt: float | None  # the same with the other quantizer (mse <-> absmax), when compared
    seconds: float


@dataclass
class BuildResult:
    safetensors_path: str
    manifest_path: str
    report_path: str
    manifest: SlabManifest
    layers: list[LayerReport] = field(default_factory=list)
    quantizer: str = "mse"
    alt_quantizer: str | None = None
    seconds: float = 0.0
    slab_bytes: int = 0

    def summary(self) -> dict:
        out = {"layers": len(self.layers), "bf16_bytes": sum(r.bf16_bytes for r in self.layers),
               "int8_bytes": sum(r.int8_bytes for r in self.layers), "slab_file_bytes": self.slab_bytes,
               "seconds": round(self.seconds, 3), "quantizer": self.quantizer}
        for q, cos in [(self.quantizer, [r.cosine for r in self.layers])] + (
                [(self.alt_quantizer, [r.cosine_alt for r in self.layers])] if self.alt_quantizer else []):
            out[f"cosine_{q}_mean"], out[f"cosine_{q}_min"] = (sum(cos) / len(cos), min(cos)) if cos else (None, None)
        if self.alt_quantizer:
            out[f"layers_where_{self.quantizer}_beats_{self.alt_quantizer}"] = sum(
                1 for r in self.layers if r.cosine > r.cosine_alt)
        return out

    def table(self) -> str:
        from tabulate import tabulate

        qs = [self.quantizer] + ([self.alt_quantizer] if self.alt_quantizer else [])
        headers = ["layer", "shape", "BF16 MB", "INT8 MB", *(f"cos {q}" for q in qs), "s"]
        rows = [[r.name, "x".join(map(str, r.shape)), r.bf16_bytes / 2**20, r.int8_bytes / 2**20, f"{r.cosine:.6f}",
                 *([f"{r.cosine_alt:.6f}"] if self.alt_quantizer else []), f"{r.seconds:.3f}"] for r in self.layers]
        s = self.summary()
        rows.append(["TOTAL", f"{s['layers']} layers", s["bf16_bytes"] / 2**20, s["int8_bytes"] / 2**20,
                     *(f"{s[f'cosine_{q}_mean'] or 0:.6f} (min {s[f'cosine_{q}_min'] or 0:.6f})" for q in qs),
                     f"{self.seconds:.2f}"])
        return tabulate(rows, headers=headers, floatfmt=".2f")

    def to_json(self) -> dict:
        return {"slab": self.safetensors_path, "manifest": self.manifest_path,
                "model_signature": self.manifest.model_signature, "architecture_id": self.manifest.architecture_id,
                "summary": self.summary(), "layers": [asdict(r) for r in self.layers]}


def print_and_save_report(result: BuildResult, print_table: bool = True) -> None:
    write_atomic(result.report_path, json.dumps(result.to_json(), indent=2) + "\n")
    if print_table:
        print(result.table())

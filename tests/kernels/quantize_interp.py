"""The INT8 search's Triton passes under the interpreter against its torch passes (CPU; one JSON line per case).

Not collected by pytest: tests/kernels/test_kernels.py runs it in a subprocess with TRITON_INTERPRET=1 (set
before Triton is imported)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

# name -> (rows, columns, how the rows are made)
CASES = {
    "ragged": (5, 300, "normal"),  # columns not a multiple of the kernels' blocks
    "heavy_tails": (6, 1100, "student"),  # the coarse ratios below 1 win here
    "special_rows": (4, 260, "special"),  # an all-zero row, a constant row, one outlier, a tiny row
    "transposed": (40, 300, "transposed"),  # a Conv1D master's [in, out] storage seen as [out, in]
}


def _rows(n: int, c: int, how: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(n * 1000 + c)
    if how == "normal":
        return torch.randn(n, c, generator=g) * 0.02
    if how == "student":
        return torch.distributions.StudentT(2.0).sample((n, c)) * 0.01
    if how == "transposed":
        return (torch.randn(c, n, generator=g) * 0.02).t()
    rows = torch.randn(n, c, generator=g) * 0.02
    rows[0] = 0.0
    rows[1] = 0.5
    rows[2, 7] = 3.0
    rows[3] *= 1e-20
    return rows


def run_case(name: str) -> dict:
    from torch_stagehand.kernels.quantize import KernelPasses, TorchPasses, _absmax_scale, _best_scale, _err

    rows = _rows(*CASES[name])
    base = _absmax_scale(rows)
    scales = base[:, None] * torch.tensor([1.0, 0.9, 0.55, 0.3])
    kern, ref = KernelPasses(), TorchPasses()
    errors_k, errors_t = kern.errors(rows, scales), ref.errors(rows, scales)
    (wq_k, qq_k), (wq_t, qq_t) = kern.refit_sums(rows, base), ref.refit_sums(rows, base)
    s_k, s_t = _best_scale(rows, kern), _best_scale(rows, ref)
    err_k, err_t = _err(rows, s_k), _err(rows, s_t)

    def rel(a, b):
        return ((a.double() - b.double()).abs() / b.double().abs().clamp_min(1e-30)).max().item()

    return dict(name=name, errors=rel(errors_k, errors_t), wq=rel(wq_k, wq_t), qq=rel(qq_k, qq_t),
                same_scales=(s_k == s_t).float().mean().item(), chosen_error=rel(err_k, err_t),
                absmax_error_ratio=(err_k / _err(rows, base).clamp_min(1e-30)).max().item())


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _helpers
    from _helpers import report_cases

    report_cases("quantize_interp.py", run_case, sys.argv[1:] or list(CASES))

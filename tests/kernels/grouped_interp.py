"""The grouped low-bit GEMM's Triton kernel against float64 under Triton's CPU interpreter.

Not collected by pytest: tests/kernels/test_grouped_experts.py runs it in a subprocess with TRITON_INTERPRET=1 (set
before Triton is imported) and asserts on the JSON lines it prints, one per case.
"""

from __future__ import annotations

import json
import os
import sys

import torch

# name -> (experts, stored rows R, columns C, tokens per expert, rows_are_out, weight dtype, tile or None)
CASES = {
    "out_int8_ragged": (5, 24, 40, [3, 0, 40, 1, 17], True, "int8", None),
    "in_int8_ragged": (5, 24, 40, [3, 0, 40, 1, 17], False, "int8", None),
    "out_fp8": (4, 32, 16, [9, 9, 0, 30], True, "float8_e4m3fn", None),
    "in_fp8": (4, 32, 16, [9, 9, 0, 30], False, "float8_e4m3fn", None),
    "twenty_experts_small_tiles": (20, 16, 24, [i % 3 for i in range(20)], True, "int8", (16, 16, 16, 4, 2)),
    "one_expert_many_tiles": (3, 8, 40, [0, 70, 0], False, "int8", (16, 16, 16, 4, 2)),
    "no_tokens": (3, 8, 16, [0, 0, 0], True, "int8", None),
}


def run(name: str) -> dict:
    from torch_stagehand.kernels.grouped import grouped_lowbit_triton

    experts, rows, cols, counts, rows_are_out, wdtype, tile = CASES[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    k = cols if rows_are_out else rows
    wide = torch.randn(experts, rows, cols, generator=gen)
    scale = wide.abs().amax(-1) / (127.0 if wdtype == "int8" else 448.0)
    q = (wide / scale.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8) if wdtype == "int8" else \
        (wide / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    total = int(offs[-1]) if counts else 0
    sentinel = 3  # rows past offs[-1] (expert-parallel sentinels): left as they were
    x = torch.randn(total + sentinel, k, generator=gen).to(torch.bfloat16)
    y = grouped_lowbit_triton(x, q, scale, offs, rows_are_out, tile)
    dense = q.double() * scale.double().unsqueeze(-1)
    from torch_stagehand.kernels.grouped import dequantized

    dequant_err = ((dequantized(q, scale, torch.float32).double() - dense).abs().max() / dense.abs().max()).item()
    b = dense.transpose(-2, -1) if rows_are_out else dense
    want = torch.zeros(total, b.shape[-1], dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        want[start:end] = x[start:end].double() @ b[e]
        start = end
    got = y[:total].double()
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item() if total else 0.0
    return dict(case=name, rel_err=err, dequant_err=dequant_err, shape=list(y.shape),
                finite=bool(torch.isfinite(got).all()))


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for case in sys.argv[1:] or CASES:
        print(json.dumps(run(case)), flush=True)

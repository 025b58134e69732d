"""Triton kernels vs their torch twins under Triton's CPU interpreter.

Not collected by pytest: tests/kernels/test_kernels.py runs `python tests/kernels/kernels_interp.py`
in a subprocess with TRITON_INTERPRET=1 (the variable must be set before Triton
is imported, which another test module may already have done in the parent) and
asserts on the JSON lines it prints, one per case. The launchers switch the
kernels to their fp32 compute path under the interpreter (its bf16 dot is wrong).
"""

from __future__ import annotations

import json
import os
import sys
import zlib

import torch

# name -> spec. lead: leading dims of the activation; layout: how the activation is
# laid out in memory; cfg: LaunchConfig fields (block_o, block_m, block_r, split[, warps,
# stages, trans_load]) or None for the launcher's own choice.
CASES = {}
for _m in (1, 7, 16, 33):
    CASES[f"fwd_bf16_m{_m}_pad_bias_gelu"] = dict(kind="fwd", lead=(_m,), k=45, kp=64, n=37, dtype="bfloat16", bias=True, act="gelu_tanh")
    CASES[f"bwd_bf16_m{_m}_pad"] = dict(kind="bwd", lead=(_m,), k=45, kp=64, n=37, dtype="bfloat16")
CASES.update({
    "fwd_fp16_nobias": dict(kind="fwd", lead=(7,), k=100, kp=100, n=70, dtype="float16"),
    "fwd_fp32": dict(kind="fwd", lead=(5,), k=40, kp=48, n=24, dtype="float32", bias=True),
    "fwd_fp16_bias_bf16_gelu": dict(kind="fwd", lead=(9,), k=50, kp=50, n=30, dtype="float16", bias=True, bias_dtype="bfloat16", act="gelu_tanh"),
    "fwd_lead_dims": dict(kind="fwd", lead=(2, 3, 5), k=40, kp=64, n=20, dtype="bfloat16", bias=True),
    "fwd_row_slice": dict(kind="fwd", lead=(2, 9), k=40, kp=40, n=20, dtype="bfloat16", layout="slice"),
    "fwd_transposed_lead": dict(kind="fwd", lead=(6, 4), k=40, kp=40, n=20, dtype="bfloat16", layout="transposed"),
    "fwd_three_strides": dict(kind="fwd", lead=(2, 3, 4), k=24, kp=32, n=20, dtype="bfloat16", layout="strided3"),
    "fwd_k_strided": dict(kind="fwd", lead=(5,), k=24, kp=24, n=20, dtype="bfloat16", layout="kstride"),
    "fwd_split3_ragged": dict(kind="fwd", lead=(33,), k=100, kp=128, n=37, dtype="bfloat16", bias=True, act="gelu_tanh", cfg=(16, 16, 16, 3)),
    "fwd_split2_even": dict(kind="fwd", lead=(7,), k=64, kp=64, n=40, dtype="bfloat16", bias=True, cfg=(16, 16, 16, 2)),
    "fwd_tiles_ragged": dict(kind="fwd", lead=(20,), k=70, kp=70, n=37, dtype="bfloat16", cfg=(16, 16, 32, 1)),
    "fwd_scale_in_registers": dict(kind="fwd", lead=(20,), k=70, kp=80, n=37, dtype="bfloat16", bias=True, act="gelu_tanh", cfg=(16, 16, 32, 1, 8, 3, 1)),
    "fwd_dequant_cublas": dict(kind="fwd", lead=(3, 7), k=70, kp=80, n=37, dtype="bfloat16", bias=True, act="gelu_tanh", cfg=(0, 0, 0, 1, 4, 3, 0, "dequant"), loose=True),
    "bwd_dequant_cublas": dict(kind="bwd", lead=(3, 7), k=70, kp=80, n=37, dtype="bfloat16", cfg=(0, 0, 0, 1, 4, 3, 0, "dequant"), loose=True),
    "fwd_empty_rows": dict(kind="fwd", lead=(0,), k=16, kp=16, n=8, dtype="bfloat16"),
    "bwd_fp16_full_k": dict(kind="bwd", lead=(7,), k=None, kp=50, n=70, dtype="float16"),
    "bwd_fp32": dict(kind="bwd", lead=(5,), k=40, kp=48, n=24, dtype="float32"),
    "bwd_lead_dims": dict(kind="bwd", lead=(2, 3, 5), k=40, kp=64, n=20, dtype="bfloat16"),
    "bwd_transposed_lead": dict(kind="bwd", lead=(6, 4), k=40, kp=40, n=20, dtype="bfloat16", layout="transposed"),
    "bwd_row_slice": dict(kind="bwd", lead=(2, 9), k=40, kp=40, n=20, dtype="bfloat16", layout="slice"),
    "bwd_split3_ragged": dict(kind="bwd", lead=(33,), k=45, kp=64, n=100, dtype="bfloat16", cfg=(16, 16, 16, 3)),
    "bwd_split2_trans": dict(kind="bwd", lead=(7,), k=48, kp=64, n=64, dtype="bfloat16", cfg=(16, 16, 16, 2, 4, 3, 1)),
    "bwd_trans_ragged": dict(kind="bwd", lead=(20,), k=45, kp=45, n=70, dtype="bfloat16", cfg=(32, 16, 16, 1, 4, 3, 1)),
    "bwd_empty_rows": dict(kind="bwd", lead=(0,), k=16, kp=16, n=8, dtype="bfloat16"),
})


def _activation(lead, k, dtype, layout, gen):
    """An activation [*lead, k] in the requested memory layout (values drawn from gen)."""
    if layout == "slice":  # rows of a wider buffer: row stride k + 24
        return torch.randn(*lead, k + 24, generator=gen).to(dtype)[..., :k]
    if layout == "transposed":  # leading dims swapped: two independent strides
        return torch.randn(*reversed(lead), k, generator=gen).to(dtype).transpose(0, 1)
    if layout == "strided3":  # three leading strides that cannot merge: the launcher copies
        return torch.randn(lead[0], lead[1] * 2, lead[2] + 3, k, generator=gen).to(dtype)[:, ::2, : lead[2]]
    if layout == "kstride":  # K itself strided
        return torch.randn(*lead, 2 * k, generator=gen).to(dtype)[..., ::2]
    return torch.randn(*lead, k, generator=gen).to(dtype)


def run_case(name, spec):
    from torch_stagehand.kernels import (
        LaunchConfig, int8_linear_grad_input_ref, int8_linear_grad_input_triton, int8_linear_ref, int8_linear_triton,
    )

    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # stable across runs
    dtype = getattr(torch, spec["dtype"])
    kp, n = spec["kp"], spec["n"]
    k = spec["k"] if spec["k"] is not None else kp
    q = torch.randint(-127, 128, (n, kp), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) * 0.02 + 1e-3
    cfg = LaunchConfig(*spec["cfg"]) if spec.get("cfg") else None
    layout = spec.get("layout", "contig")
    if spec["kind"] == "fwd":
        x = _activation(spec["lead"], k, dtype, layout, gen)
        bias = torch.randn(n, generator=gen).to(getattr(torch, spec.get("bias_dtype", spec["dtype"]))) if spec.get("bias") else None
        ref = int8_linear_ref(x, q, scale, bias, spec.get("act"))
        ref32 = int8_linear_ref(x.float(), q, scale, bias, spec.get("act"))
        abs_terms = int8_linear_ref(x.float().abs(), q.abs(), scale)  # sum of |x_i w_i| per output
        _poison(ref)
        out = int8_linear_triton(x, q, scale, bias, spec.get("act"), config=cfg)
    else:
        dy = _activation(spec["lead"], n, dtype, layout, gen)
        ref = int8_linear_grad_input_ref(dy, q, scale, spec["k"])
        ref32 = int8_linear_grad_input_ref(dy.float(), q, scale, spec["k"])
        abs_terms = int8_linear_grad_input_ref(dy.float().abs(), q.abs(), scale, spec["k"])
        _poison(ref)
        out = int8_linear_grad_input_triton(dy, q, scale, spec["k"], config=cfg)
    denom = ref.double().norm().item()
    err = (out.double() - ref.double()).norm().item() / denom if denom > 0 else (out.double().norm().item())
    # Elementwise: each output within one rounding of the fp32 result. One ulp, not half:
    # the interpreter rounds fp32 -> bf16 toward zero. The small absolute term covers
    # summation-order differences where terms cancel: measured up to 5.5e-9 of the largest
    # output (CPU, torch 2.13, every case).
    # Summation order alone moves a K-term fp32 dot by up to K * eps32 * sum(|terms|) (the classic bound),
    # which is what an element near cancellation shows: triton 3.9's interpreter sums in another order than
    # 3.6's (fp32 cases: 2.6e-7 over the older 1.5e-8-of-the-largest term).
    rtol = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-5}[dtype]
    atol = 1.5e-8 * ref32.abs().max().item() if ref32.numel() else 0.0
    order = (kp if spec["kind"] == "fwd" else n) * 2.0**-24 * abs_terms.double()  # terms per output
    excess = ((out.double() - ref32.double()).abs() - (rtol * ref32.double().abs() + atol + order)).max().item() \
        if out.numel() else -1.0
    return dict(
        name=name, err=err, max_excess=excess, loose=bool(spec.get("loose")), finite=bool(torch.isfinite(out).all()), shape=list(out.shape),
        ref_shape=list(ref.shape), dtype=str(out.dtype), ref_dtype=str(ref.dtype),
    )


def _poison(like):
    # Leave NaN in freed memory of the output's size, so unwritten elements show up.
    torch.full(like.shape, float("nan"), dtype=like.dtype)


def main(names):
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("kernels_interp.py: run with TRITON_INTERPRET=1")
    for name in names or CASES:
        try:
            rec = run_case(name, CASES[name])
        except Exception as e:  # reported per case; the parent test fails that case
            rec = dict(name=name, exception=f"{type(e).__name__}: {e}")
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

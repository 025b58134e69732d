"""AdamW for a weight whose states came to the GPU in their own format: one Triton kernel decodes the moments,
steps, and encodes them again, reading and writing each state byte once.

The formats are HostAdamW's (runtime/train/host.py): the moments in fp32, bf16 (stochastically rounded) or int8
(a scale per QBLOCK elements: `exp_avg` as codes of its absmax / 127, `exp_avg_sq` as codes of its square root's
absmax / 255, stochastically rounded, a nonzero one never encoded as 0); the weight stepped from an fp32 master
(rounded to nearest into the weight) or, with no master, in fp32 from the bf16 weight and written back with
stochastic rounding. The math is torch's fused AdamW (decoupled weight decay, bias corrections from the step
count). The random bits are Triton's (Philox, from `seed` and the element's index), not the host's generator: the
device and the host round alike in distribution, not bit for bit.
"""

from __future__ import annotations

import math

import torch

try:  # a broken Triton install must not break the host path: the device update is then refused
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAS_TRITON = False

QBLOCK = 128  # elements per scale of int8 moments (HostAdamW's)
ROWS = 8  # scale blocks a program steps: 1024 elements
_STATES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


def fused_adamw_(weight: torch.Tensor, grad: torch.Tensor, state: dict, lr: float, beta1: float, beta2: float,
                 eps: float, weight_decay: float, step: int, seed: int, write_weight: bool = True) -> None:
    """One AdamW step of the flat `weight` on its GPU, in place: `state` holds flat device tensors `exp_avg`,
    `exp_avg_sq` (fp32, bf16, or int8 / uint8 codes with `exp_avg_scale` / `exp_avg_sq_scale`, one fp32 a QBLOCK)
    and an fp32 `master` when the weight has one. `step`: the step count after this step (1 for the first).
    `write_weight=False`: a master's weight is left as it is."""
    n = weight.numel()
    m, v = state["exp_avg"], state["exp_avg_sq"]
    master = state.get("master")
    kind = _STATES.get(m.dtype)
    if kind is None or (kind == 2) != (v.dtype == torch.uint8) or (kind != 2 and v.dtype != m.dtype):
        raise ValueError(f"fused_adamw_: moments of dtypes {m.dtype} / {v.dtype} are not a HostAdamW state format")
    for name, t in (("grad", grad), ("exp_avg", m), ("exp_avg_sq", v), ("master", master)):
        if t is not None and (t.numel() != n or not t.is_contiguous()):
            raise ValueError(f"fused_adamw_: {name} has {t.numel()} elements (contiguous: {t.is_contiguous()}), "
                             f"the weight {n}")
    if weight.dtype not in (torch.float32, torch.bfloat16) or (master is not None and master.dtype != torch.float32):
        raise ValueError(f"fused_adamw_: a {weight.dtype} weight (master: "
                         f"{None if master is None else master.dtype}); the kernel steps fp32 or bf16 weights, "
                         f"with or without an fp32 master")
    scales = (state["exp_avg_scale"], state["exp_avg_sq_scale"]) if kind == 2 else (m, v)  # unread unless int8
    if kind == 2 and any(s.numel() != -(-n // QBLOCK) for s in scales):
        raise ValueError(f"fused_adamw_: int8 moments of {n} elements need {-(-n // QBLOCK)} scales a moment")
    if n == 0:
        return
    bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
    grid = (-(-n // (ROWS * QBLOCK)),)
    _adamw_kernel[grid](weight, grad, master if master is not None else weight, m, v, *scales, n,
                        lr, beta1, beta2, eps, lr * weight_decay, lr / bias1, math.sqrt(bias2), seed,
                        HAS_MASTER=master is not None, FP32_WEIGHT=weight.dtype == torch.float32, STATES=kind,
                        WRITE_WEIGHT=write_weight, QB=QBLOCK, ROWS=ROWS)


if HAS_TRITON:
    _TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny: a zero block's scale divisor

    @triton.jit
    def _to_bf16(x, random, STOCHASTIC: tl.constexpr):
        """fp32 -> bf16 through its bits (bf16 is fp32's upper half): a uniform 16-bit integer added before
        truncating rounds up with probability equal to the distance (unbiased); 0x7FFF plus the kept half's
        lowest bit rounds to nearest, ties to even. The value is then exact in bf16, whatever the conversion's mode."""
        bits = x.to(tl.int32, bitcast=True)
        if STOCHASTIC:
            add = (random & 0xFFFF).to(tl.int32)
        else:
            add = 0x7FFF + ((bits >> 16) & 1)
        return ((bits + add) & -65536).to(tl.float32, bitcast=True).to(tl.bfloat16)

    @triton.jit
    def _codes(x, scale, random, top):
        """floor(x / scale + U[0, 1)) clamped to [-top, top]: x / scale rounded up with probability equal to its
        fraction (the decoded value is unbiased)."""
        q = tl.floor(x / tl.maximum(scale, _TINY)[:, None] + tl.random.uint_to_uniform_float(random))
        return tl.minimum(tl.maximum(q, -top), top)

    @triton.jit(do_not_specialize=["seed"])  # a new seed each call: one compiled variant for all of them
    def _adamw_kernel(w_ptr, g_ptr, master_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, n, lr, beta1, beta2, eps, decay,
                      step_size, bias2_sqrt, seed, HAS_MASTER: tl.constexpr, FP32_WEIGHT: tl.constexpr,
                      STATES: tl.constexpr, WRITE_WEIGHT: tl.constexpr, QB: tl.constexpr, ROWS: tl.constexpr):
        """ROWS x QB elements a program; a row of the tile is one int8 scale block. One Philox draw an element
        gives the three random streams (the weight's, exp_avg's, exp_avg_sq's)."""
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        offs = rows[:, None] * QB + tl.arange(0, QB)[None, :]
        mask = offs < n
        r_weight, r_avg, r_avg_sq, _ = tl.randint4x(seed, offs)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_MASTER:
            p = tl.load(master_ptr + offs, mask=mask, other=0.0)
        else:
            p = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if STATES == 2:
            block_mask = rows * QB < n
            m = tl.load(m_ptr + offs, mask=mask, other=0).to(tl.float32) \
                * tl.load(ms_ptr + rows, mask=block_mask, other=0.0)[:, None]
            root = tl.load(v_ptr + offs, mask=mask, other=0).to(tl.float32) \
                * tl.load(vs_ptr + rows, mask=block_mask, other=0.0)[:, None]
            v = root * root
        else:
            m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # torch's fused AdamW: decay, moments, then the step with the bias-corrected denominator
        p = p - decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - step_size * (m / (tl.sqrt(v) / bias2_sqrt + eps))
        if STATES == 2:
            m_scale = tl.max(tl.abs(m), axis=1) / 127.0
            tl.store(m_ptr + offs, _codes(m, m_scale, r_avg, 127.0).to(tl.int8), mask=mask)
            tl.store(ms_ptr + rows, m_scale, mask=block_mask)
            root = tl.sqrt(v)
            v_scale = tl.max(root, axis=1) / 255.0
            q = _codes(root, v_scale, r_avg_sq, 255.0)
            q = tl.where(v > 0, tl.maximum(q, 1.0), q)  # a nonzero moment never decodes to 0 (a step of lr / eps)
            tl.store(v_ptr + offs, q.to(tl.uint8), mask=mask)
            tl.store(vs_ptr + rows, v_scale, mask=block_mask)
        elif STATES == 1:
            tl.store(m_ptr + offs, _to_bf16(m, r_avg, True), mask=mask)
            tl.store(v_ptr + offs, _to_bf16(v, r_avg_sq, True), mask=mask)
        else:
            tl.store(m_ptr + offs, m, mask=mask)
            tl.store(v_ptr + offs, v, mask=mask)
        if HAS_MASTER:
            tl.store(master_ptr + offs, p, mask=mask)
        if WRITE_WEIGHT or not HAS_MASTER:
            if FP32_WEIGHT:
                tl.store(w_ptr + offs, p, mask=mask)
            elif HAS_MASTER:  # to nearest from the master, as the host rounds it
                tl.store(w_ptr + offs, _to_bf16(p, r_weight, False), mask=mask)
            else:
                tl.store(w_ptr + offs, _to_bf16(p, r_weight, True), mask=mask)

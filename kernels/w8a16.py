"""Fused W8A16 Triton kernels: int8 weight x bf16/fp16 activation, fp32 accumulation.

Forward   y  = (x @ q[:, :K].T) * scale + bias  (optional tanh-GeLU), K = x.shape[-1]
Grad-in   dx = (dy * scale) @ q[:, :k]

Both compute the TRANSPOSED output tile, the weight as the LEFT `tl.dot` operand (on Hopper only wgmma's A operand
may come from registers, where the int8 is converted). Small M may split the reduction (SPLIT > 1: fp32 partials,
then a kernel sums them and applies the epilogue). `F32=True`: fp32 math, for the interpreter and fp32 activations.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gelu_tanh(v):
    # x * sigmoid(2u) is 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3): no libdevice tanh to interpret.
    u = 0.7978845608028654 * (v + 0.044715 * v * v * v)
    return v * tl.sigmoid(2.0 * u)


# int8 -> fp32 (the register-scaled paths) compiles to I2F, a quarter-rate instruction. FAST=True (grad-input only,
# where it is faster) uses full-rate byte permutes and one fp32 subtract, four int8 per call:
#   u = q ^ 0x80 (= q + 128 unsigned) in the low byte of 2^23 gives the fp32 2^23 + u; minus (2^23 + 128) leaves q.
# The CPU interpreter cannot run inline PTX: it takes FAST=False.

_PTX_I8_TO_F32 = tl.constexpr("""{
.reg .b32 u;
xor.b32 u, $4, 0x80808080;
prmt.b32 $0, u, 0x4B000000, 0x7650;
prmt.b32 $1, u, 0x4B000000, 0x7651;
prmt.b32 $2, u, 0x4B000000, 0x7652;
prmt.b32 $3, u, 0x4B000000, 0x7653;
sub.f32 $0, $0, 0f4B000080;
sub.f32 $1, $1, 0f4B000080;
sub.f32 $2, $2, 0f4B000080;
sub.f32 $3, $3, 0f4B000080;
}""")


@triton.jit
def _int8_to_f32(w, FAST: tl.constexpr):
    if FAST:
        return tl.inline_asm_elementwise(_PTX_I8_TO_F32, "=r,=r,=r,=r,r", [w], dtype=tl.float32, is_pure=True, pack=4)
    else:
        return w.to(tl.float32)


@triton.jit
def _convert_kernel(q_ptr, out_ptr, n, BLOCK: tl.constexpr, FAST: tl.constexpr):
    """out[i] = fp32(q[i]) through _int8_to_f32 (tests the conversion on its own)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    q = tl.load(q_ptr + offs, mask=ok, other=0)
    tl.store(out_ptr + offs, _int8_to_f32(q, FAST), mask=ok)


@triton.jit
def _tile_ids(N_OUT, M, BLOCK_O: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
    # GROUP weight tiles walk the token tiles together: the activation tiles they share stay in L2.
    pid = tl.program_id(0)
    num_o = tl.cdiv(N_OUT, BLOCK_O)
    num_m = tl.cdiv(M, BLOCK_M)
    in_group = GROUP * num_m
    first = (pid // in_group) * GROUP
    size = tl.minimum(num_o - first, GROUP)
    pid_o = first + (pid % in_group) % size
    pid_m = (pid % in_group) // size
    return pid_o, pid_m


@triton.jit
def _row_offsets(offs_m, M, T, stride_b, stride_t):
    # Rows past M wrap to valid rows (masked at the store): the main loop's loads need no mask along M.
    m = offs_m % M
    b = m // T
    t = m - b * T
    return b.to(tl.int64) * stride_b + t.to(tl.int64) * stride_t


# M and T change with every batch shape and never feed a vectorized address: not specialized.
@triton.jit(do_not_specialize=["M", "T"])
def _fwd_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ws_ptr,
    M, N, K, T, stride_xb, stride_xt, stride_xk, stride_wn,
    K_SPLIT,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, F32: tl.constexpr,
    SCALE_A: tl.constexpr = False,
):
    """acc[BLOCK_N, BLOCK_M] = W[n, k] @ X^T[k, m] over this program's K range; with a split grid the fp32 sum
    goes to ws_ptr[pid_k, m, n] (a run-time branch: one binary for every split), else the epilogue stores y[m, n].
    SCALE_A (unsplit only) scales the weight tile in registers (the autotuner may prefer it)."""
    pid_n, pid_m = _tile_ids(N, M, BLOCK_N, BLOCK_M, GROUP)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    rn = offs_n % N  # wrapped like the rows of x: no load mask along N
    x_rows = _row_offsets(offs_m, M, T, stride_xb, stride_xt)

    # The loop bound is the K_SPLIT argument (one computed from program ids breaks older interpreters).
    k_lo = pid_k * K_SPLIT
    k_left = K - k_lo
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    x_ptrs = x_ptr + x_rows[None, :] + (k_lo + offs_k).to(tl.int64)[:, None] * stride_xk
    cdt: tl.constexpr = tl.float32 if F32 else x_ptr.dtype.element_ty

    if SCALE_A:
        s_rows = tl.load(s_ptr + rn)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kk in range(0, K_SPLIT, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            xt = tl.load(x_ptrs)
        else:
            # Mask both: without K padding, the weight's columns past K are the next row.
            k_ok = offs_k < k_left - kk
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0)
            xt = tl.load(x_ptrs, mask=k_ok[:, None], other=0.0)
        if SCALE_A:
            a = (w.to(tl.float32) * s_rows[:, None]).to(cdt)
        else:
            a = w.to(cdt)
        if F32:
            acc = tl.dot(a, xt.to(cdt), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, xt, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K * stride_xk

    n_ok = offs_n < N
    m_ok = offs_m < M
    if tl.num_programs(1) > 1:
        # (names differ from the other branch: Triton wants one type per name)
        p_ptrs = ws_ptr + pid_k.to(tl.int64) * M * N + offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
        tl.store(p_ptrs, acc, mask=n_ok[:, None] & m_ok[None, :])
    else:
        if not SCALE_A:
            acc = acc * tl.load(s_ptr + rn)[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn).to(tl.float32)[:, None]
        if ACT == 1:
            acc = _gelu_tanh(acc)
        y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _fwd_reduce_kernel(
    ws_ptr, s_ptr, b_ptr, y_ptr, MN, N, SPLIT,
    BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
):
    """y[m, n] = epilogue(sum_s ws[s, m, n]) over the flat M*N index."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    n = offs % N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLIT):
        acc += tl.load(ws_ptr + s * MN + offs, mask=ok, other=0.0)
    acc = acc * tl.load(s_ptr + n, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
    if ACT == 1:
        acc = _gelu_tanh(acc)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M", "T"])
def _bwd_kernel(
    dy_ptr, w_ptr, s_ptr, dx_ptr, ws_ptr,
    M, N, KO, T, stride_yb, stride_yt, stride_yn, stride_wn,
    N_SPLIT,
    BLOCK_O: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, GROUP: tl.constexpr,
    EVEN_R: tl.constexpr, EVEN_O: tl.constexpr, TRANS_LOAD: tl.constexpr, F32: tl.constexpr,
    FAST_CVT: tl.constexpr = False,
):
    """acc[BLOCK_O, BLOCK_M] = (W^T * scale)[o, n] @ dY^T[n, m], reducing over N: the row scale multiplies the
    weight tile in registers. TRANS_LOAD loads it [n, o] and transposes, else [o, n]; the autotuner tries both."""
    pid_o, pid_m = _tile_ids(KO, M, BLOCK_O, BLOCK_M, GROUP)
    pid_r = tl.program_id(1)
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    # O is the weight's contiguous dim: a ragged edge is masked, not wrapped with % (which would hide the
    # contiguity and turn 16-byte copies into byte copies). EVEN_O: no edge.
    o_ok = offs_o < KO
    y_rows = _row_offsets(offs_m, M, T, stride_yb, stride_yt)

    r_lo = pid_r * N_SPLIT
    r_left = N - r_lo
    r_idx = r_lo + offs_r
    if TRANS_LOAD:
        w_ptrs = w_ptr + r_idx.to(tl.int64)[:, None] * stride_wn + offs_o[None, :]
    else:
        w_ptrs = w_ptr + offs_o[:, None] + r_idx.to(tl.int64)[None, :] * stride_wn
    s_ptrs = s_ptr + r_idx
    y_ptrs = dy_ptr + y_rows[None, :] + r_idx.to(tl.int64)[:, None] * stride_yn
    cdt: tl.constexpr = tl.float32 if F32 else dy_ptr.dtype.element_ty

    acc = tl.zeros((BLOCK_O, BLOCK_M), dtype=tl.float32)
    for rr in range(0, N_SPLIT, BLOCK_R):
        if EVEN_R:
            s = tl.load(s_ptrs)
            g = tl.load(y_ptrs)
            if EVEN_O:
                w = tl.load(w_ptrs)
            elif TRANS_LOAD:
                w = tl.load(w_ptrs, mask=o_ok[None, :], other=0)
            else:
                w = tl.load(w_ptrs, mask=o_ok[:, None], other=0)
        else:
            r_ok = offs_r < r_left - rr
            s = tl.load(s_ptrs, mask=r_ok, other=0.0)
            g = tl.load(y_ptrs, mask=r_ok[:, None], other=0.0)
            if TRANS_LOAD:
                w = tl.load(w_ptrs, mask=r_ok[:, None] & o_ok[None, :], other=0)
            else:
                w = tl.load(w_ptrs, mask=o_ok[:, None] & r_ok[None, :], other=0)
        if TRANS_LOAD:
            a = tl.trans((_int8_to_f32(w, FAST_CVT) * s[:, None]).to(cdt))
        else:
            a = (_int8_to_f32(w, FAST_CVT) * s[None, :]).to(cdt)
        if F32:
            acc = tl.dot(a, g.to(cdt), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, g, acc)
        w_ptrs += BLOCK_R * stride_wn
        s_ptrs += BLOCK_R
        y_ptrs += BLOCK_R * stride_yn

    m_ok = offs_m < M
    if tl.num_programs(1) > 1:
        p_ptrs = ws_ptr + pid_r.to(tl.int64) * M * KO + offs_m.to(tl.int64)[None, :] * KO + offs_o[:, None]
        tl.store(p_ptrs, acc, mask=o_ok[:, None] & m_ok[None, :])
    else:
        out = dx_ptr + offs_m.to(tl.int64)[None, :] * KO + offs_o[:, None]
        tl.store(out, acc.to(dx_ptr.dtype.element_ty), mask=o_ok[:, None] & m_ok[None, :])


@triton.jit
def _bwd_reduce_kernel(ws_ptr, dx_ptr, MN, SPLIT, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLIT):
        acc += tl.load(ws_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(dx_ptr + offs, acc.to(dx_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, out_ptr, N, K, stride_qn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[n, k] = q[n, k] * scale[n] in out's dtype, k < K (the dequantize + cuBLAS path); int8 or fp8 rows."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    ok = n_ok[:, None] & (offs_k < K)[None, :]
    # No `other=`: masked lanes are never stored, and a constant can not be cast to fp8 (grouped stacks).
    q = tl.load(q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn + offs_k[None, :], mask=ok)
    s = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)
    out = (q.to(tl.float32) * s[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], out, mask=ok)

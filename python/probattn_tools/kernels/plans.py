"""Triton kernels of the deterministic plans (softmax, DNAS, and any plan of theirs with another
score scale): attention without the (S_q, S_k) matrix, one (query block × key block) tile on chip
at a time with online log-sum-exps, so that only O(S) statistics reach global memory.

A plan's weights are `p_ij = exp(z_ij − c_j − r_i)` over the allowed entries, with
`z_ij = s · q_i·k_j`, `s = score_scale / sqrt(d)` (docs/formulas.md; PAPER-NOTES §5):
- `sweeps = 0` (softmax): `c = 0`, `r_i = LSE_j z_ij`;
- `sweeps = 1` (DNAS): `c_j = LSE_i z_ij` over the queries (the column pass), then
  `r_i = LSE_j (z_ij − c_j)` (the row pass);
- hybrid (HNAS): `u·p_DNAS + (1 − u)·p_softmax` per head, `u = sigmoid(logit)`, both row passes'
  accumulators kept in one pass over the tiles (`hybrid_attention`);
- `sweeps = N ≥ 2` (Sinkhorn-N): a column and a row potential per sweep (below, `_sink_reduce`).

The kernels:
- `_column_pass`: per key, `c_j` over the queries (no value product);
- `_row_pass`: the output `O = p v` and `r_i`, with `c` subtracted (none for softmax);
- `_key_pass` (backward): per key block over the queries, `dV = pᵀ dO`, `g_j = Σ_i dS¹_ij` and
  `dK`, with DNAS's column correction; and the received mass `Σ_i p_ij` when asked;
- `_query_pass` (backward): `dQ`, with the correction `dz_ij = dS¹_ij − exp(z_ij − c_j) g_j`.

Here `dS¹ = p ∘ (dO vᵀ − D)`, `D_i = Σ_d dO_id O_id`: FlashAttention-2's recomputed backward;
the column correction is the gradient through `c_j` (one extra term in each backward pass).

Masks: key padding `(B, S_k)` and query padding `(B, S_q)` (True = excluded), causal (top-left,
`j ≤ i`, as SDPA's `is_causal`; refused for plans with sweeps: a column sweep reads every query).
Grouped key/value heads (GQA) by index: query head `h` reads key/value head `h // (H / H_kv)`, and
the key pass sums the group's gradients in one program, without atomics or copies. Inputs in
bfloat16 or float16 take float32 products and statistics; float32 takes float32; float64 takes
float64 (the interpreter's and the tests' precision). A row with no allowed key gets a zero output
and zero gradients; a key no allowed query sees receives nothing.

`TRITON_INTERPRET=1` runs these kernels on the CPU (the tests do: python/tests/test_kernels.py).
"""

import math

import torch
import triton
import triton.language as tl

# A finite floor for the running maxima: a fully masked block then leaves them finite, and
# exp(-inf − floor) is exactly 0 where exp(-inf − -inf) would be NaN.
FLOOR = -1.0e30


@triton.jit
def _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad,
             HAS_QPAD: tl.constexpr, HAS_KPAD: tl.constexpr, CAUSAL: tl.constexpr):
    """(BLOCK_M, BLOCK_N): which (query, key) pairs of the tile take part."""
    ok = (offs_m[:, None] < S_Q) & (offs_n[None, :] < S_K)
    if HAS_QPAD:
        qpad = tl.load(QPAD + b * stride_qpad + offs_m, mask=offs_m < S_Q, other=1)
        ok = ok & (qpad[:, None] == 0)
    if HAS_KPAD:
        kpad = tl.load(KPAD + b * stride_kpad + offs_n, mask=offs_n < S_K, other=1)
        ok = ok & (kpad[None, :] == 0)
    if CAUSAL:
        ok = ok & (offs_n[None, :] <= offs_m[:, None])
    return ok


@triton.jit
def _column_pass(Q, K, C, QPAD, KPAD,
                 stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                 stride_cb, stride_ch, stride_qpad, stride_kpad,
                 H, GROUP, S_Q, S_K, D, SCALE,
                 HAS_QPAD: tl.constexpr, HAS_KPAD: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """c_j = LSE_i z_ij over the allowed queries, one key block per program (axis 0), one
    (batch, query head) per axis 1. A key with no allowed query gets FLOOR (never read)."""
    scale = tl.load(SCALE).to(ACC)
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = tl.load(K + b * stride_kb + (h // GROUP) * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
                mask=(offs_n[:, None] < S_K) & (offs_d[None, :] < D), other=0.0)
    m = tl.full([BLOCK_N], FLOOR, dtype=ACC)
    l = tl.zeros([BLOCK_N], dtype=ACC)
    for start_m in range(0, S_Q, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                    mask=(offs_m[:, None] < S_Q) & (offs_d[None, :] < D), other=0.0)
        z = tl.dot(q, tl.trans(k), out_dtype=ACC, input_precision=DOT) * scale  # (BLOCK_M, BLOCK_N)
        ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad, HAS_QPAD, HAS_KPAD, False)
        z = tl.where(ok, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 0))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[None, :]), 0)
        m = m_new
    c = tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), FLOOR)
    tl.store(C + b * stride_cb + h * stride_ch + offs_n, c, mask=offs_n < S_K)


@triton.jit
def _row_pass(Q, K, V, C, O, R, O2, R2, QPAD, KPAD,
              stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
              stride_ob, stride_oh, stride_os, stride_cb, stride_ch, stride_rb, stride_rh, stride_qpad, stride_kpad,
              H, GROUP, S_Q, S_K, D, DV, SCALE,
              SWEEPS: tl.constexpr, HYBRID: tl.constexpr, HAS_QPAD: tl.constexpr, HAS_KPAD: tl.constexpr,
              CAUSAL: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """O_i = Σ_j p_ij v_j and r_i = LSE_j (z_ij − c_j), one query block per program. HYBRID (HNAS)
    keeps softmax's accumulators beside the plan's over the same tiles, one load of each key and
    value block for both, and writes softmax's output and row statistic to O2 and R2 (laid out as
    O and R)."""
    scale = tl.load(SCALE).to(ACC)
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=(offs_m[:, None] < S_Q) & (offs_d[None, :] < D), other=0.0)
    m = tl.full([BLOCK_M], FLOOR, dtype=ACC)
    l = tl.zeros([BLOCK_M], dtype=ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=ACC)
    m2 = tl.full([BLOCK_M], FLOOR, dtype=ACC)
    l2 = tl.zeros([BLOCK_M], dtype=ACC)
    acc2 = tl.zeros([BLOCK_M, BLOCK_DV], dtype=ACC)
    end_n = S_K
    if CAUSAL:
        end_n = tl.minimum(S_K, start_m + BLOCK_M)  # blocks wholly above the diagonal are skipped
    for start_n in range(0, end_n, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(K + b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
                    mask=(offs_n[:, None] < S_K) & (offs_d[None, :] < D), other=0.0)
        v = tl.load(V + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vs + offs_dv[None, :],
                    mask=(offs_n[:, None] < S_K) & (offs_dv[None, :] < DV), other=0.0)
        ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad, HAS_QPAD, HAS_KPAD, CAUSAL)
        z0 = tl.dot(q, tl.trans(k), out_dtype=ACC, input_precision=DOT) * scale
        z = z0
        if SWEEPS > 0:
            c = tl.load(C + b * stride_cb + h * stride_ch + offs_n, mask=offs_n < S_K, other=0.0)
            z = z0 - c[None, :]
        z = tl.where(ok, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 1))
        p = tl.exp(z - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=ACC, input_precision=DOT)
        m = m_new
        if HYBRID:
            z0 = tl.where(ok, z0, float("-inf"))
            m2_new = tl.maximum(m2, tl.max(z0, 1))
            p2 = tl.exp(z0 - m2_new[:, None])
            alpha2 = tl.exp(m2 - m2_new)
            l2 = l2 * alpha2 + tl.sum(p2, 1)
            acc2 = acc2 * alpha2[:, None] + tl.dot(p2.to(v.dtype), v, out_dtype=ACC, input_precision=DOT)
            m2 = m2_new
    _finish_row(O, R, acc, m, l, b, h, offs_m, offs_dv, S_Q, DV, stride_ob, stride_oh, stride_os, stride_rb, stride_rh)
    if HYBRID:
        _finish_row(O2, R2, acc2, m2, l2, b, h, offs_m, offs_dv, S_Q, DV, stride_ob, stride_oh, stride_os, stride_rb,
                    stride_rh)


@triton.jit
def _finish_row(O, R, acc, m, l, b, h, offs_m, offs_dv, S_Q, DV, stride_ob, stride_oh, stride_os, stride_rb, stride_rh):
    """Writes a row pass's output acc / l and its row statistic m + log l (0 for an empty row,
    whose statistic is never read)."""
    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    r = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), 0.0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_dv[None, :],
             out.to(O.dtype.element_ty), mask=(offs_m[:, None] < S_Q) & (offs_dv[None, :] < DV))
    tl.store(R + b * stride_rb + h * stride_rh + offs_m, r, mask=offs_m < S_Q)


@triton.jit
def _key_pass(Q, K, V, C, R, DO, DELTA, DK, DV_OUT, G, MASS, QPAD, KPAD,
              stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
              stride_dob, stride_doh, stride_dos, stride_cb, stride_ch, stride_rb, stride_rh,
              stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs, stride_qpad, stride_kpad,
              H_KV, GROUP, S_Q, S_K, D, DV, SCALE,
              SWEEPS: tl.constexpr, HAS_QPAD: tl.constexpr, HAS_KPAD: tl.constexpr, CAUSAL: tl.constexpr,
              GRADS: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One key block of one (batch, key/value head) per program, over its group's query heads
    and every query block: dV, dK (with DNAS's correction), g_j per query head (for the query
    pass) and, with GRADS off, only the received mass Σ_i p_ij per query head."""
    scale = tl.load(SCALE).to(ACC)
    start_n = tl.program_id(0) * BLOCK_N
    bk = tl.program_id(1)
    b, kvh = bk // H_KV, bk % H_KV
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = tl.load(K + b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
                mask=(offs_n[:, None] < S_K) & (offs_d[None, :] < D), other=0.0)
    v = tl.load(V + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vs + offs_dv[None, :],
                mask=(offs_n[:, None] < S_K) & (offs_dv[None, :] < DV), other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=ACC)
    start_m0 = 0
    if CAUSAL:
        start_m0 = (start_n // BLOCK_M) * BLOCK_M  # query blocks wholly above the diagonal see none of these keys
    for i in range(0, GROUP):
        h = kvh * GROUP + i
        c = tl.zeros([BLOCK_N], dtype=ACC)
        if SWEEPS > 0:
            c = tl.load(C + b * stride_cb + h * stride_ch + offs_n, mask=offs_n < S_K, other=0.0)
        g = tl.zeros([BLOCK_N], dtype=ACC)
        mass = tl.zeros([BLOCK_N], dtype=ACC)
        dk_main = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
        dk_corr = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
        for start_m in range(start_m0, S_Q, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                        mask=(offs_m[:, None] < S_Q) & (offs_d[None, :] < D), other=0.0)
            r = tl.load(R + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
            z = tl.dot(q, tl.trans(k), out_dtype=ACC, input_precision=DOT) * scale - c[None, :]
            ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad, HAS_QPAD, HAS_KPAD, CAUSAL)
            p = tl.where(ok, tl.exp(tl.where(ok, z - r[:, None], 0.0)), 0.0)  # (BLOCK_M, BLOCK_N)
            mass += tl.sum(p, 0)
            if GRADS:
                do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_dv[None, :],
                             mask=(offs_m[:, None] < S_Q) & (offs_dv[None, :] < DV), other=0.0)
                delta = tl.load(DELTA + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
                dv += tl.dot(tl.trans(p).to(do.dtype), do, out_dtype=ACC, input_precision=DOT)
                dp = tl.dot(do, tl.trans(v), out_dtype=ACC, input_precision=DOT)
                ds = p * (dp - delta[:, None])
                dk_main += tl.dot(tl.trans(ds).to(q.dtype), q, out_dtype=ACC, input_precision=DOT)
                if SWEEPS > 0:
                    g += tl.sum(ds, 0)
                    pc = tl.where(ok, tl.exp(tl.where(ok, z, 0.0)), 0.0)  # exp(z_ij − c_j): the column weights
                    dk_corr += tl.dot(tl.trans(pc).to(q.dtype), q, out_dtype=ACC, input_precision=DOT)
        if GRADS:
            dk += dk_main - g[:, None] * dk_corr
            if SWEEPS > 0:
                tl.store(G + b * stride_cb + h * stride_ch + offs_n, g, mask=offs_n < S_K)
        else:
            tl.store(MASS + b * stride_cb + h * stride_ch + offs_n, mass, mask=offs_n < S_K)
    if GRADS:
        tl.store(DK + b * stride_dkb + kvh * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :],
                 (dk * scale).to(DK.dtype.element_ty), mask=(offs_n[:, None] < S_K) & (offs_d[None, :] < D))
        tl.store(DV_OUT + b * stride_dvb + kvh * stride_dvh + offs_n[:, None] * stride_dvs + offs_dv[None, :],
                 dv.to(DV_OUT.dtype.element_ty), mask=(offs_n[:, None] < S_K) & (offs_dv[None, :] < DV))


@triton.jit
def _query_pass(Q, K, V, C, R, DO, DELTA, G, DQ, QPAD, KPAD,
                stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                stride_dob, stride_doh, stride_dos, stride_cb, stride_ch, stride_rb, stride_rh,
                stride_dqb, stride_dqh, stride_dqs, stride_qpad, stride_kpad,
                H, GROUP, S_Q, S_K, D, DV, SCALE,
                SWEEPS: tl.constexpr, HAS_QPAD: tl.constexpr, HAS_KPAD: tl.constexpr, CAUSAL: tl.constexpr,
                ACC: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr):
    """dQ_i = s Σ_j dz_ij k_j, dz_ij = dS¹_ij − exp(z_ij − c_j) g_j, one query block per program."""
    scale = tl.load(SCALE).to(ACC)
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=(offs_m[:, None] < S_Q) & (offs_d[None, :] < D), other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_dv[None, :],
                 mask=(offs_m[:, None] < S_Q) & (offs_dv[None, :] < DV), other=0.0)
    r = tl.load(R + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
    delta = tl.load(DELTA + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    end_n = S_K
    if CAUSAL:
        end_n = tl.minimum(S_K, start_m + BLOCK_M)
    for start_n in range(0, end_n, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(K + b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
                    mask=(offs_n[:, None] < S_K) & (offs_d[None, :] < D), other=0.0)
        v = tl.load(V + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vs + offs_dv[None, :],
                    mask=(offs_n[:, None] < S_K) & (offs_dv[None, :] < DV), other=0.0)
        z = tl.dot(q, tl.trans(k), out_dtype=ACC, input_precision=DOT) * scale
        if SWEEPS > 0:
            c = tl.load(C + b * stride_cb + h * stride_ch + offs_n, mask=offs_n < S_K, other=0.0)
            z = z - c[None, :]
        ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad, HAS_QPAD, HAS_KPAD, CAUSAL)
        p = tl.where(ok, tl.exp(tl.where(ok, z - r[:, None], 0.0)), 0.0)
        dp = tl.dot(do, tl.trans(v), out_dtype=ACC, input_precision=DOT)
        ds = p * (dp - delta[:, None])
        if SWEEPS > 0:
            g = tl.load(G + b * stride_cb + h * stride_ch + offs_n, mask=offs_n < S_K, other=0.0)
            ds -= tl.where(ok, tl.exp(tl.where(ok, z, 0.0)), 0.0) * g[None, :]
        dq += tl.dot(ds.to(k.dtype), k, out_dtype=ACC, input_precision=DOT)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=(offs_m[:, None] < S_Q) & (offs_d[None, :] < D))


# ---------------------------------------------------------------------------------------------
# The launches, and an autograd function over them.

_ACC = {torch.float64: tl.float64, torch.float32: tl.float32, torch.bfloat16: tl.float32, torch.float16: tl.float32}
# The statistics' dtype (c, r, g, D, the received mass).
_STATS = {torch.float64: torch.float64, torch.float32: torch.float32, torch.bfloat16: torch.float32, torch.float16: torch.float32}


class Config:
    """Block shapes and launch settings (the tuning knobs; the tests use small blocks)."""

    def __init__(self, block_m=64, block_n=64, num_warps=4, num_stages=2):
        self.block_m, self.block_n, self.num_warps, self.num_stages = block_m, block_n, num_warps, num_stages


def _block_dim(n):
    """A head dimension's block: the next power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(n))


def _pad_arg(mask, batch, length, name, device):
    """A (B, S) boolean padding mask (True = excluded) as uint8, or a dummy and False."""
    if mask is None:
        return torch.zeros(1, dtype=torch.uint8, device=device), 0, False
    if mask.dtype != torch.bool or tuple(mask.shape) != (batch, length):
        raise ValueError(f"{name} must be a boolean tensor of shape ({batch}, {length}), got {mask.dtype} {tuple(mask.shape)}")
    mask = mask.to(torch.uint8).contiguous()
    return mask, mask.stride(0), True


def _check(q, k, v, sweeps, causal):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k and v must be (B, H, S, d), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in _ACC or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one of {sorted(str(t) for t in _ACC)}, got {q.dtype}, {k.dtype}, {v.dtype}")
    (b, h, _, d), (bk, hk, sk, dk), (bv, hv, sv, _) = q.shape, k.shape, v.shape
    if (bk, dk) != (b, d) or (bv, hv, sv) != (bk, hk, sk):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not fit together")
    if hk < 1 or h % hk:
        raise ValueError(f"the query heads ({h}) must be a multiple of the key/value heads ({hk})")
    if not isinstance(sweeps, int) or sweeps < 0:
        raise ValueError(f"sweeps must be a whole number of column/row sweeps, 0 or more, got {sweeps!r}")
    if causal and sweeps:
        raise ValueError("a causal mask with a column sweep would let later queries change earlier ones' weights")


def _dot_precision(dtype):
    # float32 products in TF32 only where libtorch allows it, as its own kernels do.
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32" if dtype == torch.float32 else "ieee"


def forward(q, k, v, sweeps=1, score_scale=1.0, key_padding_mask=None, query_padding_mask=None, causal=False,
            config=None, hybrid=False):
    """(output, c, r): the plan's output (B, H, S_q, d_v) and its statistics, without a graph.
    With `hybrid` (HNAS), (output, c, r, softmax's output, softmax's r) from the same row pass."""
    _check(q, k, v, sweeps, causal)
    if sweeps > 1:
        raise ValueError(f"forward serves plans of 0 or 1 sweeps; {sweeps} sweeps take sinkhorn_forward")
    if hybrid and not sweeps:
        raise ValueError("a hybrid plan mixes a plan with sweeps and softmax: sweeps must be 1")
    config = config or Config()
    (b, h, s_q, d), (_, h_kv, s_k, _), dv = q.shape, k.shape, v.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    stats = _STATS[q.dtype]
    scale = torch.tensor([score_scale / math.sqrt(d)], dtype=stats, device=q.device)
    qpad, sqp, has_qpad = _pad_arg(query_padding_mask, b, s_q, "query_padding_mask", q.device)
    kpad, skp, has_kpad = _pad_arg(key_padding_mask, b, s_k, "key_padding_mask", q.device)
    c = torch.zeros(b, h, s_k, dtype=stats, device=q.device)
    common = dict(ACC=_ACC[q.dtype], DOT=_dot_precision(q.dtype), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                  BLOCK_D=_block_dim(d), num_warps=config.num_warps, num_stages=config.num_stages)
    if sweeps:
        _column_pass[(triton.cdiv(s_k, config.block_n), b * h)](
            q, k, c, qpad, kpad, *q.stride()[:3], *k.stride()[:3], *c.stride()[:2], sqp, skp,
            h, h // h_kv, s_q, s_k, d, scale, HAS_QPAD=has_qpad, HAS_KPAD=has_kpad, **common)
    out = torch.empty(b, h, s_q, dv, dtype=q.dtype, device=q.device)
    r = torch.empty(b, h, s_q, dtype=stats, device=q.device)
    out2, r2 = (torch.empty_like(out), torch.empty_like(r)) if hybrid else (out, r)
    _row_pass[(triton.cdiv(s_q, config.block_m), b * h)](
        q, k, v, c, out, r, out2, r2, qpad, kpad, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        *c.stride()[:2], *r.stride()[:2], sqp, skp, h, h // h_kv, s_q, s_k, d, dv, scale,
        SWEEPS=sweeps, HYBRID=hybrid, HAS_QPAD=has_qpad, HAS_KPAD=has_kpad, CAUSAL=causal,
        BLOCK_DV=_block_dim(dv), **common)
    return (out, c, r, out2, r2) if hybrid else (out, c, r)


def _key_launch(q, k, v, c, r, do, delta, grads, sweeps, score_scale, pads, causal, config):
    (b, h, s_q, d), (_, h_kv, s_k, _), dv = q.shape, k.shape, v.shape[-1]
    stats = _STATS[q.dtype]
    scale = torch.tensor([score_scale / math.sqrt(d)], dtype=stats, device=q.device)
    (qpad, sqp, has_qpad), (kpad, skp, has_kpad) = pads
    dk, dv_out = torch.empty_like(k), torch.empty_like(v)
    g = torch.zeros(b, h, s_k, dtype=stats, device=q.device)
    mass = torch.zeros(b, h, s_k, dtype=stats, device=q.device)
    do = do if do is not None else torch.zeros(1, 1, 1, 1, dtype=q.dtype, device=q.device)
    delta = delta if delta is not None else r
    _key_pass[(triton.cdiv(s_k, config.block_n), b * h_kv)](
        q, k, v, c, r, do, delta, dk, dv_out, g, mass, qpad, kpad,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *c.stride()[:2], *r.stride()[:2],
        *dk.stride()[:3], *dv_out.stride()[:3], sqp, skp, h_kv, h // h_kv, s_q, s_k, d, dv, scale,
        SWEEPS=sweeps, HAS_QPAD=has_qpad, HAS_KPAD=has_kpad, CAUSAL=causal, GRADS=grads, ACC=_ACC[q.dtype],
        DOT=_dot_precision(q.dtype), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_D=_block_dim(d), BLOCK_DV=_block_dim(dv),
        num_warps=config.num_warps, num_stages=config.num_stages)
    return dk, dv_out, g, mass


def received_mass(q, k, v, c, r, sweeps=1, score_scale=1.0, key_padding_mask=None, query_padding_mask=None,
                  causal=False, config=None):
    """Σ_i p_ij per query head, (B, H, S_k), from a forward's statistics (one key pass)."""
    config = config or Config()
    (b, _, s_q, _), s_k = q.shape, k.shape[2]
    pads = (_pad_arg(query_padding_mask, b, s_q, "query_padding_mask", q.device),
            _pad_arg(key_padding_mask, b, s_k, "key_padding_mask", q.device))
    return _key_launch(q.contiguous(), k.contiguous(), v.contiguous(), c, r, None, None, False, sweeps, score_scale,
                       pads, causal, config)[3]


def backward(q, k, v, out, c, r, grad_out, sweeps=1, score_scale=1.0, key_padding_mask=None, query_padding_mask=None,
             causal=False, config=None):
    """(dq, dk, dv) by recomputation: the key pass, then the query pass."""
    config = config or Config()
    (b, h, s_q, d), (_, h_kv, s_k, _), dv = q.shape, k.shape, v.shape[-1]
    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), grad_out.contiguous()
    stats = _STATS[q.dtype]
    delta = (do.to(stats) * out.to(stats)).sum(-1).contiguous()  # D_i = Σ_d dO_id O_id, (B, H, S_q)
    pads = (_pad_arg(query_padding_mask, b, s_q, "query_padding_mask", q.device),
            _pad_arg(key_padding_mask, b, s_k, "key_padding_mask", q.device))
    dk, dv_out, g, _ = _key_launch(q, k, v, c, r, do, delta, True, sweeps, score_scale, pads, causal, config)
    (qpad, sqp, has_qpad), (kpad, skp, has_kpad) = pads
    dq = torch.empty_like(q)
    scale = torch.tensor([score_scale / math.sqrt(d)], dtype=stats, device=q.device)
    _query_pass[(triton.cdiv(s_q, config.block_m), b * h)](
        q, k, v, c, r, do, delta, g, dq, qpad, kpad,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *c.stride()[:2], *r.stride()[:2],
        *dq.stride()[:3], sqp, skp, h, h // h_kv, s_q, s_k, d, dv, scale,
        SWEEPS=sweeps, HAS_QPAD=has_qpad, HAS_KPAD=has_kpad, CAUSAL=causal, ACC=_ACC[q.dtype],
        DOT=_dot_precision(q.dtype), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_D=_block_dim(d), BLOCK_DV=_block_dim(dv),
        num_warps=config.num_warps, num_stages=config.num_stages)
    return dq, dk, dv_out


class _PlanAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sweeps, score_scale, key_padding_mask, query_padding_mask, causal, config):
        out, c, r = forward(q, k, v, sweeps, score_scale, key_padding_mask, query_padding_mask, causal, config)
        ctx.save_for_backward(q, k, v, out, c, r)
        ctx.settings = (sweeps, score_scale, key_padding_mask, query_padding_mask, causal, config)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, c, r = ctx.saved_tensors
        dq, dk, dv = backward(q, k, v, out, c, r, grad_out, *ctx.settings)
        return dq, dk, dv, None, None, None, None, None, None


def attention(q, k, v, sweeps=1, score_scale=1.0, key_padding_mask=None, query_padding_mask=None, causal=False,
              config=None):
    """The plan's attention output (B, H, S_q, d_v), differentiable in q, k and v: 0 sweeps is
    softmax, 1 DNAS, N Sinkhorn-N. `k` and `v` may have fewer heads than `q` (a divisor of them:
    grouped-query attention)."""
    _check(q, k, v, sweeps, causal)
    if sweeps > 1:
        return _SinkhornAttention.apply(q, k, v, sweeps, score_scale, key_padding_mask, query_padding_mask, config)
    return _PlanAttention.apply(q, k, v, sweeps, score_scale, key_padding_mask, query_padding_mask, causal, config)


class _HybridAttention(torch.autograd.Function):
    """HNAS: `u·O_plan + (1 − u)·O_softmax` per head, `u = sigmoid(logit)`, both outputs from one
    row pass; the backward runs each branch's passes with its share of dO, and the gate's
    gradient is `Σ dO·(O_plan − O_softmax) · u(1 − u)` per head."""

    @staticmethod
    def forward(ctx, q, k, v, logit, score_scale, key_padding_mask, query_padding_mask, config):
        out_d, c, r_d, out_s, r_s = forward(q, k, v, 1, score_scale, key_padding_mask, query_padding_mask, False, config,
                                            hybrid=True)
        u = torch.sigmoid(logit.to(_STATS[q.dtype]))[None, :, None, None]
        ctx.save_for_backward(q, k, v, out_d, c, r_d, out_s, r_s, u)
        ctx.settings = (score_scale, key_padding_mask, query_padding_mask, config)
        return (u * out_d.to(u.dtype) + (1 - u) * out_s.to(u.dtype)).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out_d, c, r_d, out_s, r_s, u = ctx.saved_tensors
        score_scale, kp, qp, config = ctx.settings
        g = grad_out.to(u.dtype)
        dq_d, dk_d, dv_d = backward(q, k, v, out_d, c, r_d, (u * g).to(q.dtype), 1, score_scale, kp, qp, False, config)
        dq_s, dk_s, dv_s = backward(q, k, v, out_s, torch.zeros_like(c), r_s, ((1 - u) * g).to(q.dtype), 0, score_scale,
                                    kp, qp, False, config)
        du = (g * (out_d.to(u.dtype) - out_s.to(u.dtype))).sum((0, 2, 3))
        dlogit = du * (u * (1 - u)).flatten()
        return dq_d + dq_s, dk_d + dk_s, dv_d + dv_s, dlogit, None, None, None, None


def hybrid_attention(q, k, v, logit, score_scale=1.0, key_padding_mask=None, query_padding_mask=None, config=None):
    """HNAS's output (B, H, S_q, d_v) with gate logits `logit (H,)`, differentiable in q, k, v and
    the logits."""
    if logit.dim() != 1 or logit.shape[0] != q.shape[1]:
        raise ValueError(f"logit must have one gate per query head, shape ({q.shape[1]},), got {tuple(logit.shape)}")
    return _HybridAttention.apply(q, k, v, logit, score_scale, key_padding_mask, query_padding_mask, config)


# ---------------------------------------------------------------------------------------------
# Sinkhorn-N (N ≥ 2): potentials per sweep t = 1..N, C^t_j = LSE_i (z_ij − R^{t−1}_i) (R^0 = 0)
# and R^t_i = LSE_j (z_ij − C^t_j); the weights are exp(z − C^N − R^N). The backward carries
# each potential's gradient back through the sweeps, Ḡc^N = −g (g_j = Σ_i dS¹_ij) and, for
# t = N−1 .. 1, Ḡr^t_i = −Σ_j Ḡc^{t+1}_j κ^{t+1}_ij and Ḡc^t_j = −Σ_i Ḡr^t_i ρ^t_ij, with
# κ^t = exp(z − R^{t−1} − C^t) and ρ^t = exp(z − C^t − R^t); then
# dz = dS¹ + Σ_t Ḡc^t κ^t + Σ_{t<N} Ḡr^t ρ^t, formed tile by tile in the final key and query passes.
# Potentials and their gradients are (N, B, H, S) float tensors: O(N·S) memory.


@triton.jit
def _tile(Q, K, b, h, kvh, offs_m, offs_n, offs_d, S_Q, S_K, D, stride_qb, stride_qh, stride_qs, stride_kb, stride_kh,
          stride_ks, scale, ACC: tl.constexpr, DOT: tl.constexpr):
    """z = s·q kᵀ for one (query block, key block) tile, and the q and k blocks."""
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=(offs_m[:, None] < S_Q) & (offs_d[None, :] < D), other=0.0)
    k = tl.load(K + b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
                mask=(offs_n[:, None] < S_K) & (offs_d[None, :] < D), other=0.0)
    return tl.dot(q, tl.trans(k), out_dtype=ACC, input_precision=DOT) * scale, q, k


@triton.jit
def _sink_reduce(Q, K, RPOT, CPOT, COEF, OUT, QPAD, KPAD,
                 stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_cb, stride_ch, stride_rb,
                 stride_rh, stride_qpad, stride_kpad, H, GROUP, S_Q, S_K, D, SCALE,
                 COLUMNS: tl.constexpr, LSE: tl.constexpr, HAS_RPOT: tl.constexpr, HAS_QPAD: tl.constexpr,
                 HAS_KPAD: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One reduction of x_ij = z_ij − RPOT_i − CPOT_j over the allowed entries, per key (COLUMNS,
    over the queries) or per query (over the keys): with LSE, the log-sum-exp of x (a potential;
    the potential being formed is left out of x); else −Σ COEF_other · exp(x) (a potential's
    gradient). RPOT and CPOT are laid out as (B, H, S) statistics; RPOT absent: 0."""
    scale = tl.load(SCALE).to(ACC)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    if COLUMNS:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.full([BLOCK_N], FLOOR, dtype=ACC)
        total = tl.zeros([BLOCK_N], dtype=ACC)
        cpot = tl.zeros([BLOCK_N], dtype=ACC)
        if not LSE:
            cpot = tl.load(CPOT + b * stride_cb + h * stride_ch + offs_n, mask=offs_n < S_K, other=0.0)
        for start_m in range(0, S_Q, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            z, q, k = _tile(Q, K, b, h, kvh, offs_m, offs_n, offs_d, S_Q, S_K, D, stride_qb, stride_qh, stride_qs,
                            stride_kb, stride_kh, stride_ks, scale, ACC, DOT)
            ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad, HAS_QPAD, HAS_KPAD, False)
            if HAS_RPOT:
                z = z - tl.load(RPOT + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)[:, None]
            if LSE:
                z = tl.where(ok, z, float("-inf"))
                m_new = tl.maximum(m, tl.max(z, 0))
                total = total * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[None, :]), 0)
                m = m_new
            else:
                coef = tl.load(COEF + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
                e = tl.where(ok, tl.exp(tl.where(ok, z - cpot[None, :], 0.0)), 0.0)
                total -= tl.sum(e * coef[:, None], 0)
        if LSE:
            total = tl.where(total > 0, m + tl.log(tl.where(total > 0, total, 1.0)), FLOOR)
        tl.store(OUT + b * stride_cb + h * stride_ch + offs_n, total, mask=offs_n < S_K)
    else:
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        m = tl.full([BLOCK_M], FLOOR, dtype=ACC)
        total = tl.zeros([BLOCK_M], dtype=ACC)
        rpot = tl.zeros([BLOCK_M], dtype=ACC)
        if HAS_RPOT:
            rpot = tl.load(RPOT + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
        for start_n in range(0, S_K, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            z, q, k = _tile(Q, K, b, h, kvh, offs_m, offs_n, offs_d, S_Q, S_K, D, stride_qb, stride_qh, stride_qs,
                            stride_kb, stride_kh, stride_ks, scale, ACC, DOT)
            ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad, HAS_QPAD, HAS_KPAD, False)
            z = z - tl.load(CPOT + b * stride_cb + h * stride_ch + offs_n, mask=offs_n < S_K, other=0.0)[None, :]
            if LSE:
                z = tl.where(ok, z, float("-inf"))
                m_new = tl.maximum(m, tl.max(z, 1))
                total = total * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), 1)
                m = m_new
            else:
                coef = tl.load(COEF + b * stride_cb + h * stride_ch + offs_n, mask=offs_n < S_K, other=0.0)
                e = tl.where(ok, tl.exp(tl.where(ok, z - rpot[:, None], 0.0)), 0.0)
                total -= tl.sum(e * coef[None, :], 1)
        if LSE:
            total = tl.where(total > 0, m + tl.log(tl.where(total > 0, total, 1.0)), 0.0)
        tl.store(OUT + b * stride_rb + h * stride_rh + offs_m, total, mask=offs_m < S_Q)


@triton.jit
def _sink_dz(z, ok, dsz, offs_m, offs_n, b, h, S_Q, S_K, CS, RS, GC, GR, stride_t, stride_cb, stride_ch, stride_tr,
             stride_rb, stride_rh, N: tl.constexpr):
    """dz = dS¹ + Σ_t Ḡc^t κ^t + Σ_{t<N} Ḡr^t ρ^t on one tile (z without potentials)."""
    r_prev = tl.zeros([z.shape[0]], dtype=z.dtype)
    for t in tl.static_range(N):
        c = tl.load(CS + t * stride_t + b * stride_cb + h * stride_ch + offs_n, mask=offs_n < S_K, other=0.0)
        gc = tl.load(GC + t * stride_t + b * stride_cb + h * stride_ch + offs_n, mask=offs_n < S_K, other=0.0)
        x = z - r_prev[:, None] - c[None, :]
        dsz += tl.where(ok, tl.exp(tl.where(ok, x, 0.0)), 0.0) * gc[None, :]
        if t < N - 1:
            r = tl.load(RS + t * stride_tr + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
            gr = tl.load(GR + t * stride_tr + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
            y = z - c[None, :] - r[:, None]
            dsz += tl.where(ok, tl.exp(tl.where(ok, y, 0.0)), 0.0) * gr[:, None]
            r_prev = r
    return dsz


@triton.jit
def _sink_grads(Q, K, V, CS, RS, GC, GR, DO, DELTA, DQ, DK, DV_OUT, G, QPAD, KPAD,
                stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                stride_dob, stride_doh, stride_dos, stride_t, stride_cb, stride_ch, stride_tr, stride_rb, stride_rh,
                stride_qpad, stride_kpad, H, GROUP, S_Q, S_K, D, DV, SCALE,
                N: tl.constexpr, STAGE: tl.constexpr, HAS_QPAD: tl.constexpr, HAS_KPAD: tl.constexpr,
                ACC: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Sinkhorn-N's gradient passes. STAGE 0: g_j = Σ_i dS¹_ij, one key block of one (batch, query
    head) per program. STAGE 1: dK and dV with the whole dz, one key block of one (batch,
    key/value head), over its group's query heads. STAGE 2: dQ, one query block of one (batch,
    query head). p = exp(z − C^N − R^N); dq, dk and dv are laid out as q, k and v."""
    scale = tl.load(SCALE).to(ACC)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    last_c = (N - 1) * stride_t
    last_r = (N - 1) * stride_tr
    if STAGE < 2:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        bk = tl.program_id(1)
        if STAGE == 0:
            b, kvh = bk // H, (bk % H) // GROUP
            first, heads = bk % H, 1
        else:
            b, kvh = bk // (H // GROUP), bk % (H // GROUP)
            first, heads = kvh * GROUP, GROUP
        v = tl.load(V + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vs + offs_dv[None, :],
                    mask=(offs_n[:, None] < S_K) & (offs_dv[None, :] < DV), other=0.0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=ACC)
        for i in range(0, heads):
            h = first + i
            c = tl.load(CS + last_c + b * stride_cb + h * stride_ch + offs_n, mask=offs_n < S_K, other=0.0)
            g = tl.zeros([BLOCK_N], dtype=ACC)
            for start_m in range(0, S_Q, BLOCK_M):
                offs_m = start_m + tl.arange(0, BLOCK_M)
                z, q, k = _tile(Q, K, b, h, kvh, offs_m, offs_n, offs_d, S_Q, S_K, D, stride_qb, stride_qh, stride_qs,
                                stride_kb, stride_kh, stride_ks, scale, ACC, DOT)
                ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad, HAS_QPAD, HAS_KPAD,
                              False)
                r = tl.load(RS + last_r + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
                p = tl.where(ok, tl.exp(tl.where(ok, z - c[None, :] - r[:, None], 0.0)), 0.0)
                do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_dv[None, :],
                             mask=(offs_m[:, None] < S_Q) & (offs_dv[None, :] < DV), other=0.0)
                delta = tl.load(DELTA + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
                ds = p * (tl.dot(do, tl.trans(v), out_dtype=ACC, input_precision=DOT) - delta[:, None])
                if STAGE == 0:
                    g += tl.sum(ds, 0)
                else:
                    dz = _sink_dz(z, ok, ds, offs_m, offs_n, b, h, S_Q, S_K, CS, RS, GC, GR, stride_t, stride_cb,
                                  stride_ch, stride_tr, stride_rb, stride_rh, N)
                    dk += tl.dot(tl.trans(dz).to(q.dtype), q, out_dtype=ACC, input_precision=DOT)
                    dv += tl.dot(tl.trans(p).to(do.dtype), do, out_dtype=ACC, input_precision=DOT)
            if STAGE == 0:
                tl.store(G + b * stride_cb + h * stride_ch + offs_n, g, mask=offs_n < S_K)
        if STAGE == 1:
            tl.store(DK + b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
                     (dk * scale).to(DK.dtype.element_ty), mask=(offs_n[:, None] < S_K) & (offs_d[None, :] < D))
            tl.store(DV_OUT + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vs + offs_dv[None, :],
                     dv.to(DV_OUT.dtype.element_ty), mask=(offs_n[:, None] < S_K) & (offs_dv[None, :] < DV))
    else:
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        bh = tl.program_id(1)
        b, h = bh // H, bh % H
        kvh = h // GROUP
        r = tl.load(RS + last_r + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
        do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_dv[None, :],
                     mask=(offs_m[:, None] < S_Q) & (offs_dv[None, :] < DV), other=0.0)
        delta = tl.load(DELTA + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
        for start_n in range(0, S_K, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            z, q, k = _tile(Q, K, b, h, kvh, offs_m, offs_n, offs_d, S_Q, S_K, D, stride_qb, stride_qh, stride_qs,
                            stride_kb, stride_kh, stride_ks, scale, ACC, DOT)
            ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad, HAS_QPAD, HAS_KPAD, False)
            c = tl.load(CS + last_c + b * stride_cb + h * stride_ch + offs_n, mask=offs_n < S_K, other=0.0)
            v = tl.load(V + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vs + offs_dv[None, :],
                        mask=(offs_n[:, None] < S_K) & (offs_dv[None, :] < DV), other=0.0)
            p = tl.where(ok, tl.exp(tl.where(ok, z - c[None, :] - r[:, None], 0.0)), 0.0)
            ds = p * (tl.dot(do, tl.trans(v), out_dtype=ACC, input_precision=DOT) - delta[:, None])
            dz = _sink_dz(z, ok, ds, offs_m, offs_n, b, h, S_Q, S_K, CS, RS, GC, GR, stride_t, stride_cb, stride_ch,
                          stride_tr, stride_rb, stride_rh, N)
            dq += tl.dot(dz.to(k.dtype), k, out_dtype=ACC, input_precision=DOT)
        tl.store(DQ + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                 (dq * scale).to(DQ.dtype.element_ty), mask=(offs_m[:, None] < S_Q) & (offs_d[None, :] < D))


def _sink_reduce_launch(q, k, rpot, cpot, coef, out, columns, lse, pads, config):
    (b, h, s_q, d), (_, h_kv, s_k, _) = q.shape, k.shape
    (qpad, sqp, has_qpad), (kpad, skp, has_kpad) = pads
    stats = _STATS[q.dtype]
    scale = torch.tensor([1.0], dtype=stats, device=q.device) * config.scale
    # Every statistic is a contiguous (B, H, S_k) or (B, H, S_q) tensor (or a slice of one
    # (N, B, H, S) along its first dimension).
    for t in (rpot, cpot, coef, out):
        assert t is None or t.is_contiguous()
    grid = (triton.cdiv(s_k, config.block_n) if columns else triton.cdiv(s_q, config.block_m), b * h)
    dummy = out
    _sink_reduce[grid](
        q, k, rpot if rpot is not None else dummy, cpot if cpot is not None else dummy, coef if coef is not None else dummy,
        out, qpad, kpad, *q.stride()[:3], *k.stride()[:3], h * s_k, s_k, h * s_q, s_q, sqp, skp,
        h, h // h_kv, s_q, s_k, d, scale, COLUMNS=columns, LSE=lse, HAS_RPOT=rpot is not None, HAS_QPAD=has_qpad,
        HAS_KPAD=has_kpad, ACC=_ACC[q.dtype], DOT=_dot_precision(q.dtype), BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_D=_block_dim(d), num_warps=config.num_warps,
        num_stages=config.num_stages)


def sinkhorn_forward(q, k, v, sweeps, score_scale=1.0, key_padding_mask=None, query_padding_mask=None, config=None):
    """(output, CS, RS): Sinkhorn-N's output and its potentials, (N, B, H, S_k) and (N, B, H, S_q)."""
    _check(q, k, v, 1, False)
    if sweeps < 2:
        raise ValueError(f"sinkhorn_forward takes 2 sweeps or more (1 is DNAS), got {sweeps}")
    config = _Scaled(config or Config(), score_scale / math.sqrt(q.shape[-1]))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    (b, h, s_q, _), s_k = q.shape, k.shape[2]
    stats = _STATS[q.dtype]
    pads = (_pad_arg(query_padding_mask, b, s_q, "query_padding_mask", q.device),
            _pad_arg(key_padding_mask, b, s_k, "key_padding_mask", q.device))
    cs = torch.zeros(sweeps, b, h, s_k, dtype=stats, device=q.device)
    rs = torch.zeros(sweeps, b, h, s_q, dtype=stats, device=q.device)
    for t in range(sweeps):
        _sink_reduce_launch(q, k, rs[t - 1] if t else None, None, None, cs[t], True, True, pads, config)
        if t < sweeps - 1:
            _sink_reduce_launch(q, k, None, cs[t], None, rs[t], False, True, pads, config)
    # The last row pass is DNAS's with C^N as its column statistic.
    out, _, r = _row_with_c(q, k, v, cs[-1], score_scale, key_padding_mask, query_padding_mask, config.inner)
    rs[-1] = r
    return out, cs, rs


class _Scaled:
    """A Config with the score scale s = score_scale / sqrt(d) the Sinkhorn launches read."""

    def __init__(self, inner, scale):
        self.inner, self.scale = inner, scale
        self.block_m, self.block_n, self.num_warps, self.num_stages = inner.block_m, inner.block_n, inner.num_warps, inner.num_stages


def _row_with_c(q, k, v, c, score_scale, key_padding_mask, query_padding_mask, config):
    """The row pass of a plan with sweeps, given its column statistic c (B, H, S_k)."""
    (b, h, s_q, d), (_, h_kv, s_k, _), dv = q.shape, k.shape, v.shape[-1]
    stats = _STATS[q.dtype]
    scale = torch.tensor([score_scale / math.sqrt(d)], dtype=stats, device=q.device)
    qpad, sqp, has_qpad = _pad_arg(query_padding_mask, b, s_q, "query_padding_mask", q.device)
    kpad, skp, has_kpad = _pad_arg(key_padding_mask, b, s_k, "key_padding_mask", q.device)
    c = c.contiguous()
    out = torch.empty(b, h, s_q, dv, dtype=q.dtype, device=q.device)
    r = torch.empty(b, h, s_q, dtype=stats, device=q.device)
    _row_pass[(triton.cdiv(s_q, config.block_m), b * h)](
        q, k, v, c, out, r, out, r, qpad, kpad, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        *c.stride()[:2], *r.stride()[:2], sqp, skp, h, h // h_kv, s_q, s_k, d, dv, scale,
        SWEEPS=1, HYBRID=False, HAS_QPAD=has_qpad, HAS_KPAD=has_kpad, CAUSAL=False, ACC=_ACC[q.dtype],
        DOT=_dot_precision(q.dtype), BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=_block_dim(d),
        BLOCK_DV=_block_dim(dv), num_warps=config.num_warps, num_stages=config.num_stages)
    return out, c, r


def sinkhorn_backward(q, k, v, out, cs, rs, grad_out, score_scale=1.0, key_padding_mask=None, query_padding_mask=None,
                      config=None):
    """(dq, dk, dv) of Sinkhorn-N by recomputation: g, the potentials' gradients sweep by sweep
    backwards, then dK, dV and dQ with the whole dz."""
    n = cs.shape[0]
    base = config or Config()
    config = _Scaled(base, score_scale / math.sqrt(q.shape[-1]))
    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), grad_out.contiguous()
    (b, h, s_q, d), (_, h_kv, s_k, _), dv = q.shape, k.shape, v.shape[-1]
    stats = _STATS[q.dtype]
    delta = (do.to(stats) * out.to(stats)).sum(-1).contiguous()
    pads = (_pad_arg(query_padding_mask, b, s_q, "query_padding_mask", q.device),
            _pad_arg(key_padding_mask, b, s_k, "key_padding_mask", q.device))
    (qpad, sqp, has_qpad), (kpad, skp, has_kpad) = pads
    gc = torch.zeros_like(cs)
    gr = torch.zeros_like(rs)
    g = torch.zeros(b, h, s_k, dtype=stats, device=q.device)
    dq, dk, dv_out = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    scale = torch.tensor([config.scale], dtype=stats, device=q.device)

    def grads(stage, grid):
        _sink_grads[grid](
            q, k, v, cs, rs, gc, gr, do, delta, dq, dk, dv_out, g, qpad, kpad,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], cs.stride(0), *cs.stride()[1:3],
            rs.stride(0), *rs.stride()[1:3], sqp, skp, h, h // h_kv, s_q, s_k, d, dv, scale,
            N=n, STAGE=stage, HAS_QPAD=has_qpad, HAS_KPAD=has_kpad, ACC=_ACC[q.dtype], DOT=_dot_precision(q.dtype),
            BLOCK_M=base.block_m, BLOCK_N=base.block_n, BLOCK_D=_block_dim(d),
            BLOCK_DV=_block_dim(dv), num_warps=base.num_warps, num_stages=base.num_stages)

    grads(0, (triton.cdiv(s_k, base.block_n), b * h))
    gc[-1] = -g
    for t in range(n - 2, -1, -1):
        _sink_reduce_launch(q, k, rs[t], cs[t + 1], gc[t + 1], gr[t], False, False, pads, config)
        _sink_reduce_launch(q, k, rs[t], cs[t], gr[t], gc[t], True, False, pads, config)
    grads(1, (triton.cdiv(s_k, base.block_n), b * h_kv))
    grads(2, (triton.cdiv(s_q, base.block_m), b * h))
    return dq, dk, dv_out


class _SinkhornAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sweeps, score_scale, key_padding_mask, query_padding_mask, config):
        out, cs, rs = sinkhorn_forward(q, k, v, sweeps, score_scale, key_padding_mask, query_padding_mask, config)
        ctx.save_for_backward(q, k, v, out, cs, rs)
        ctx.settings = (score_scale, key_padding_mask, query_padding_mask, config)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, cs, rs = ctx.saved_tensors
        dq, dk, dv = sinkhorn_backward(q, k, v, out, cs, rs, grad_out, *ctx.settings)
        return dq, dk, dv, None, None, None, None, None

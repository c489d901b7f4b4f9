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

Masks (`Masks`): key padding `(B, S_k)` and query padding `(B, S_q)` (True = excluded), a boolean
pattern broadcastable to `(B, H, S_q, S_k)` (True = takes part, as SDPA's `attn_mask`; read
through stride-0 views, never expanded in memory, its wholly excluded tiles skipped), an additive
float mask added to the scores before any normalization (as SDPA's float `attn_mask`; -inf
excludes a pair), and causal (top-left, `j ≤ i`, as SDPA's `is_causal`; refused for plans with
sweeps: a column sweep reads every query).
Grouped key/value heads (GQA) by index: query head `h` reads key/value head `h // (H / H_kv)`, and
the key pass sums the group's gradients in one program, without atomics or copies. Inputs in
bfloat16 or float16 take float32 products and statistics; float32 takes float32; float64 takes
float64 (the interpreter's and the tests' precision). A row with no allowed key gets a zero output
and zero gradients; a key no allowed query sees receives nothing.

`TRITON_INTERPRET=1` runs these kernels on the CPU (the tests do: python/tests/test_kernels.py).
"""

import copy
import math

import torch
import triton
import triton.language as tl

# A finite floor for the running maxima: a fully masked block then leaves them finite, and
# exp(-inf − floor) is exactly 0 where exp(-inf − -inf) would be NaN.
FLOOR = tl.constexpr(-1.0e30)


@triton.jit
def _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad,
             HAS_QPAD: tl.constexpr, HAS_KPAD: tl.constexpr, CAUSAL: tl.constexpr,
             h, MASK, stride_mb, stride_mh, stride_mm, stride_mn, HAS_MASK: tl.constexpr):
    """(BLOCK_M, BLOCK_N): which (query, key) pairs of the tile take part. MASK: a boolean
    pattern broadcast to (B, H, S_q, S_k) through its strides (0 on broadcast dimensions),
    nonzero where the pair takes part."""
    ok = (offs_m[:, None] < S_Q) & (offs_n[None, :] < S_K)
    if HAS_MASK:
        at = MASK + b * stride_mb + h * stride_mh + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn
        pattern = tl.load(at,
                          mask=ok, other=0)
        ok = ok & (pattern != 0)
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
def _block(P, b, h, offs, cols, n, width, stride_b, stride_h, stride_s):
    """Rows `offs` (< n) and columns `cols` (< width) of head h of batch b of a (B, H, S, width)
    tensor laid out by its strides; zeros outside."""
    return tl.load(P + b * stride_b + h * stride_h + offs[:, None] * stride_s + cols[None, :],
                   mask=(offs[:, None] < n) & (cols[None, :] < width), other=0.0)


@triton.jit
def _biased(z, BIAS, b, h, offs_m, offs_n, S_Q, S_K, stride_ab, stride_ah, stride_am, stride_an,
            HAS_BIAS: tl.constexpr):
    """z plus the additive float mask's tile (broadcast through its strides), when there is one;
    its -inf entries exclude their pairs."""
    if HAS_BIAS:
        bias = tl.load(BIAS + b * stride_ab + h * stride_ah + offs_m[:, None] * stride_am + offs_n[None, :] * stride_an,
                       mask=(offs_m[:, None] < S_Q) & (offs_n[None, :] < S_K), other=0.0)
        z = z + bias.to(z.dtype)
    return z


@triton.jit
def _scores(q, k, scale, BIAS, b, h, offs_m, offs_n, S_Q, S_K, stride_ab, stride_ah, stride_am, stride_an,
            HAS_BIAS: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr):
    """z = s·q kᵀ for one tile, plus the additive mask's tile when there is one."""
    z = tl.dot(q, tl.trans(k), out_dtype=ACC, input_precision=DOT) * scale
    return _biased(z, BIAS, b, h, offs_m, offs_n, S_Q, S_K, stride_ab, stride_ah, stride_am, stride_an, HAS_BIAS)


@triton.jit
def _live(BLOCKS, b, h, mb, nb, stride_bb, stride_bh, stride_bm, stride_bn, HAS_MASK: tl.constexpr):
    """Whether tile (mb, nb) of (batch b, head h) holds an allowed entry of the pattern: the block
    map (`_Call`) lets every pass skip the tiles a pattern wholly excludes, as FlexAttention's block
    masks do. Always true without a pattern."""
    if HAS_MASK:
        return tl.load(BLOCKS + b * stride_bb + h * stride_bh + mb * stride_bm + nb * stride_bn) != 0
    else:
        return True


@triton.jit
def _lse_fold(m, l, z, AXIS: tl.constexpr):
    """One block of an online log-sum-exp along AXIS: the running maximum m and the sum l of
    exp(x − m), updated with the block z (−inf where excluded)."""
    m_new = tl.maximum(m, tl.max(z, AXIS))
    return m_new, l * tl.exp(m - m_new) + tl.sum(tl.exp(z - tl.expand_dims(m_new, AXIS)), AXIS)


@triton.jit
def _lse_value(m, l, EMPTY: tl.constexpr):
    """The log-sum-exp an online fold reached; EMPTY where nothing was allowed (l = 0)."""
    return tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), EMPTY)


@triton.jit
def _accumulate(m, l, acc, z, v, ACC: tl.constexpr, DOT: tl.constexpr):
    """One key block of the row pass's online softmax: the running maximum, sum and value
    accumulator, updated with the logits z (−inf where excluded) and the value block v."""
    m_new = tl.maximum(m, tl.max(z, 1))
    p = tl.exp(z - m_new[:, None])
    alpha = tl.exp(m - m_new)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=ACC, input_precision=DOT)
    return m_new, l * alpha + tl.sum(p, 1), acc


@triton.jit
def _column_pass(Q, K, C, QPAD, KPAD, MASK, BLOCKS, BIAS,
                 stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                 stride_cb, stride_ch, stride_qpad, stride_kpad, stride_mb, stride_mh, stride_mm, stride_mn, stride_bb,
                 stride_bh, stride_bm, stride_bn, stride_ab, stride_ah, stride_am, stride_an,
                 H, GROUP, S_Q, S_K, D, SCALE,
                 HAS_QPAD: tl.constexpr, HAS_KPAD: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ACC: tl.constexpr, DOT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """c_j = LSE_i z_ij over the allowed queries, one key block per program (axis 0), one
    (batch, query head) per axis 1. A key with no allowed query gets FLOOR (never read)."""
    scale = tl.load(SCALE).to(ACC)
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _block(K, b, h // GROUP, offs_n, offs_d, S_K, D, stride_kb, stride_kh, stride_ks)
    m = tl.full([BLOCK_N], FLOOR, dtype=ACC)
    l = tl.zeros([BLOCK_N], dtype=ACC)
    for start_m in range(0, S_Q, BLOCK_M):
        if _live(BLOCKS, b, h, start_m // BLOCK_M, start_n // BLOCK_N, stride_bb, stride_bh, stride_bm, stride_bn,
                 HAS_MASK):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q = _block(Q, b, h, offs_m, offs_d, S_Q, D, stride_qb, stride_qh, stride_qs)
            z = _scores(q, k, scale, BIAS, b, h, offs_m, offs_n, S_Q, S_K, stride_ab, stride_ah, stride_am, stride_an,
                        HAS_BIAS, ACC, DOT)  # (BLOCK_M, BLOCK_N)
            ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad, HAS_QPAD, HAS_KPAD, False,
                          h, MASK, stride_mb, stride_mh, stride_mm, stride_mn, HAS_MASK)
            m, l = _lse_fold(m, l, tl.where(ok, z, float("-inf")), 0)
    c = _lse_value(m, l, FLOOR)
    tl.store(C + b * stride_cb + h * stride_ch + offs_n, c, mask=offs_n < S_K)


@triton.jit
def _row_pass(Q, K, V, C, O, R, O2, R2, QPAD, KPAD, MASK, BLOCKS, BIAS,
              stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
              stride_ob, stride_oh, stride_os, stride_cb, stride_ch, stride_rb, stride_rh, stride_qpad, stride_kpad,
              stride_mb, stride_mh, stride_mm, stride_mn, stride_bb, stride_bh, stride_bm, stride_bn, stride_ab,
              stride_ah, stride_am, stride_an,
              H, GROUP, S_Q, S_K, D, DV, SCALE,
              SWEEPS: tl.constexpr, HYBRID: tl.constexpr, HAS_QPAD: tl.constexpr, HAS_KPAD: tl.constexpr,
              HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
              CAUSAL: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """O_i = Σ_j p_ij v_j and r_i = LSE_j (z_ij − c_j), one query block per program. HYBRID (HNAS)
    keeps softmax's accumulators beside the plan's over the same tiles, one load of each key and
    value block for both, and writes softmax's output and row statistic to O2 and R2 (laid out as
    O and R)."""
    scale = tl.load(SCALE).to(ACC)
    start_m = tl.program_id(0) * BLOCK_M
    start_m0 = start_m
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _block(Q, b, h, offs_m, offs_d, S_Q, D, stride_qb, stride_qh, stride_qs)
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
        if _live(BLOCKS, b, h, start_m0 // BLOCK_M, start_n // BLOCK_N, stride_bb, stride_bh, stride_bm, stride_bn,
                 HAS_MASK):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = _block(K, b, kvh, offs_n, offs_d, S_K, D, stride_kb, stride_kh, stride_ks)
            v = _block(V, b, kvh, offs_n, offs_dv, S_K, DV, stride_vb, stride_vh, stride_vs)
            ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad, HAS_QPAD, HAS_KPAD, CAUSAL,
                          h, MASK, stride_mb, stride_mh, stride_mm, stride_mn, HAS_MASK)
            z0 = _scores(q, k, scale, BIAS, b, h, offs_m, offs_n, S_Q, S_K, stride_ab, stride_ah, stride_am, stride_an,
                         HAS_BIAS, ACC, DOT)
            z = z0
            if SWEEPS > 0:
                c = tl.load(C + b * stride_cb + h * stride_ch + offs_n, mask=offs_n < S_K, other=0.0)
                z = z0 - c[None, :]
            m, l, acc = _accumulate(m, l, acc, tl.where(ok, z, float("-inf")), v, ACC, DOT)
            if HYBRID:
                m2, l2, acc2 = _accumulate(m2, l2, acc2, tl.where(ok, z0, float("-inf")), v, ACC, DOT)
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
def _key_pass(Q, K, V, C, R, DO, DELTA, DK, DV_OUT, G, MASS, QPAD, KPAD, MASK, BLOCKS, BIAS,
              stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
              stride_dob, stride_doh, stride_dos, stride_cb, stride_ch, stride_rb, stride_rh,
              stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs, stride_qpad, stride_kpad,
              stride_mb, stride_mh, stride_mm, stride_mn, stride_bb, stride_bh, stride_bm, stride_bn, stride_ab,
              stride_ah, stride_am, stride_an,
              H_KV, GROUP, S_Q, S_K, D, DV, SCALE,
              SWEEPS: tl.constexpr, HAS_QPAD: tl.constexpr, HAS_KPAD: tl.constexpr, HAS_MASK: tl.constexpr,
              HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr,
              GRADS: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One key block of one (batch, key/value head) per program, over its group's query heads
    and every query block: dV, dK (with DNAS's correction), g_j per query head (for the query
    pass) and, with GRADS off, only the received mass Σ_i p_ij per query head."""
    scale = tl.load(SCALE).to(ACC)
    start_n = tl.program_id(0) * BLOCK_N
    start_n0 = start_n
    bk = tl.program_id(1)
    b, kvh = bk // H_KV, bk % H_KV
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = _block(K, b, kvh, offs_n, offs_d, S_K, D, stride_kb, stride_kh, stride_ks)
    v = _block(V, b, kvh, offs_n, offs_dv, S_K, DV, stride_vb, stride_vh, stride_vs)
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
            if _live(BLOCKS, b, h, start_m // BLOCK_M, start_n0 // BLOCK_N, stride_bb, stride_bh, stride_bm, stride_bn,
                     HAS_MASK):
                offs_m = start_m + tl.arange(0, BLOCK_M)
                q = _block(Q, b, h, offs_m, offs_d, S_Q, D, stride_qb, stride_qh, stride_qs)
                r = tl.load(R + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
                z = _scores(q, k, scale, BIAS, b, h, offs_m, offs_n, S_Q, S_K, stride_ab, stride_ah, stride_am,
                            stride_an, HAS_BIAS, ACC, DOT) - c[None, :]
                ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad, HAS_QPAD, HAS_KPAD,
                              CAUSAL, h, MASK, stride_mb, stride_mh, stride_mm, stride_mn, HAS_MASK)
                p = tl.where(ok, tl.exp(tl.where(ok, z - r[:, None], 0.0)), 0.0)  # (BLOCK_M, BLOCK_N)
                mass += tl.sum(p, 0)
                if GRADS:
                    do = _block(DO, b, h, offs_m, offs_dv, S_Q, DV, stride_dob, stride_doh, stride_dos)
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
def _query_pass(Q, K, V, C, R, DO, DELTA, G, DQ, QPAD, KPAD, MASK, BLOCKS, BIAS,
                stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                stride_dob, stride_doh, stride_dos, stride_cb, stride_ch, stride_rb, stride_rh,
                stride_dqb, stride_dqh, stride_dqs, stride_qpad, stride_kpad, stride_mb, stride_mh, stride_mm,
                stride_mn, stride_bb, stride_bh, stride_bm, stride_bn, stride_ab, stride_ah, stride_am, stride_an,
                H, GROUP, S_Q, S_K, D, DV, SCALE,
                SWEEPS: tl.constexpr, HAS_QPAD: tl.constexpr, HAS_KPAD: tl.constexpr, HAS_MASK: tl.constexpr,
                HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr,
                ACC: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr):
    """dQ_i = s Σ_j dz_ij k_j, dz_ij = dS¹_ij − exp(z_ij − c_j) g_j, one query block per program."""
    scale = tl.load(SCALE).to(ACC)
    start_m = tl.program_id(0) * BLOCK_M
    start_m0 = start_m
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _block(Q, b, h, offs_m, offs_d, S_Q, D, stride_qb, stride_qh, stride_qs)
    do = _block(DO, b, h, offs_m, offs_dv, S_Q, DV, stride_dob, stride_doh, stride_dos)
    r = tl.load(R + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
    delta = tl.load(DELTA + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    end_n = S_K
    if CAUSAL:
        end_n = tl.minimum(S_K, start_m + BLOCK_M)
    for start_n in range(0, end_n, BLOCK_N):
        if _live(BLOCKS, b, h, start_m0 // BLOCK_M, start_n // BLOCK_N, stride_bb, stride_bh, stride_bm, stride_bn,
                 HAS_MASK):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = _block(K, b, kvh, offs_n, offs_d, S_K, D, stride_kb, stride_kh, stride_ks)
            v = _block(V, b, kvh, offs_n, offs_dv, S_K, DV, stride_vb, stride_vh, stride_vs)
            z = _scores(q, k, scale, BIAS, b, h, offs_m, offs_n, S_Q, S_K, stride_ab, stride_ah, stride_am, stride_an,
                        HAS_BIAS, ACC, DOT)
            if SWEEPS > 0:
                c = tl.load(C + b * stride_cb + h * stride_ch + offs_n, mask=offs_n < S_K, other=0.0)
                z = z - c[None, :]
            ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad, HAS_QPAD, HAS_KPAD, CAUSAL,
                          h, MASK, stride_mb, stride_mh, stride_mm, stride_mn, HAS_MASK)
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
# Sinkhorn-N (N ≥ 2): potentials per sweep t = 1..N, C^t_j = LSE_i (z_ij − R^{t−1}_i) (R^0 = 0)
# and R^t_i = LSE_j (z_ij − C^t_j); the weights are exp(z − C^N − R^N). The backward carries
# each potential's gradient back through the sweeps, Ḡc^N = −g (g_j = Σ_i dS¹_ij) and, for
# t = N−1 .. 1, Ḡr^t_i = −Σ_j Ḡc^{t+1}_j κ^{t+1}_ij and Ḡc^t_j = −Σ_i Ḡr^t_i ρ^t_ij, with
# κ^t = exp(z − R^{t−1} − C^t) and ρ^t = exp(z − C^t − R^t); then
# dz = dS¹ + Σ_t Ḡc^t κ^t + Σ_{t<N} Ḡr^t ρ^t, formed tile by tile in the final key and query passes.
# Potentials and their gradients are (N, B, H, S) float tensors: O(N·S) memory.


@triton.jit
def _tile(Q, K, b, h, kvh, offs_m, offs_n, offs_d, S_Q, S_K, D, stride_qb, stride_qh, stride_qs, stride_kb, stride_kh,
          stride_ks, scale, BIAS, stride_ab, stride_ah, stride_am, stride_an, HAS_BIAS: tl.constexpr, ACC: tl.constexpr,
          DOT: tl.constexpr):
    """z = s·q kᵀ (plus the additive mask) for one (query block, key block) tile, and the q and k
    blocks."""
    q = _block(Q, b, h, offs_m, offs_d, S_Q, D, stride_qb, stride_qh, stride_qs)
    k = _block(K, b, kvh, offs_n, offs_d, S_K, D, stride_kb, stride_kh, stride_ks)
    return _scores(q, k, scale, BIAS, b, h, offs_m, offs_n, S_Q, S_K, stride_ab, stride_ah, stride_am, stride_an,
                   HAS_BIAS, ACC, DOT), q, k


@triton.jit
def _sink_reduce(Q, K, RPOT, CPOT, COEF, OUT, QPAD, KPAD, MASK, BLOCKS, BIAS,
                 stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_cb, stride_ch, stride_rb,
                 stride_rh, stride_qpad, stride_kpad, stride_mb, stride_mh, stride_mm, stride_mn, stride_bb, stride_bh,
                 stride_bm, stride_bn, stride_ab, stride_ah, stride_am, stride_an, H, GROUP, S_Q, S_K, D, SCALE,
                 COLUMNS: tl.constexpr, LSE: tl.constexpr, HAS_RPOT: tl.constexpr, HAS_QPAD: tl.constexpr,
                 HAS_KPAD: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, ACC: tl.constexpr,
                 DOT: tl.constexpr, BLOCK_M: tl.constexpr,
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
        start_n0 = tl.program_id(0) * BLOCK_N
        offs_n = start_n0 + tl.arange(0, BLOCK_N)
        m = tl.full([BLOCK_N], FLOOR, dtype=ACC)
        total = tl.zeros([BLOCK_N], dtype=ACC)
        cpot = tl.zeros([BLOCK_N], dtype=ACC)
        if not LSE:
            cpot = tl.load(CPOT + b * stride_cb + h * stride_ch + offs_n, mask=offs_n < S_K, other=0.0)
        for start_m in range(0, S_Q, BLOCK_M):
            if _live(BLOCKS, b, h, start_m // BLOCK_M, start_n0 // BLOCK_N, stride_bb, stride_bh, stride_bm, stride_bn,
                     HAS_MASK):
                offs_m = start_m + tl.arange(0, BLOCK_M)
                z, q, k = _tile(Q, K, b, h, kvh, offs_m, offs_n, offs_d, S_Q, S_K, D, stride_qb, stride_qh, stride_qs,
                                stride_kb, stride_kh, stride_ks, scale, BIAS, stride_ab, stride_ah, stride_am,
                                stride_an, HAS_BIAS, ACC, DOT)
                ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad, HAS_QPAD, HAS_KPAD,
                              False, h, MASK, stride_mb, stride_mh, stride_mm, stride_mn, HAS_MASK)
                if HAS_RPOT:
                    z = z - tl.load(RPOT + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)[:,
                    None]
                if LSE:
                    m, total = _lse_fold(m, total, tl.where(ok, z, float("-inf")), 0)
                else:
                    coef = tl.load(COEF + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
                    e = tl.where(ok, tl.exp(tl.where(ok, z - cpot[None, :], 0.0)), 0.0)
                    total -= tl.sum(e * coef[:, None], 0)
        if LSE:
            total = _lse_value(m, total, FLOOR)
        tl.store(OUT + b * stride_cb + h * stride_ch + offs_n, total, mask=offs_n < S_K)
    else:
        start_m0 = tl.program_id(0) * BLOCK_M
        offs_m = start_m0 + tl.arange(0, BLOCK_M)
        m = tl.full([BLOCK_M], FLOOR, dtype=ACC)
        total = tl.zeros([BLOCK_M], dtype=ACC)
        rpot = tl.zeros([BLOCK_M], dtype=ACC)
        if HAS_RPOT:
            rpot = tl.load(RPOT + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
        for start_n in range(0, S_K, BLOCK_N):
            if _live(BLOCKS, b, h, start_m0 // BLOCK_M, start_n // BLOCK_N, stride_bb, stride_bh, stride_bm, stride_bn,
                     HAS_MASK):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                z, q, k = _tile(Q, K, b, h, kvh, offs_m, offs_n, offs_d, S_Q, S_K, D, stride_qb, stride_qh, stride_qs,
                                stride_kb, stride_kh, stride_ks, scale, BIAS, stride_ab, stride_ah, stride_am,
                                stride_an, HAS_BIAS, ACC, DOT)
                ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad, HAS_QPAD, HAS_KPAD,
                              False, h, MASK, stride_mb, stride_mh, stride_mm, stride_mn, HAS_MASK)
                z = z - tl.load(CPOT + b * stride_cb + h * stride_ch + offs_n, mask=offs_n < S_K, other=0.0)[None, :]
                if LSE:
                    m, total = _lse_fold(m, total, tl.where(ok, z, float("-inf")), 1)
                else:
                    coef = tl.load(COEF + b * stride_cb + h * stride_ch + offs_n, mask=offs_n < S_K, other=0.0)
                    e = tl.where(ok, tl.exp(tl.where(ok, z - rpot[:, None], 0.0)), 0.0)
                    total -= tl.sum(e * coef[None, :], 1)
        if LSE:
            total = _lse_value(m, total, 0.0)
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
def _sink_grads(Q, K, V, CS, RS, GC, GR, DO, DELTA, DQ, DK, DV_OUT, G, QPAD, KPAD, MASK, BLOCKS, BIAS,
                stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                stride_dob, stride_doh, stride_dos, stride_t, stride_cb, stride_ch, stride_tr, stride_rb, stride_rh,
                stride_qpad, stride_kpad, stride_mb, stride_mh, stride_mm, stride_mn, stride_bb, stride_bh, stride_bm,
                stride_bn, stride_ab, stride_ah, stride_am, stride_an, H, GROUP, S_Q, S_K, D, DV, SCALE,
                N: tl.constexpr, STAGE: tl.constexpr, HAS_QPAD: tl.constexpr, HAS_KPAD: tl.constexpr,
                HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
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
        start_n0 = tl.program_id(0) * BLOCK_N
        offs_n = start_n0 + tl.arange(0, BLOCK_N)
        bk = tl.program_id(1)
        if STAGE == 0:
            b, kvh = bk // H, (bk % H) // GROUP
            first, heads = bk % H, 1
        else:
            b, kvh = bk // (H // GROUP), bk % (H // GROUP)
            first, heads = kvh * GROUP, GROUP
        v = _block(V, b, kvh, offs_n, offs_dv, S_K, DV, stride_vb, stride_vh, stride_vs)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=ACC)
        for i in range(0, heads):
            h = first + i
            c = tl.load(CS + last_c + b * stride_cb + h * stride_ch + offs_n, mask=offs_n < S_K, other=0.0)
            g = tl.zeros([BLOCK_N], dtype=ACC)
            for start_m in range(0, S_Q, BLOCK_M):
                if _live(BLOCKS, b, h, start_m // BLOCK_M, start_n0 // BLOCK_N, stride_bb, stride_bh, stride_bm,
                         stride_bn, HAS_MASK):
                    offs_m = start_m + tl.arange(0, BLOCK_M)
                    z, q, k = _tile(Q, K, b, h, kvh, offs_m, offs_n, offs_d, S_Q, S_K, D, stride_qb, stride_qh,
                                    stride_qs,
                                    stride_kb, stride_kh, stride_ks, scale, BIAS, stride_ab, stride_ah, stride_am,
                                    stride_an, HAS_BIAS, ACC, DOT)
                    ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad, HAS_QPAD, HAS_KPAD,
                                  False, h, MASK, stride_mb, stride_mh, stride_mm, stride_mn, HAS_MASK)
                    r = tl.load(RS + last_r + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
                    p = tl.where(ok, tl.exp(tl.where(ok, z - c[None, :] - r[:, None], 0.0)), 0.0)
                    do = _block(DO, b, h, offs_m, offs_dv, S_Q, DV, stride_dob, stride_doh, stride_dos)
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
        start_m0 = tl.program_id(0) * BLOCK_M
        offs_m = start_m0 + tl.arange(0, BLOCK_M)
        bh = tl.program_id(1)
        b, h = bh // H, bh % H
        kvh = h // GROUP
        r = tl.load(RS + last_r + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
        do = _block(DO, b, h, offs_m, offs_dv, S_Q, DV, stride_dob, stride_doh, stride_dos)
        delta = tl.load(DELTA + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
        for start_n in range(0, S_K, BLOCK_N):
            if _live(BLOCKS, b, h, start_m0 // BLOCK_M, start_n // BLOCK_N, stride_bb, stride_bh, stride_bm, stride_bn,
                     HAS_MASK):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                z, q, k = _tile(Q, K, b, h, kvh, offs_m, offs_n, offs_d, S_Q, S_K, D, stride_qb, stride_qh, stride_qs,
                                stride_kb, stride_kh, stride_ks, scale, BIAS, stride_ab, stride_ah, stride_am,
                                stride_an, HAS_BIAS, ACC, DOT)
                ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad, HAS_QPAD, HAS_KPAD,
                              False, h, MASK, stride_mb, stride_mh, stride_mm, stride_mn, HAS_MASK)
                c = tl.load(CS + last_c + b * stride_cb + h * stride_ch + offs_n, mask=offs_n < S_K, other=0.0)
                v = _block(V, b, kvh, offs_n, offs_dv, S_K, DV, stride_vb, stride_vh, stride_vs)
                p = tl.where(ok, tl.exp(tl.where(ok, z - c[None, :] - r[:, None], 0.0)), 0.0)
                ds = p * (tl.dot(do, tl.trans(v), out_dtype=ACC, input_precision=DOT) - delta[:, None])
                dz = _sink_dz(z, ok, ds, offs_m, offs_n, b, h, S_Q, S_K, CS, RS, GC, GR, stride_t, stride_cb, stride_ch,
                              stride_tr, stride_rb, stride_rh, N)
                dq += tl.dot(dz.to(k.dtype), k, out_dtype=ACC, input_precision=DOT)
        tl.store(DQ + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                 (dq * scale).to(DQ.dtype.element_ty), mask=(offs_m[:, None] < S_Q) & (offs_d[None, :] < D))


# ---------------------------------------------------------------------------------------------
# The launches, and autograd functions over them.

_ACC = {torch.float64: tl.float64, torch.float32: tl.float32, torch.bfloat16: tl.float32, torch.float16: tl.float32}
# The statistics' dtype (potentials, row statistics, g, D, the received mass).
_STATS = {torch.float64: torch.float64, torch.float32: torch.float32, torch.bfloat16: torch.float32,
torch.float16: torch.float32}


class Config:
    """Block shapes and launch settings (the tuning knobs; the tests use small blocks)."""

    def __init__(self, block_m=64, block_n=64, num_warps=4, num_stages=2):
        self.block_m, self.block_n, self.num_warps, self.num_stages = block_m, block_n, num_warps, num_stages


def _block_dim(n):
    """A head dimension's block: the next power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(n))


def _dot_precision(dtype):
    # float32 products in TF32 only where libtorch allows it, as its own kernels do.
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32" if dtype == torch.float32 else "ieee"


def _check(q, k, v, sweeps, causal):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k and v must be (B, H, S, d), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in _ACC or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one of {sorted(str(t) for t in _ACC)}, "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}")
    (b, h, _, d), (bk, hk, sk, dk), (bv, hv, sv, _) = q.shape, k.shape, v.shape
    if (bk, dk) != (b, d) or (bv, hv, sv) != (bk, hk, sk):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not fit together")
    if hk < 1 or h % hk:
        raise ValueError(f"the query heads ({h}) must be a multiple of the key/value heads ({hk})")
    if not isinstance(sweeps, int) or sweeps < 0:
        raise ValueError(f"sweeps must be a whole number of column/row sweeps, 0 or more, got {sweeps!r}")
    if causal and sweeps:
        raise ValueError("a causal mask with a column sweep would let later queries change earlier ones' weights")


class Masks:
    """Where attention is allowed: `key_padding_mask (B, S_k)` and `query_padding_mask (B, S_q)`
    (boolean, True = excluded, as nn.MultiheadAttention's), `allowed_mask` (boolean, True = takes
    part, as SDPA's attn_mask; broadcastable to (B, H, S_q, S_k), read through stride-0 views),
    `additive` (a float mask added to the scores before any normalization, as SDPA's float
    attn_mask: ALiBi, relative biases; -inf excludes a pair; no gradient flows into it) and
    `causal` (top-left, j ≤ i)."""

    def __init__(self, key_padding_mask=None, query_padding_mask=None, allowed_mask=None, causal=False, additive=None):
        self.key_padding_mask, self.query_padding_mask = key_padding_mask, query_padding_mask
        self.allowed_mask, self.causal, self.additive = allowed_mask, causal, additive


def _padding(mask, batch, length, name, device):
    if mask is None:
        return torch.zeros(1, dtype=torch.uint8, device=device), 0, False
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (batch, length):
        got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"{name} must be a boolean tensor of shape ({batch}, {length}), got {got}")
    mask = mask.to(device=device, dtype=torch.uint8).contiguous()
    return mask, mask.stride(0), True


def _pattern(mask, shape, block_m, block_n, device):
    """The pattern as uint8 broadcast to `shape` (B, H, S_q, S_k) through stride-0 views, and its
    block map: (B, H, ⌈S_q / block_m⌉, ⌈S_k / block_n⌉), nonzero where a tile holds an allowed
    entry (formed on the pattern's own dimensions, then broadcast the same way)."""
    none = torch.zeros(1, dtype=torch.uint8, device=device)
    if mask is None:
        return none, (0, 0, 0, 0), none, (0, 0, 0, 0), False
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() > 4:
        got = f"{mask.dtype} of rank {mask.dim()}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"allowed_mask must be a boolean tensor broadcastable to {tuple(shape)}, got {got}")
    own = mask.to(device=device, dtype=torch.uint8)
    own = own.reshape((1,) * (4 - own.dim()) + tuple(own.shape))
    try:
        wide = own.expand(*shape)
    except RuntimeError:
        raise ValueError(f"allowed_mask of shape {tuple(mask.shape)} does not broadcast to {tuple(shape)}") from None
    s_q, s_k = shape[2], shape[3]
    n_m, n_n = triton.cdiv(s_q, block_m), triton.cdiv(s_k, block_n)
    tiles = own.expand(*own.shape[:2], s_q, s_k)
    tiles = torch.nn.functional.pad(tiles, (0, n_n * block_n - s_k, 0, n_m * block_m - s_q))
    blocks = tiles.reshape(*own.shape[:2], n_m, block_m, n_n, block_n).amax(dim=(3, 5))
    blocks = blocks.expand(shape[0], shape[1], n_m, n_n)
    return wide, wide.stride(), blocks, blocks.stride(), True


def _additive(mask, shape, dtype, device):
    """The additive mask in the statistics' dtype, broadcast to `shape` through stride-0 views."""
    if mask is None:
        return torch.zeros(1, dtype=dtype, device=device), (0, 0, 0, 0), False
    if not isinstance(mask, torch.Tensor) or not mask.is_floating_point() or mask.dim() > 4:
        got = f"{mask.dtype} of rank {mask.dim()}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"additive must be a floating-point tensor broadcastable to {tuple(shape)}, got {got}")
    if mask.requires_grad:
        raise ValueError("additive: the kernels compute no gradient for the additive mask; pass it detached")
    if bool((torch.isnan(mask) | (mask == float("inf"))).any()):  # one synchronisation, not two
        raise ValueError("additive holds NaN or +inf; only finite values and -inf (excluded) are taken")
    own = mask.to(device=device, dtype=dtype)
    own = own.reshape((1,) * (4 - own.dim()) + tuple(own.shape))
    try:
        wide = own.expand(*shape)
    except RuntimeError:
        raise ValueError(f"additive of shape {tuple(mask.shape)} does not broadcast to {tuple(shape)}") from None
    return wide, wide.stride(), True


class _Call:
    """One attention call: its inputs made contiguous, its masks as kernel arguments, and the
    arguments every kernel shares, passed by name (each kernel takes the ones it declares)."""

    def __init__(self, q, k, v, sweeps, score_scale, masks, config):
        _check(q, k, v, sweeps, masks.causal)
        self.q, self.k, self.v = q.contiguous(), k.contiguous(), v.contiguous()
        self.config = config or Config()
        (b, h, s_q, d), (_, h_kv, s_k, _), dv = q.shape, k.shape, v.shape[-1]
        self.shape = (b, h, h_kv, s_q, s_k, d, dv)
        self.stats = _STATS[q.dtype]
        dev = q.device
        qpad, sqp, has_qpad = _padding(masks.query_padding_mask, b, s_q, "query_padding_mask", dev)
        kpad, skp, has_kpad = _padding(masks.key_padding_mask, b, s_k, "key_padding_mask", dev)
        pattern, (smb, smh, smm, smn), blocks, (sbb, sbh, sbm, sbn), has_mask = _pattern(
            masks.allowed_mask, (b, h, s_q, s_k), self.config.block_m, self.config.block_n, dev)
        bias, (sab, sah, sam, san), has_bias = _additive(masks.additive, (b, h, s_q, s_k), self.stats, dev)
        qs, ks, vs = self.q.stride(), self.k.stride(), self.v.stride()
        self.args = dict(
            Q=self.q, K=self.k, V=self.v, QPAD=qpad, KPAD=kpad, MASK=pattern, BLOCKS=blocks, BIAS=bias,
            stride_qb=qs[0], stride_qh=qs[1], stride_qs=qs[2], stride_kb=ks[0], stride_kh=ks[1], stride_ks=ks[2],
            stride_vb=vs[0], stride_vh=vs[1], stride_vs=vs[2],
            # outputs, gradients and statistics are contiguous, shaped as what they belong to
            stride_ob=h * s_q * dv, stride_oh=s_q * dv, stride_os=dv, stride_dob=h * s_q * dv, stride_doh=s_q * dv,
            stride_dos=dv, stride_dqb=qs[0], stride_dqh=qs[1], stride_dqs=qs[2], stride_dkb=ks[0], stride_dkh=ks[1],
            stride_dks=ks[2], stride_dvb=vs[0], stride_dvh=vs[1], stride_dvs=vs[2],
            stride_cb=h * s_k, stride_ch=s_k, stride_rb=h * s_q, stride_rh=s_q,
            stride_t=b * h * s_k, stride_tr=b * h * s_q,
            stride_qpad=sqp, stride_kpad=skp, stride_mb=smb, stride_mh=smh, stride_mm=smm, stride_mn=smn,
            stride_bb=sbb, stride_bh=sbh, stride_bm=sbm, stride_bn=sbn, stride_ab=sab, stride_ah=sah, stride_am=sam,
            stride_an=san, HAS_BIAS=has_bias,
            H=h, H_KV=h_kv, GROUP=h // h_kv, S_Q=s_q, S_K=s_k, D=d, DV=dv,
            SCALE=torch.tensor([score_scale / math.sqrt(d)], dtype=self.stats, device=dev),
            SWEEPS=min(sweeps, 1), HAS_QPAD=has_qpad, HAS_KPAD=has_kpad, HAS_MASK=has_mask, CAUSAL=masks.causal,
            ACC=_ACC[q.dtype], DOT=_dot_precision(q.dtype), BLOCK_M=self.config.block_m, BLOCK_N=self.config.block_n,
            BLOCK_D=_block_dim(d), BLOCK_DV=_block_dim(dv))

    def stat(self, keys, *lead):
        """Zeros for a per-key (B, H, S_k) or per-query (B, H, S_q) statistic, after `lead` dimensions."""
        b, h, _, s_q, s_k, _, _ = self.shape
        return torch.zeros(*lead, b, h, s_k if keys else s_q, dtype=self.stats, device=self.q.device)

    def grid(self, keys, heads):
        b, h, h_kv, s_q, s_k, _, _ = self.shape
        blocks = triton.cdiv(s_k, self.config.block_n) if keys else triton.cdiv(s_q, self.config.block_m)
        return (blocks, b * (h if heads == "query" else h_kv))

    def launch(self, kernel, grid, **extra):
        args = {**self.args, **extra}
        missing = [n for n in kernel.arg_names if n not in args]
        assert not missing, f"{kernel.arg_names}: no value for {missing}"
        kernel[grid](**{n: args[n] for n in kernel.arg_names}, num_warps=self.config.num_warps,
                     num_stages=self.config.num_stages)


def _forward(call, sweeps, hybrid=False):
    """Statistics and outputs of a call: (out, c, r) for 0 or 1 sweeps, with (out_softmax,
    r_softmax) after them when hybrid; (out, CS, RS) potentials per sweep for N ≥ 2."""
    _, _, _, s_q, _, _, dv = call.shape
    b, h = call.shape[0], call.shape[1]
    out = torch.empty(b, h, s_q, dv, dtype=call.q.dtype, device=call.q.device)
    if sweeps <= 1:
        c, r = call.stat(True), call.stat(False)
        if sweeps:
            call.launch(_column_pass, call.grid(True, "query"), C=c)
        out2, r2 = (torch.empty_like(out), call.stat(False)) if hybrid else (out, r)
        call.launch(_row_pass, call.grid(False, "query"), C=c, O=out, R=r, O2=out2, R2=r2, HYBRID=hybrid)
        return (out, c, r, out2, r2) if hybrid else (out, c, r)
    cs, rs = call.stat(True, sweeps), call.stat(False, sweeps)
    for t in range(sweeps):
        call.launch(_sink_reduce, call.grid(True, "query"), RPOT=rs[t - 1] if t else rs[0], CPOT=cs[t], COEF=cs[t],
                    OUT=cs[t], COLUMNS=True, LSE=True, HAS_RPOT=t > 0)
        if t < sweeps - 1:
            call.launch(_sink_reduce, call.grid(False, "query"), RPOT=rs[t], CPOT=cs[t], COEF=rs[t], OUT=rs[t],
                        COLUMNS=False, LSE=True, HAS_RPOT=False)
    # The last row pass is DNAS's with the last column potential as its statistic.
    call.launch(_row_pass, call.grid(False, "query"), C=cs[-1], O=out, R=rs[-1], O2=out, R2=rs[-1], HYBRID=False,
                SWEEPS=1)
    return out, cs, rs


def _received_mass(call, c, r):
    """Σ_i p_ij per query head, (B, H, S_k), from a forward's last column and row statistics."""
    mass, dummy = call.stat(True), call.q
    call.launch(_key_pass, call.grid(True, "kv"), C=c, R=r, DO=dummy, DELTA=r, DK=call.k, DV_OUT=call.v, G=mass,
                MASS=mass, GRADS=False)
    return mass


def _backward(call, sweeps, out, stats, grad_out):
    """(dq, dk, dv) by recomputation, for the statistics `_forward` returned."""
    do = grad_out.contiguous()
    delta = (do.to(call.stats) * out.to(call.stats)).sum(-1).contiguous()  # D_i = Σ_d dO_id O_id
    dq, dk, dv = torch.empty_like(call.q), torch.empty_like(call.k), torch.empty_like(call.v)
    if sweeps <= 1:
        c, r = stats
        g = call.stat(True)
        call.launch(_key_pass, call.grid(True, "kv"), C=c, R=r, DO=do, DELTA=delta, DK=dk, DV_OUT=dv, G=g, MASS=g,
                    GRADS=True)
        call.launch(_query_pass, call.grid(False, "query"), C=c, R=r, DO=do, DELTA=delta, G=g, DQ=dq)
        return dq, dk, dv
    cs, rs = stats
    gc, gr, g = torch.zeros_like(cs), torch.zeros_like(rs), call.stat(True)
    common = dict(CS=cs, RS=rs, GC=gc, GR=gr, DO=do, DELTA=delta, DQ=dq, DK=dk, DV_OUT=dv, G=g, N=sweeps)
    call.launch(_sink_grads, call.grid(True, "query"), STAGE=0, **common)
    gc[-1] = -g
    for t in range(sweeps - 2, -1, -1):
        call.launch(_sink_reduce, call.grid(False, "query"), RPOT=rs[t], CPOT=cs[t + 1], COEF=gc[t + 1], OUT=gr[t],
                    COLUMNS=False, LSE=False, HAS_RPOT=True)
        call.launch(_sink_reduce, call.grid(True, "query"), RPOT=rs[t], CPOT=cs[t], COEF=gr[t], OUT=gc[t],
                    COLUMNS=True, LSE=False, HAS_RPOT=True)
    call.launch(_sink_grads, call.grid(True, "kv"), STAGE=1, **common)
    call.launch(_sink_grads, call.grid(False, "query"), STAGE=2, **common)
    return dq, dk, dv


def forward(q, k, v, sweeps=1, score_scale=1.0, masks=None, config=None):
    """The plan's output (B, H, S_q, d_v) and its statistics, without a graph: (out, c, r) for 0 or
    1 sweeps, (out, CS, RS) with a potential per sweep for more."""
    return _forward(_Call(q, k, v, sweeps, score_scale, masks or Masks(), config), sweeps)


def received_mass(q, k, v, sweeps=1, score_scale=1.0, masks=None, config=None):
    """Σ_i p_ij per query head, (B, H, S_k): a forward's statistics, then one key pass."""
    call = _Call(q, k, v, sweeps, score_scale, masks or Masks(), config)
    _, c, r = _forward(call, sweeps)
    return _received_mass(call, c[-1] if sweeps > 1 else c, r[-1] if sweeps > 1 else r)


class _PlanAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sweeps, score_scale, masks, config):
        call = _Call(q, k, v, sweeps, score_scale, masks, config)
        out, *stats = _forward(call, sweeps)
        ctx.save_for_backward(out, *stats)
        ctx.call, ctx.sweeps = call, sweeps
        return out

    @staticmethod
    def backward(ctx, grad_out):
        out, *stats = ctx.saved_tensors
        return (*_backward(ctx.call, ctx.sweeps, out, stats, grad_out), None, None, None, None)


def attention(q, k, v, sweeps=1, score_scale=1.0, masks=None, config=None):
    """The plan's attention output (B, H, S_q, d_v), differentiable in q, k and v: 0 sweeps is
    softmax, 1 DNAS, N Sinkhorn-N; scores are `score_scale · q·kᵀ / sqrt(d)`. `k` and `v` may have
    fewer heads than `q` (a divisor of them: grouped-query attention, read by index)."""
    return _PlanAttention.apply(q, k, v, sweeps, score_scale, masks or Masks(), config)


class _HybridAttention(torch.autograd.Function):
    """HNAS: `u·O_plan + (1 − u)·O_softmax` per head, `u = sigmoid(logit)`, both outputs from one
    row pass; the backward runs each branch's passes with its share of dO, and the gate's
    gradient is `Σ dO·(O_plan − O_softmax) · u(1 − u)` per head."""

    @staticmethod
    def forward(ctx, q, k, v, logit, score_scale, masks, config):
        call = _Call(q, k, v, 1, score_scale, masks, config)
        out_d, c, r_d, out_s, r_s = _forward(call, 1, hybrid=True)
        u = torch.sigmoid(logit.to(call.stats))[None, :, None, None]
        ctx.save_for_backward(out_d, c, r_d, out_s, r_s, u)
        ctx.call = call
        return (u * out_d.to(u.dtype) + (1 - u) * out_s.to(u.dtype)).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        out_d, c, r_d, out_s, r_s, u = ctx.saved_tensors
        call, dtype = ctx.call, out_d.dtype
        g = grad_out.to(u.dtype)
        dq_d, dk_d, dv_d = _backward(call, 1, out_d, (c, r_d), (u * g).to(dtype))
        softmax = copy.copy(call)
        softmax.args = {**call.args, "SWEEPS": 0}
        dq_s, dk_s, dv_s = _backward(softmax, 0, out_s, (torch.zeros_like(c), r_s), ((1 - u) * g).to(dtype))
        dlogit = (g * (out_d.to(u.dtype) - out_s.to(u.dtype))).sum((0, 2, 3)) * (u * (1 - u)).flatten()
        return dq_d + dq_s, dk_d + dk_s, dv_d + dv_s, dlogit, None, None, None


def hybrid_attention(q, k, v, logit, score_scale=1.0, masks=None, config=None):
    """HNAS's output (B, H, S_q, d_v) with gate logits `logit (H,)`, differentiable in q, k, v and
    the logits."""
    if logit.dim() != 1 or logit.shape[0] != q.shape[1]:
        raise ValueError(f"logit must have one gate per query head, shape ({q.shape[1]},), got {tuple(logit.shape)}")
    if masks is not None and masks.causal:
        raise ValueError("HNAS mixes in DNAS, whose column sweep is not causal")
    return _HybridAttention.apply(q, k, v, logit, score_scale, masks or Masks(), config)

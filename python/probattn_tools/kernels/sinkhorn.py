"""Sinkhorn-N's passes (N ≥ 2), and BAM over Sinkhorn-N in its gradient passes."""

import triton
import triton.language as tl

from probattn_tools.kernels.bam import _kl_tile, _weights
from probattn_tools.kernels.tiles import (FLOOR, _allowed, _block, _exp, _exp_less, _in_exp_base, _key_block, _live,
                                          _lse_fold, _lse_value, _padded, _rows, _scores, _store_block, _store_rows,
                                          _tile)

# ---------------------------------------------------------------------------------------------
# Sinkhorn-N (N ≥ 2): potentials per sweep t = 1..N, C^t_j = LSE_i (z_ij − R^{t−1}_i) (R^0 = 0)
# and R^t_i = LSE_j (z_ij − C^t_j); the weights are exp(z − C^N − R^N). The backward carries
# each potential's gradient back through the sweeps, Ḡc^N = −g (g_j = Σ_i dS¹_ij) and, for
# t = N−1 .. 1, Ḡr^t_i = −Σ_j Ḡc^{t+1}_j κ^{t+1}_ij and Ḡc^t_j = −Σ_i Ḡr^t_i ρ^t_ij, with
# κ^t = exp(z − R^{t−1} − C^t) and ρ^t = exp(z − C^t − R^t); then
# dz = dS¹ + Σ_t Ḡc^t κ^t + Σ_{t<N} Ḡr^t ρ^t, formed tile by tile in the final key and query passes.
# Potentials and their gradients are (N, B, H, S) float tensors: O(N·S) memory.
#
# Padding is carried by the potentials, not applied per entry: a padded key's column potentials
# are +inf and a padded query's row potentials too (written once per key or query after a
# reduction's loop, as DNAS's column and row passes write c_j and r_i), so that every x = z − C − R
# that reaches a padded key or query is −inf and weighs 0, and the potentials' gradients there are
# 0. Only the first column reduction, which has no row potential before it (R^0 = 0), and the
# first sweep's term of dz apply query padding themselves: the first per entry, dz per row
# (`_first_rows`). The KL term reads the allowed pairs itself and keeps both per entry (dz's
# first term then needs no R^0 of its own).


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
    gradient). RPOT and CPOT are laid out as (B, H, S) statistics; RPOT absent: 0. CPOT is +inf
    at padded keys and RPOT at padded queries (the module's note), so that neither padding is
    applied per entry, but query padding in a column reduction without RPOT; a log-sum-exp is
    written +inf at its own padded keys or queries after the loop."""
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
        cpot = tl.zeros([BLOCK_N], dtype=ACC)  # in the exps' base (`_in_exp_base`)
        if not LSE:
            cpot = _in_exp_base(_rows(CPOT, b, h, offs_n, S_K, stride_cb, stride_ch))
        k = _block(K, b, kvh, offs_n, offs_d, S_K, D, stride_kb, stride_kh, stride_ks)
        for start_m in range(0, S_Q, BLOCK_M):
            if _live(BLOCKS, b, h, start_m // BLOCK_M, start_n0 // BLOCK_N, stride_bb, stride_bh, stride_bm, stride_bn,
                     HAS_MASK):
                offs_m = start_m + tl.arange(0, BLOCK_M)
                q = _block(Q, b, h, offs_m, offs_d, S_Q, D, stride_qb, stride_qh, stride_qs)
                # The tile formed transposed, zᵀ = s·k qᵀ (keys × queries), as `_column_pass` forms
                # it: the sums over queries then run along a row of the tensor cores' layout, not
                # across the warps through shared memory. The conditions on keys and queries trade
                # places; keys past S_K reach only what is not stored (no bound on them).
                zt = _scores(k, q, scale, BIAS, b, h, offs_n, offs_m, S_K, S_Q, stride_ab, stride_ah, stride_an,
                             stride_am, HAS_BIAS, ACC, DOT)
                ok = _allowed(offs_n, offs_m, b, S_K, S_Q, KPAD, QPAD, stride_kpad, stride_qpad, False,
                              HAS_QPAD and not HAS_RPOT, False, h, MASK, stride_mb, stride_mh, stride_mn, stride_mm,
                              HAS_MASK, BOUND_M=False)
                if HAS_RPOT:
                    zt = zt - _rows(RPOT, b, h, offs_m, S_Q, stride_rb, stride_rh)[None, :]
                if LSE:
                    m, total = _lse_fold(m, total, tl.where(ok, zt, float("-inf")), 1)
                else:
                    coef = _rows(COEF, b, h, offs_m, S_Q, stride_rb, stride_rh)
                    e = _exp_less(tl.where(ok, zt, float("-inf")), cpot[:, None])
                    total -= tl.sum(e * coef[None, :], 1)
        if LSE:  # +inf for a key no query sees, as `_column_pass` writes c (the last sweep's row pass reads it)
            total = _lse_value(m, total, float("inf"))
            if HAS_KPAD:
                total = tl.where(_padded(KPAD, b, offs_n, S_K, stride_kpad), float("inf"), total)
        _store_rows(OUT, total, b, h, offs_n, S_K, stride_cb, stride_ch)
    else:
        start_m0 = tl.program_id(0) * BLOCK_M
        offs_m = start_m0 + tl.arange(0, BLOCK_M)
        m = tl.full([BLOCK_M], FLOOR, dtype=ACC)
        total = tl.zeros([BLOCK_M], dtype=ACC)
        rpot = tl.zeros([BLOCK_M], dtype=ACC)  # in the exps' base (`_in_exp_base`)
        if HAS_RPOT:
            rpot = _in_exp_base(_rows(RPOT, b, h, offs_m, S_Q, stride_rb, stride_rh))
        for start_n in range(0, S_K, BLOCK_N):
            if _live(BLOCKS, b, h, start_m0 // BLOCK_M, start_n // BLOCK_N, stride_bb, stride_bh, stride_bm, stride_bn,
                     HAS_MASK):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                z, q, k = _tile(Q, K, b, h, kvh, offs_m, offs_n, offs_d, S_Q, S_K, D, stride_qb, stride_qh, stride_qs,
                                stride_kb, stride_kh, stride_ks, scale, BIAS, stride_ab, stride_ah, stride_am,
                                stride_an, HAS_BIAS, ACC, DOT)
                ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad, False, False, False,
                              h, MASK, stride_mb, stride_mh, stride_mm, stride_mn, HAS_MASK)
                z = z - _key_block(CPOT, b, h, offs_n, stride_cb, stride_ch)[None, :]
                if LSE:
                    m, total = _lse_fold(m, total, tl.where(ok, z, float("-inf")), 1)
                else:
                    coef = _key_block(COEF, b, h, offs_n, stride_cb, stride_ch)
                    e = _exp_less(tl.where(ok, z, float("-inf")), rpot[:, None])
                    total -= tl.sum(e * coef[None, :], 1)
        if LSE:
            total = _lse_value(m, total, 0.0)
            if HAS_QPAD:
                total = tl.where(_padded(QPAD, b, offs_m, S_Q, stride_qpad), float("inf"), total)
        _store_rows(OUT, total, b, h, offs_m, S_Q, stride_rb, stride_rh)


@triton.jit
def _first_rows(QPAD, b, offs_m, S_Q, stride_qpad, ACC: tl.constexpr, HAS_QPAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """R^0 for a block of queries, as dz's first term reads it: 0, and +inf at padded queries
    (and past S_Q), so that κ^1 = exp(z − R^0 − C^1) is 0 in their rows as every later term is
    through their row potentials. Per row, not per entry."""
    r0 = tl.zeros([BLOCK_M], dtype=ACC)
    if HAS_QPAD:
        r0 = tl.where(_padded(QPAD, b, offs_m, S_Q, stride_qpad), float("inf"), r0)
    return r0


@triton.jit
def _sink_dz(z, ok, dsz, r0, offs_m, offs_n, b, h, S_Q, S_K, CS, RS, GC, GR, stride_t, stride_cb, stride_ch, stride_tr,
             stride_rb, stride_rh, N):
    """dz = dS¹ + Σ_t Ḡc^t κ^t + Σ_{t<N} Ḡr^t ρ^t on one tile (z without potentials), r0 the
    block's R^0 (`_first_rows`). N is a run-time argument: one compiled kernel serves every sweep
    count. The column potentials and their gradients are read a key block at a time
    (`_key_block`): past S_K the potentials are +inf and their gradients 0, and the tile's bound
    on keys excludes those entries."""
    r_prev = r0
    for t in range(0, N - 1):
        c = _key_block(CS + t * stride_t, b, h, offs_n, stride_cb, stride_ch)
        gc = _key_block(GC + t * stride_t, b, h, offs_n, stride_cb, stride_ch)
        x = z - r_prev[:, None] - c[None, :]
        dsz += _exp(tl.where(ok, x, float("-inf"))) * gc[None, :]
        r = tl.load(RS + t * stride_tr + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
        gr = tl.load(GR + t * stride_tr + b * stride_rb + h * stride_rh + offs_m, mask=offs_m < S_Q, other=0.0)
        y = z - c[None, :] - r[:, None]
        dsz += _exp(tl.where(ok, y, float("-inf"))) * gr[:, None]
        r_prev = r
    # The last sweep's column potential, which no row potential follows in dz.
    c = _key_block(CS + (N - 1) * stride_t, b, h, offs_n, stride_cb, stride_ch)
    gc = _key_block(GC + (N - 1) * stride_t, b, h, offs_n, stride_cb, stride_ch)
    x = z - r_prev[:, None] - c[None, :]
    dsz += _exp(tl.where(ok, x, float("-inf"))) * gc[None, :]
    return dsz


@triton.jit
def _sink_ds(z, c, ok, r, do, v, delta, da, DRAWS, PRIOR, RB, KS, DKL, b, h, offs_m, offs_n, H, S_Q, S_K, noise_scale,
             stride_pb, stride_ph, stride_pn, stride_rb, stride_rh, NOISE: tl.constexpr, KL: tl.constexpr,
             DRAW64: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr):
    """One tile's weights p = exp(z − c − r + n) (c and r the last potentials) and dS¹ = p ⊙ (dO vᵀ −
    Δ), with the KL part's gradient added, and its gradient in the prior's values (per key) added
    to da."""
    y = z - c[None, :]
    p = _weights(y, ok, r, DRAWS, b, h, offs_m, offs_n, H, S_Q, S_K, noise_scale, NOISE, DRAW64, ACC)
    ds = p * (tl.dot(do, tl.trans(v), out_dtype=ACC, input_precision=DOT) - delta[:, None])
    if KL > 0:
        dy_kl, da_tile = _kl_tile(y, ok, b, h, offs_m, offs_n, S_Q, S_K, H, PRIOR, RB, KS, DKL, stride_pb, stride_ph,
                                  stride_pn, stride_rb, stride_rh, KL, ACC)
        ds += dy_kl
        da += da_tile
    return p, ds, da


@triton.jit
def _sink_key_grads(Q, K, V, CS, RS, GC, GR, DO, DELTA, DK, DV_OUT, DQ, G, QPAD, KPAD, MASK, BLOCKS, BIAS, DRAWS,
                    PRIOR, RB, KS, DKL, DA,
                    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                    stride_dob, stride_doh, stride_dos, stride_t, stride_cb, stride_ch, stride_tr, stride_rb, stride_rh,
                    stride_qpad, stride_kpad, stride_mb, stride_mh, stride_mm, stride_mn, stride_bb, stride_bh,
                    stride_bm, stride_bn, stride_ab, stride_ah, stride_am, stride_an, stride_pb, stride_ph, stride_pn,
                    H, GROUP, S_Q, S_K, D, DV, SCALE, N, STAGE: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                    HAS_QPAD: tl.constexpr, HAS_KPAD: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
                    NOISE: tl.constexpr, KL: tl.constexpr, DRAW64: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Sinkhorn-N's gradient passes over key blocks. STAGE 0: g_j = Σ_i dS¹_ij, one key block of
    one (batch, query head) per program (with a KL term, also the prior's gradient DA). STAGE 1:
    dK and dV with the whole dz, one key block of one (batch, key/value head), over its group's
    query heads. p = exp(z − C^N − R^N + n), n BAM's noise term (none without NOISE), and a KL
    term's part joins dS¹ (`_sink_ds`); dk and dv are laid out as k and v. With ATOMIC_DQ, STAGE 1
    also adds each tile's share of dQ, s·dz k, to DQ (zeros in ACC's dtype, laid out as q) by
    atomic adds, so that each tile's dz is formed once and `_sink_query_grads` is not launched;
    the order of the adds, and so dQ's last bits, then varies from run to run. The paddings reach
    the weights through the last potentials (the module's note): per entry only with a KL term."""
    scale = tl.load(SCALE).to(ACC)
    noise_scale = tl.load(SCALE + 1).to(ACC)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    last_c = (N - 1) * stride_t
    last_r = (N - 1) * stride_tr
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
        c = _rows(CS + last_c, b, h, offs_n, S_K, stride_cb, stride_ch)
        g = tl.zeros([BLOCK_N], dtype=ACC)
        da = tl.zeros([BLOCK_N], dtype=ACC)
        for start_m in range(0, S_Q, BLOCK_M):
            if _live(BLOCKS, b, h, start_m // BLOCK_M, start_n0 // BLOCK_N, stride_bb, stride_bh, stride_bm,
                     stride_bn, HAS_MASK):
                offs_m = start_m + tl.arange(0, BLOCK_M)
                z, q, k = _tile(Q, K, b, h, kvh, offs_m, offs_n, offs_d, S_Q, S_K, D, stride_qb, stride_qh,
                                stride_qs, stride_kb, stride_kh, stride_ks, scale, BIAS, stride_ab, stride_ah,
                                stride_am, stride_an, HAS_BIAS, ACC, DOT)
                ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad,
                              HAS_QPAD and KL > 0, HAS_KPAD and KL > 0, False, h, MASK, stride_mb, stride_mh,
                              stride_mm, stride_mn, HAS_MASK)
                r = _rows(RS + last_r, b, h, offs_m, S_Q, stride_rb, stride_rh)
                do = _block(DO, b, h, offs_m, offs_dv, S_Q, DV, stride_dob, stride_doh, stride_dos)
                delta = _rows(DELTA, b, h, offs_m, S_Q, stride_rb, stride_rh)
                p, ds, da = _sink_ds(z, c, ok, r, do, v, delta, da, DRAWS, PRIOR, RB, KS, DKL, b, h, offs_m, offs_n,
                                     H, S_Q, S_K, noise_scale, stride_pb, stride_ph, stride_pn, stride_rb,
                                     stride_rh, NOISE, KL, DRAW64, ACC, DOT)
                if STAGE == 0:
                    g += tl.sum(ds, 0)
                else:
                    r0 = _first_rows(QPAD, b, offs_m, S_Q, stride_qpad, ACC, HAS_QPAD and KL == 0, BLOCK_M)
                    dz = _sink_dz(z, ok, ds, r0, offs_m, offs_n, b, h, S_Q, S_K, CS, RS, GC, GR, stride_t, stride_cb,
                                  stride_ch, stride_tr, stride_rb, stride_rh, N)
                    dk += tl.dot(tl.trans(dz).to(q.dtype), q, out_dtype=ACC, input_precision=DOT)
                    dv += tl.dot(tl.trans(p).to(do.dtype), do, out_dtype=ACC, input_precision=DOT)
                    if ATOMIC_DQ:
                        dq = tl.dot(dz.to(k.dtype), k, out_dtype=ACC, input_precision=DOT) * scale
                        tl.atomic_add(DQ + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                                      dq, mask=(offs_m[:, None] < S_Q) & (offs_d[None, :] < D), sem="relaxed")
        if STAGE == 0:
            _store_rows(G, g, b, h, offs_n, S_K, stride_cb, stride_ch)
            if KL > 0:
                _store_rows(DA, da, b, h, offs_n, S_K, stride_cb, stride_ch)
    if STAGE == 1:
        _store_block(DK, dk * scale, b, kvh, offs_n, offs_d, S_K, D, stride_kb, stride_kh, stride_ks)
        _store_block(DV_OUT, dv, b, kvh, offs_n, offs_dv, S_K, DV, stride_vb, stride_vh, stride_vs)


@triton.jit
def _sink_query_grads(Q, K, V, CS, RS, GC, GR, DO, DELTA, DQ, QPAD, KPAD, MASK, BLOCKS, BIAS, DRAWS, PRIOR, RB, KS,
                      DKL, stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
                      stride_vs, stride_dob, stride_doh, stride_dos, stride_t, stride_cb, stride_ch, stride_tr,
                      stride_rb, stride_rh, stride_qpad, stride_kpad, stride_mb, stride_mh, stride_mm, stride_mn,
                      stride_bb, stride_bh, stride_bm, stride_bn, stride_ab, stride_ah, stride_am, stride_an, stride_pb,
                      stride_ph, stride_pn, H, GROUP, S_Q, S_K, D, DV, SCALE, N,
                      HAS_QPAD: tl.constexpr, HAS_KPAD: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
                      NOISE: tl.constexpr, KL: tl.constexpr, DRAW64: tl.constexpr, ACC: tl.constexpr,
                      DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_DV: tl.constexpr):
    """Sinkhorn-N's last gradient pass, where `_sink_key_grads`' STAGE 1 did not add dQ (deterministic
    algorithms asked for): dQ with the whole dz, one query block of one (batch, query head) per
    program; dq is laid out as q. Padding as in `_sink_key_grads`."""
    scale = tl.load(SCALE).to(ACC)
    noise_scale = tl.load(SCALE + 1).to(ACC)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    last_c = (N - 1) * stride_t
    last_r = (N - 1) * stride_tr
    start_m0 = tl.program_id(0) * BLOCK_M
    offs_m = start_m0 + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // GROUP
    r = _rows(RS + last_r, b, h, offs_m, S_Q, stride_rb, stride_rh)
    do = _block(DO, b, h, offs_m, offs_dv, S_Q, DV, stride_dob, stride_doh, stride_dos)
    delta = _rows(DELTA, b, h, offs_m, S_Q, stride_rb, stride_rh)
    r0 = _first_rows(QPAD, b, offs_m, S_Q, stride_qpad, ACC, HAS_QPAD and KL == 0, BLOCK_M)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    for start_n in range(0, S_K, BLOCK_N):
        if _live(BLOCKS, b, h, start_m0 // BLOCK_M, start_n // BLOCK_N, stride_bb, stride_bh, stride_bm, stride_bn,
                 HAS_MASK):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            z, q, k = _tile(Q, K, b, h, kvh, offs_m, offs_n, offs_d, S_Q, S_K, D, stride_qb, stride_qh, stride_qs,
                            stride_kb, stride_kh, stride_ks, scale, BIAS, stride_ab, stride_ah, stride_am,
                            stride_an, HAS_BIAS, ACC, DOT)
            ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad, HAS_QPAD and KL > 0,
                          HAS_KPAD and KL > 0, False, h, MASK, stride_mb, stride_mh, stride_mm, stride_mn, HAS_MASK)
            c = _key_block(CS + last_c, b, h, offs_n, stride_cb, stride_ch)
            v = _block(V, b, kvh, offs_n, offs_dv, S_K, DV, stride_vb, stride_vh, stride_vs)
            _, ds, _ = _sink_ds(z, c, ok, r, do, v, delta, tl.zeros_like(c), DRAWS, PRIOR, RB, KS, DKL, b, h, offs_m,
                                offs_n, H, S_Q, S_K, noise_scale, stride_pb, stride_ph, stride_pn, stride_rb, stride_rh,
                                NOISE, KL, DRAW64, ACC, DOT)  # no prior gradient here: STAGE 0 forms it
            dz = _sink_dz(z, ok, ds, r0, offs_m, offs_n, b, h, S_Q, S_K, CS, RS, GC, GR, stride_t, stride_cb,
                          stride_ch, stride_tr, stride_rb, stride_rh, N)
            dq += tl.dot(dz.to(k.dtype), k, out_dtype=ACC, input_precision=DOT)
    _store_block(DQ, dq * scale, b, h, offs_m, offs_d, S_Q, D, stride_qb, stride_qh, stride_qs)

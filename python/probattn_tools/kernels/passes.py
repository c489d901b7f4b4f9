"""The passes of the plans with 0 or 1 sweeps (softmax, DNAS, HNAS, and BAM over them): the column
pass, the row pass, and the recomputed backward's key and query passes
(`probattn_tools.kernels.plans` describes them; `launch` arguments are passed by name)."""

import triton
import triton.language as tl

from probattn_tools.kernels.bam import _kl_fold, _kl_rows, _kl_tile, _mix_shares, _mix_split, _noise, _weights
from probattn_tools.kernels.tiles import (FLOOR, _accumulate, _allowed, _block, _drop_rows, _exp, _exp_in_base,
                                          _finish_row, _in_exp_base, _key_block, _live, _lse_fold, _lse_value,
                                          _over_queries, _padded, _per_key, _per_row, _rows, _scores, _store_block,
                                          _store_rows)


@triton.jit
def _column_pass(Q, K, C, QBAR, QPAD, KPAD, MASK, BLOCKS, BIAS,
                 stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_qbarb, stride_qbarh,
                 stride_qbars, stride_cb, stride_ch, stride_qpad, stride_kpad, stride_mb, stride_mh, stride_mm,
                 stride_mn, stride_bb, stride_bh, stride_bm, stride_bn, stride_ab, stride_ah, stride_am, stride_an,
                 H, GROUP, S_Q, S_K, D, SCALE,
                 HAS_QPAD: tl.constexpr, HAS_KPAD: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
                 CONTEXT: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """c_j = LSE_i z_ij over the allowed queries, one key block per program (axis 0), one
    (batch, query head) per axis 1. A key with no allowed query (a padded key among them) gets
    +inf, as the keys past S_K do (`_key_block`): the passes that subtract c then weigh it 0
    without excluding it entry by entry (`_row_pass`'s KEYS_BY_C). Each
    tile is formed transposed, zᵀ = s·k qᵀ (keys × queries), so that the sums over queries run
    along a row of the tensor cores' layout, within a thread and a few of its neighbours, and not
    across the warps through shared memory.

    CONTEXT (a forward whose backward follows): also the column weights' mean of the queries,
    QBAR_j = Σ_i exp(z_ij − c_j) q_i (laid out as K per query head, in Q's dtype; 0 for a key no
    query sees), by the same online fold as the row pass's output with the roles of queries and
    keys exchanged. DNAS's key pass takes its correction to dK from it, `−g_j · QBAR_j`, instead of
    a fifth product per tile and a third float32 accumulator; this pass takes the product
    instead, beside its one product and one exponential per entry."""
    scale = tl.load(SCALE).to(ACC)
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _block(K, b, h // GROUP, offs_n, offs_d, S_K, D, stride_kb, stride_kh, stride_ks)
    m = tl.full([BLOCK_N], FLOOR, dtype=ACC)
    l = tl.zeros([BLOCK_N], dtype=ACC)
    qbar = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    for start_m in range(0, S_Q, BLOCK_M):
        if _live(BLOCKS, b, h, start_m // BLOCK_M, start_n // BLOCK_N, stride_bb, stride_bh, stride_bm, stride_bn,
                 HAS_MASK):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q = _block(Q, b, h, offs_m, offs_d, S_Q, D, stride_qb, stride_qh, stride_qs)
            zt = _scores(k, q, scale, BIAS, b, h, offs_n, offs_m, S_K, S_Q, stride_ab, stride_ah, stride_an, stride_am,
                         HAS_BIAS, ACC, DOT)  # (BLOCK_N, BLOCK_M): the tile transposed
            # which pairs take part, transposed: the conditions on keys and queries trade places
            # key padding is applied once per key below, not per entry
            ok = _allowed(offs_n, offs_m, b, S_K, S_Q, KPAD, QPAD, stride_kpad, stride_qpad, False, HAS_QPAD, False,
                          h, MASK, stride_mb, stride_mh, stride_mn, stride_mm, HAS_MASK, BOUND_M=False)
            if CONTEXT:
                m, l, qbar = _accumulate(m, l, qbar, tl.where(ok, zt, float("-inf")), q, ACC, DOT)
            else:
                m, l = _lse_fold(m, l, tl.where(ok, zt, float("-inf")), 1)
    if HAS_KPAD:
        l = tl.where(_padded(KPAD, b, offs_n, S_K, stride_kpad), 0.0, l)
    c = _lse_value(m, l, float("inf"))
    _store_rows(C, c, b, h, offs_n, S_K, stride_cb, stride_ch)
    if CONTEXT:
        qbar = tl.where((l > 0)[:, None], qbar / tl.where(l > 0, l, 1.0)[:, None], 0.0)
        _store_block(QBAR, qbar, b, h, offs_n, offs_d, S_K, D, stride_qbarb, stride_qbarh, stride_qbars)


@triton.jit
def _row_pass(Q, K, V, C, O, R, O2, R2, QPAD, KPAD, MASK, BLOCKS, BIAS, DRAWS, PRIOR, RB, KS, TROW, RD, RS, LOGU,
              stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
              stride_ob, stride_oh, stride_os, stride_cb, stride_ch, stride_rb, stride_rh, stride_qpad, stride_kpad,
              stride_mb, stride_mh, stride_mm, stride_mn, stride_bb, stride_bh, stride_bm, stride_bn, stride_ab,
              stride_ah, stride_am, stride_an, stride_pb, stride_ph, stride_pn,
              H, GROUP, S_Q, S_K, D, DV, SCALE,
              SWEEPS: tl.constexpr, HYBRID: tl.constexpr, HAS_QPAD: tl.constexpr, HAS_KPAD: tl.constexpr,
              HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, NOISE: tl.constexpr, KL: tl.constexpr,
              DRAW64: tl.constexpr, MIX: tl.constexpr,
              CAUSAL: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """O_i = Σ_j p_ij v_j and r_i = LSE_j (z_ij − c_j), one query block per program. HYBRID (HNAS)
    keeps softmax's accumulators beside the plan's over the same tiles, one load of each key and
    value block for both, and writes softmax's output and row statistic to O2 and R2 (laid out as
    O and R).

    BAM (NOISE 1 Weibull, 2 Lognormal): the weights are row-softmax(y + n), y = z − c the base's
    logits and n the noise term drawn in the tile, and r_i is their log-sum-exp. With a KL term
    (KL 1 or 2) the same pass keeps the base's row log-sum-exp RB_i = LSE_j y_ij and writes, per
    row, the KL part TROW_i and KS_i (`_kl_fold`, `_kl_rows`); under KL_LINEAR (below) RB_i alone,
    and the caller forms the other two from sums over the sequence (`bam.LinearKl`). MIX (BAM over
    HNAS): the base's logits are HNAS's log-weights (`_mix_shares`, from DNAS's and softmax's row
    statistics RD and RS of an earlier pass)."""
    scale = tl.load(SCALE).to(ACC)
    noise_scale = tl.load(SCALE + 1).to(ACC)
    start_m = tl.program_id(0) * BLOCK_M
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
    mb = tl.full([BLOCK_M], FLOOR, dtype=ACC)  # the base's running maximum and sum (KL)
    lb = tl.zeros([BLOCK_M], dtype=ACC)
    t0 = tl.zeros([BLOCK_M], dtype=ACC)  # Weibull: Σ a_j; Lognormal: the allowed keys
    t1 = tl.zeros([BLOCK_M], dtype=ACC)  # Weibull: Σ a_j y_ij; Lognormal: Σ (y − a − m)
    t2 = tl.zeros([BLOCK_M], dtype=ACC)  # Lognormal: Σ (y − a − m)²
    # KEYS_BY_C: DNAS's c_j is +inf past S_K (`_key_block`) and for a key no query sees, a padded
    # one among them (`_column_pass`), so that the logits z − c there are −inf and weigh nothing:
    # neither a bound on keys nor key padding is then needed per entry (619 to 573 instructions a
    # tile for the bound, bfloat16, sm_90). Where softmax's logits (HNAS), the KL term or HNAS's
    # mixture reach those keys, both stay. The key and query passes follow the same rule.
    KEYS_BY_C: tl.constexpr = SWEEPS > 0 and not (HYBRID or MIX or KL > 0)
    # ROWS_AFTER: query padding is applied once per row after the loop (`_drop_rows`), not per
    # entry: a padded query's row is formed as the others are, then written as 0 with r_i = +inf,
    # which the backward's weights read as 0. The KL term's and the mixture's per-row sums read
    # the allowed pairs themselves and keep it per entry; their padded rows are written the same
    # way, so that every backward (the received mass's without the KL term among them) reads
    # r_i = +inf there.
    # KL_LINEAR (`bam.linear_kl`): the KL part's sums over the logits (Weibull's linear in them,
    # Lognormal's quadratic, without the causal mask) are the caller's; the pass keeps the base's
    # row log-sum-exp alone, over the pairs the weights take, so query padding is applied after
    # the loop (a padded row's RB_i is then its unpadded one, and its KS_i, from the caller, 0).
    KL_LINEAR: tl.constexpr = (KL == 1 or (KL == 2 and not CAUSAL)) and SWEEPS == 0 and not (MIX or HAS_MASK or
                                                                                            HAS_BIAS)
    ROWS_AFTER: tl.constexpr = HAS_QPAD and not (MIX or (KL > 0 and not KL_LINEAR))
    end_n = S_K
    if CAUSAL:
        end_n = tl.minimum(S_K, start_m + BLOCK_M)  # blocks wholly above the diagonal are skipped
    for start_n in range(0, end_n, BLOCK_N):
        if _live(BLOCKS, b, h, start_m // BLOCK_M, start_n // BLOCK_N, stride_bb, stride_bh, stride_bm, stride_bn,
                 HAS_MASK):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = _block(K, b, kvh, offs_n, offs_d, S_K, D, stride_kb, stride_kh, stride_ks)
            v = _block(V, b, kvh, offs_n, offs_dv, S_K, DV, stride_vb, stride_vh, stride_vs)
            z0 = _scores(q, k, scale, BIAS, b, h, offs_m, offs_n, S_Q, S_K, stride_ab, stride_ah, stride_am, stride_an,
                         HAS_BIAS, ACC, DOT)
            ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad,
                          HAS_QPAD and not ROWS_AFTER, HAS_KPAD and not KEYS_BY_C, CAUSAL, h, MASK, stride_mb,
                          stride_mh, stride_mm, stride_mn, HAS_MASK, BOUND_M=False, BOUND_N=not KEYS_BY_C)
            z = z0
            if SWEEPS > 0:
                z = z0 - _key_block(C, b, h, offs_n, stride_cb, stride_ch)[None, :]
            if MIX:
                ok = ok & (z0 > float("-inf"))
                z, _, _, _, _ = _mix_shares(z, z0, ok, b, h, offs_m, S_Q, RD, RS, LOGU, stride_rb, stride_rh)
            y = tl.where(ok, z, float("-inf"))
            x = y
            if NOISE > 0:
                n = _noise(DRAWS, b, h, offs_m, offs_n, H, S_Q, S_K, noise_scale, NOISE, DRAW64, ACC)
                x = tl.where(ok, z + n, float("-inf"))
            m, l, acc = _accumulate(m, l, acc, x, v, ACC, DOT)
            if HYBRID:
                m2, l2, acc2 = _accumulate(m2, l2, acc2, tl.where(ok, z0, float("-inf")), v, ACC, DOT)
            if KL_LINEAR:
                mb, lb = _lse_fold(mb, lb, y, 1)
            elif KL > 0:
                mb, lb, t0, t1, t2 = _kl_fold(z, y, ok, mb, lb, t0, t1, t2, PRIOR, b, h, offs_n, S_K, stride_pb,
                                              stride_ph, stride_pn, KL, ACC)
    if HAS_QPAD:
        padded = _padded(QPAD, b, offs_m, S_Q, stride_qpad)
        acc, m, l = _drop_rows(acc, m, l, padded)
        if HYBRID:
            acc2, m2, l2 = _drop_rows(acc2, m2, l2, padded)
    _finish_row(O, R, acc, m, l, b, h, offs_m, offs_dv, S_Q, DV, stride_ob, stride_oh, stride_os, stride_rb, stride_rh)
    if KL > 0:
        _kl_rows(RB, KS, TROW, mb, lb, t0, t1, t2, b, h, offs_m, S_Q, stride_rb, stride_rh, KL, KL_LINEAR)
    if HYBRID:
        _finish_row(O2, R2, acc2, m2, l2, b, h, offs_m, offs_dv, S_Q, DV, stride_ob, stride_oh, stride_os, stride_rb,
                    stride_rh)


@triton.jit
def _shared(x, share, SHARE: tl.constexpr):
    """x times one branch of HNAS's share of its head (u or 1 − u) under SHARE, where x is linear
    in dO (dO vᵀ, or the weights that multiply dO): the branch's dO is then `share·dO` without
    being formed. Scaling the dO block itself would need a second copy of it in shared memory
    for the product (32 KiB more at head dimension 256, past sm_80's limit); these are register
    tiles. x itself otherwise."""
    if SHARE:
        return x * share
    else:
        return x


@triton.jit
def _plain_weights(t2, ok, r, T: tl.constexpr = False):
    """Softmax's weights exp(z − r_i) on a tile whose scores t2 were formed in the exps' base (the
    scale times log2 e as their one multiply, `_in_exp_base`), 0 where excluded. Each weight is
    then one fused multiply-add (the product times the scale, less r_i in the same base) and an
    exp2, where scores in the natural base take a multiply more per entry (`_weights`). With T
    the tile is formed transposed (keys × queries)."""
    return tl.where(ok, _exp_in_base(t2 - _per_row(_in_exp_base(r), T)), 0.0)


@triton.jit
def _key_grads(dv, dk, gt, da, p, y, ok, q, k, v, w_d, w_s, pi_d, pi_s, share, scale, DO, DELTA, DQ, PRIOR, RB, KS,
               DKL, RHO_D, RHO_S, b, h, offs_m, offs_n, offs_d, offs_dv, H, S_Q, S_K, D, DV, stride_qb, stride_qh,
               stride_qs, stride_dob, stride_doh, stride_dos, stride_rb, stride_rh, stride_pb, stride_ph, stride_pn,
               SWEEPS: tl.constexpr, KL: tl.constexpr, MIX: tl.constexpr, SHARE: tl.constexpr, ATOMIC_DQ: tl.constexpr,
               T: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, HAS_BIAS: tl.constexpr,
               KL_LINEAR: tl.constexpr):
    """One query block's share of `_key_pass`'s sums for its key block and query head, given the
    tile's weights p, the base's logits y and the allowed pairs, formed (queries × keys), or (keys
    × queries) with T: dV; dK's main part Σ_i dS_ij q_i, added to dk (summed over the group's query
    heads); the tile of dy, the gradient in DNAS's logits (its branch's share of it under MIX),
    added to gt, whose sum over the tile's queries is g_j = Σ_i dy_ij; and, with a KL term, the
    prior's gradient. SHARE: dO is this query head's `share` of the block read (`_shared`).
    ATOMIC_DQ (softmax's base, no sweeps: dz is dS¹): the tile's share of dQ, s·dS¹ k, added to
    DQ (laid out as q, in ACC's dtype) by atomic adds. KL_LINEAR: the KL part's tile term without
    its terms that are sums over the logits (`_kl_tile`'s LINEAR)."""
    do = _block(DO, b, h, offs_m, offs_dv, S_Q, DV, stride_dob, stride_doh, stride_dos)
    delta = _rows(DELTA, b, h, offs_m, S_Q, stride_rb, stride_rh)
    if T:
        dv += tl.dot(_shared(p, share, SHARE).to(do.dtype), do, out_dtype=ACC, input_precision=DOT)
        dp = _shared(tl.dot(v, tl.trans(do), out_dtype=ACC, input_precision=DOT), share, SHARE)
    else:
        dv += tl.dot(tl.trans(_shared(p, share, SHARE)).to(do.dtype), do, out_dtype=ACC, input_precision=DOT)
        dp = _shared(tl.dot(do, tl.trans(v), out_dtype=ACC, input_precision=DOT), share, SHARE)
    ds = p * (dp - _per_row(delta, T))
    if KL > 0:
        dy_kl, da_tile = _kl_tile(y, ok, b, h, offs_m, offs_n, S_Q, S_K, H, PRIOR, RB, KS, DKL,
                                  stride_pb, stride_ph, stride_pn, stride_rb, stride_rh, KL, ACC, T, HAS_BIAS,
                                  KL_LINEAR)
        ds += dy_kl
        da += da_tile
    dy_d = ds  # the gradient in DNAS's logits z − c
    if MIX:
        rho_d = _rows(RHO_D, b, h, offs_m, S_Q, stride_rb, stride_rh)
        rho_s = _rows(RHO_S, b, h, offs_m, S_Q, stride_rb, stride_rh)
        dy_d, ds = _mix_split(ds, w_d, w_s, pi_d, pi_s, rho_d, rho_s, T)
    if T:
        dk += tl.dot(ds.to(q.dtype), q, out_dtype=ACC, input_precision=DOT)
    else:
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, out_dtype=ACC, input_precision=DOT)
    if SWEEPS > 0:
        gt += dy_d
    if ATOMIC_DQ:
        if T:
            dq = tl.dot(tl.trans(ds).to(k.dtype), k, out_dtype=ACC, input_precision=DOT)
        else:
            dq = tl.dot(ds.to(k.dtype), k, out_dtype=ACC, input_precision=DOT)
        tl.atomic_add(DQ + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :], dq * scale,
                      mask=(offs_m[:, None] < S_Q) & (offs_d[None, :] < D), sem="relaxed")
    return dv, dk, gt, da


@triton.jit
def _key_allowed(offs_m, offs_n, b, h, S_Q, S_K, QPAD, KPAD, MASK, stride_qpad, stride_kpad, stride_mb, stride_mh,
                 stride_mm, stride_mn, HAS_QPAD: tl.constexpr, HAS_KPAD: tl.constexpr, HAS_MASK: tl.constexpr,
                 CAUSAL: tl.constexpr, BOUND_M: tl.constexpr, T: tl.constexpr, BOUND_N: tl.constexpr = False):
    """`_allowed` for a key pass's tile, (keys × queries) with T: the conditions on keys and queries
    trade places. The keys past S_K need a bound (BOUND_N) only where the pass adds to dQ: else
    they reach no stored output. The queries past S_Q need one (BOUND_M) only where a term not
    weighted by p reaches them (KL's, MIX's): the pass reads r_i = +inf there, so that their
    weights and dS are 0."""
    if T:
        ok = _allowed(offs_n, offs_m, b, S_K, S_Q, KPAD, QPAD, stride_kpad, stride_qpad, HAS_KPAD, HAS_QPAD, False,
                      h, MASK, stride_mb, stride_mh, stride_mn, stride_mm, HAS_MASK, BOUND_M=BOUND_N, BOUND_N=BOUND_M)
        if CAUSAL:
            ok = ok & (offs_n[:, None] <= offs_m[None, :])
    elif HAS_QPAD:
        # Query padding reads the queries past S_Q as padded, so the bound excludes nothing more; left
        # out, Triton 3.6 compiled this form's loop to 90 more instructions a tile (bfloat16, sm_90).
        ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad, HAS_QPAD, HAS_KPAD, CAUSAL,
                      h, MASK, stride_mb, stride_mh, stride_mm, stride_mn, HAS_MASK, BOUND_N=BOUND_N)
    else:
        ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad, HAS_QPAD, HAS_KPAD, CAUSAL,
                      h, MASK, stride_mb, stride_mh, stride_mm, stride_mn, HAS_MASK, BOUND_M=BOUND_M, BOUND_N=BOUND_N)
    return ok


@triton.jit
def _key_pass(Q, K, V, C, R, DO, DELTA, DK, DV_OUT, DQ, G, MASS, QBAR, QPAD, KPAD, MASK, BLOCKS, BIAS, DRAWS, PRIOR, RB, KS, DKL,
              DA, RD, RS, LOGU, RHO_D, RHO_S, SHARES, stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
              stride_dob, stride_doh, stride_dos, stride_cb, stride_ch, stride_rb, stride_rh,
              stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs, stride_qbarb, stride_qbarh,
              stride_qbars, stride_qpad, stride_kpad, stride_mb, stride_mh, stride_mm, stride_mn, stride_bb,
              stride_bh, stride_bm, stride_bn, stride_ab, stride_ah, stride_am, stride_an, stride_pb, stride_ph,
              stride_pn, H, H_KV, GROUP, S_Q, S_K, D, DV, SCALE,
              SWEEPS: tl.constexpr, HAS_QPAD: tl.constexpr, HAS_KPAD: tl.constexpr, HAS_MASK: tl.constexpr,
              HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, NOISE: tl.constexpr, KL: tl.constexpr,
              DRAW64: tl.constexpr, MIX: tl.constexpr, SHARE: tl.constexpr, ADD: tl.constexpr,
              GRADS: tl.constexpr, ATOMIC_DQ: tl.constexpr, TRANSPOSE: tl.constexpr, ACC: tl.constexpr,
              DOT: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One key block of one (batch, key/value head) per program, over its group's query heads
    and every query block: dV, dK (with DNAS's correction −g_j · QBAR_j, QBAR the column pass's
    mean of the queries, once g_j is known), g_j per query head (for the query pass) and, with
    GRADS off, only the received mass Σ_i p_ij per query head. BAM's noise is
    drawn again in each tile; with a KL term its part joins dS¹ and the prior's gradient DA
    (per query head, laid out as C) is summed over the queries (under KL_LINEAR, below, the
    part's terms that are sums over the logits are the caller's: their dK term comes in QBAR and
    DA is left as the caller wrote it). MIX (BAM over HNAS): dS¹ is the gradient in HNAS's log-weights,
    split between the branches by their shares (`_mix_shares`) with the per-row sums RHO_D and
    RHO_S of `_query_pass`'s ROWS stage; DNAS's branch takes the column correction. SHARE and ADD (HNAS's branches): each query head's dO is its share of the
    given dO (`SHARES`, one per query head), and with ADD dK and dV are added to what DK and
    DV_OUT hold (the other branch's), not written over it.

    ATOMIC_DQ (softmax's base: softmax, and BAM over it; no sweeps, no mixture, no share): the pass
    also adds each tile's share of dQ to DQ by atomic adds (`_key_grads`), as FlashAttention-2's
    backward does, so that each tile's weights, and BAM's draws among them, are formed once in
    the backward instead of twice and `_query_pass` is not launched. The order of the adds, and
    so dQ's last bits, varies from run to run: under libtorch's deterministic algorithms the
    query pass forms dQ instead (`plans._backward`).

    TRANSPOSE (the configuration's, `plans.Config`): each tile is formed transposed, zᵀ = s·k qᵀ
    (keys × queries), as FlashAttention-2's backward forms it. The weights and dS then enter their
    products (pᵀ dO, dSᵀ Q) as the left operand straight from the registers that formed them, and
    the sums over queries run along a row of the tensor cores' layout; formed (queries × keys),
    each of the two is first transposed through shared memory, with a barrier, on every tile. In
    exchange the per-query statistics r_i and D_i are read once per column a thread holds, not once
    per row."""
    scale = tl.load(SCALE).to(ACC)
    noise_scale = tl.load(SCALE + 1).to(ACC)
    # PLAIN (softmax's weights with nothing added to the scores): the scores are formed in the
    # exps' base and only the weights read them (`_plain_weights`).
    PLAIN: tl.constexpr = SWEEPS == 0 and NOISE == 0 and KL == 0 and not (MIX or HAS_BIAS)
    # KL_LINEAR (`bam.linear_kl`, as in `_row_pass`): the KL part's terms that are sums over the
    # logits are the caller's. Their dK term (Weibull's dkl·a_j·Σ_i q_i over the queries that see
    # key j) comes in QBAR (which DNAS's correction reads otherwise) and is added once per query
    # head; the prior's gradient DA is the caller's alone. What the tile keeps, −dkl·KS_i·π_ij, is
    # weighted by KS_i, 0 for a padded query and past S_Q (the caller's, and the load's fill), where
    # π stays finite (RB_i bounds the scores of the keys row i sees; past S_Q, the queries and so
    # the scores are 0).
    KL_LINEAR: tl.constexpr = (KL == 1 or (KL == 2 and not CAUSAL)) and SWEEPS == 0 and not (MIX or HAS_MASK or
                                                                                            HAS_BIAS)
    # PAD_AFTER: neither padding is applied per entry. A padded query weighs 0 through r_i = +inf
    # (`_row_pass`'s ROWS_AFTER); a padded key's weights, which reach only its own dK, dV, g and
    # mass, are left as they come and those are set to 0 once after the loop. The KL term (but for
    # KL_LINEAR's) and the mixture read the pairs outside the weights and keep both per entry.
    PAD_AFTER: tl.constexpr = not (MIX or (KL > 0 and not KL_LINEAR))
    # With ATOMIC_DQ a key's weights reach every query's dQ: the keys past S_K and the padded ones
    # are excluded per entry (past S_K, exp(0 − r_i) can overflow where the scores are far below 0).
    KEYS_AFTER: tl.constexpr = HAS_KPAD and PAD_AFTER and not ATOMIC_DQ
    tl.static_assert(not ATOMIC_DQ or (GRADS and SWEEPS == 0 and not (MIX or SHARE)),
                     "_key_pass: dQ by atomics serves softmax's base alone (dz = dS¹)")
    scale_z = scale
    if PLAIN:
        scale_z = _in_exp_base(scale)
    start_n = tl.program_id(0) * BLOCK_N
    bk = tl.program_id(1)
    b, kvh = bk // H_KV, bk % H_KV
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = _block(K, b, kvh, offs_n, offs_d, S_K, D, stride_kb, stride_kh, stride_ks)
    v = _block(V, b, kvh, offs_n, offs_dv, S_K, DV, stride_vb, stride_vh, stride_vs)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=ACC)
    if KEYS_AFTER:
        dropped = _padded(KPAD, b, offs_n, S_K, stride_kpad)  # read once
    start_m0 = 0
    if CAUSAL:
        start_m0 = (start_n // BLOCK_M) * BLOCK_M  # query blocks wholly above the diagonal see none of these keys
    for i in range(0, GROUP):
        h = kvh * GROUP + i
        share = scale  # read only under SHARE
        if SHARE:
            share = tl.load(SHARES + h).to(ACC)
        c = tl.zeros([BLOCK_N], dtype=ACC)
        if SWEEPS > 0:
            c = _rows(C, b, h, offs_n, S_K, stride_cb, stride_ch)
        # g's terms, summed over the queries after the loop
        if TRANSPOSE:
            gt = tl.zeros([BLOCK_N, BLOCK_M], dtype=ACC)
        else:
            gt = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        mass = tl.zeros([BLOCK_N], dtype=ACC)
        da = tl.zeros([BLOCK_N], dtype=ACC)
        for start_m in range(start_m0, S_Q, BLOCK_M):
            if _live(BLOCKS, b, h, start_m // BLOCK_M, start_n // BLOCK_N, stride_bb, stride_bh, stride_bm, stride_bn,
                     HAS_MASK):
                offs_m = start_m + tl.arange(0, BLOCK_M)
                q = _block(Q, b, h, offs_m, offs_d, S_Q, D, stride_qb, stride_qh, stride_qs)
                # +inf past S_Q, so that the queries there weigh 0 without a bound per entry
                r = _rows(R, b, h, offs_m, S_Q, stride_rb, stride_rh, float("inf"))
                # key padding reads the keys past S_K as padded: the bound on keys is needed without it
                ok = _key_allowed(offs_m, offs_n, b, h, S_Q, S_K, QPAD, KPAD, MASK, stride_qpad, stride_kpad,
                                  stride_mb, stride_mh, stride_mm, stride_mn, HAS_QPAD and not PAD_AFTER,
                                  HAS_KPAD and not KEYS_AFTER, HAS_MASK, CAUSAL, not PAD_AFTER, TRANSPOSE,
                                  BOUND_N=ATOMIC_DQ and not HAS_KPAD)
                if TRANSPOSE:  # (BLOCK_N, BLOCK_M), keys × queries
                    zr = _scores(k, q, scale_z, BIAS, b, h, offs_n, offs_m, S_K, S_Q, stride_ab, stride_ah, stride_an,
                                 stride_am, HAS_BIAS, ACC, DOT)
                else:  # (BLOCK_M, BLOCK_N)
                    zr = _scores(q, k, scale_z, BIAS, b, h, offs_m, offs_n, S_Q, S_K, stride_ab, stride_ah, stride_am,
                                 stride_an, HAS_BIAS, ACC, DOT)
                z = zr - _per_key(c, TRANSPOSE)
                y, w_d, w_s, pi_d, pi_s = z, z, z, z, z  # the shares are MIX's
                if MIX:
                    ok = ok & (zr > float("-inf"))
                    y, w_d, w_s, pi_d, pi_s = _mix_shares(z, zr, ok, b, h, offs_m, S_Q, RD, RS, LOGU, stride_rb,
                                                          stride_rh, TRANSPOSE)
                if PLAIN:
                    p = _plain_weights(zr, ok, r, TRANSPOSE)
                else:
                    p = _weights(y, ok, r, DRAWS, b, h, offs_m, offs_n, H, S_Q, S_K, noise_scale, NOISE, DRAW64,
                                 ACC, TRANSPOSE)
                mass += _over_queries(p, TRANSPOSE)
                if GRADS:
                    dv, dk, gt, da = _key_grads(
                        dv, dk, gt, da, p, y, ok, q, k, v, w_d, w_s, pi_d, pi_s, share, scale, DO, DELTA, DQ, PRIOR,
                        RB, KS, DKL, RHO_D, RHO_S, b, h, offs_m, offs_n, offs_d, offs_dv, H, S_Q, S_K, D, DV,
                        stride_qb, stride_qh, stride_qs, stride_dob, stride_doh, stride_dos, stride_rb, stride_rh,
                        stride_pb, stride_ph, stride_pn, SWEEPS, KL, MIX, SHARE, ATOMIC_DQ, TRANSPOSE, ACC, DOT,
                        HAS_BIAS, KL_LINEAR)
        if GRADS:
            if SWEEPS > 0:
                g = _over_queries(gt, TRANSPOSE)  # once per head, not once per tile
                if KEYS_AFTER:
                    g = tl.where(dropped, 0.0, g)
                qbar = _block(QBAR, b, h, offs_n, offs_d, S_K, D, stride_qbarb, stride_qbarh, stride_qbars)
                dk -= g[:, None] * qbar.to(ACC)  # DNAS's correction; the main part went into dk
                _store_rows(G, g, b, h, offs_n, S_K, stride_cb, stride_ch)
            if KL_LINEAR:
                dk += _block(QBAR, b, h, offs_n, offs_d, S_K, D, stride_qbarb, stride_qbarh, stride_qbars).to(ACC)
            elif KL > 0:
                _store_rows(DA, da, b, h, offs_n, S_K, stride_cb, stride_ch)
        else:
            if KEYS_AFTER:
                mass = tl.where(dropped, 0.0, mass)
            _store_rows(MASS, mass, b, h, offs_n, S_K, stride_cb, stride_ch)
    if GRADS:
        dk = dk * scale
        if KEYS_AFTER:
            dk = tl.where(dropped[:, None], 0.0, dk)
            dv = tl.where(dropped[:, None], 0.0, dv)
        if ADD:
            dk += _block(DK, b, kvh, offs_n, offs_d, S_K, D, stride_dkb, stride_dkh, stride_dks).to(ACC)
            dv += _block(DV_OUT, b, kvh, offs_n, offs_dv, S_K, DV, stride_dvb, stride_dvh, stride_dvs).to(ACC)
        _store_block(DK, dk, b, kvh, offs_n, offs_d, S_K, D, stride_dkb, stride_dkh, stride_dks)
        _store_block(DV_OUT, dv, b, kvh, offs_n, offs_dv, S_K, DV, stride_dvb, stride_dvh, stride_dvs)


@triton.jit
def _query_dz(ds, p, z, ok, r, w_d, w_s, pi_d, pi_s, rho_d, rho_s, G, b, h, offs_n, S_K, stride_cb, stride_ch,
              SWEEPS: tl.constexpr, MIX: tl.constexpr, NOISE: tl.constexpr):
    """dz on one tile of `_query_pass`: dS¹ (DNAS's branch's share under MIX, `_mix_split`) less
    DNAS's column correction exp(z_ij − c_j) g_j, z the scores less c."""
    if MIX:
        _, ds = _mix_split(ds, w_d, w_s, pi_d, pi_s, rho_d, rho_s)
    if SWEEPS > 0:
        g = _key_block(G, b, h, offs_n, stride_cb, stride_ch)  # 0 past S_K, where the weights are 0
        ds -= _column_weights(p, z, ok, r, NOISE, MIX) * g[None, :]
    return ds


@triton.jit
def _column_weights(p, z, ok, r, NOISE: tl.constexpr, MIX: tl.constexpr):
    """DNAS's column weights exp(z_ij − c_j) on a tile (z the scores less c, 0 where excluded). With
    weights p = exp(z − r_i) that carry no noise and no mixture, p·exp(r_i): a multiply per entry
    where an exp takes three instructions (r_i ≤ log S_k, as each exp(z_ij) ≤ 1)."""
    if NOISE == 0 and not MIX:
        return p * _exp(r)[:, None]
    else:
        return _exp(tl.where(ok, z, float("-inf")))


@triton.jit
def _query_pass(Q, K, V, C, R, DO, DELTA, G, DQ, QPAD, KPAD, MASK, BLOCKS, BIAS, DRAWS, PRIOR, RB, KS, DKL, RD, RS, LOGU,
                RHO_D, RHO_S, GU, SHARES,
                stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                stride_dob, stride_doh, stride_dos, stride_cb, stride_ch, stride_rb, stride_rh,
                stride_dqb, stride_dqh, stride_dqs, stride_qpad, stride_kpad, stride_mb, stride_mh, stride_mm,
                stride_mn, stride_bb, stride_bh, stride_bm, stride_bn, stride_ab, stride_ah, stride_am, stride_an,
                stride_pb, stride_ph, stride_pn, H, GROUP, S_Q, S_K, D, DV, SCALE,
                SWEEPS: tl.constexpr, HAS_QPAD: tl.constexpr, HAS_KPAD: tl.constexpr, HAS_MASK: tl.constexpr,
                HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, NOISE: tl.constexpr, KL: tl.constexpr,
                DRAW64: tl.constexpr, MIX: tl.constexpr, ROWS: tl.constexpr, SHARE: tl.constexpr, ADD: tl.constexpr,
                ACC: tl.constexpr, DOT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """dQ_i = s Σ_j dz_ij k_j, dz_ij = dS¹_ij − exp(z_ij − c_j) g_j, one query block per program
    (with BAM's noise in the weights and the KL part in dS¹, as in `_key_pass`). MIX (BAM over
    HNAS) with ROWS: instead of dQ, the per-row sums the branches' gradients need, RHO_D_i =
    Σ_j w_D dS¹ and RHO_S_i = Σ_j w_S dS¹, and GU_i = Σ_j dS¹·(π_D − π_S)/π for the gate. SHARE and
    ADD as in `_key_pass`: dO is the head's share of the given one, and dQ is added to DQ's."""
    scale = tl.load(SCALE).to(ACC)
    noise_scale = tl.load(SCALE + 1).to(ACC)
    PLAIN: tl.constexpr = SWEEPS == 0 and NOISE == 0 and KL == 0 and not (MIX or HAS_BIAS)  # as in `_key_pass`
    KEYS_BY_C: tl.constexpr = SWEEPS > 0 and not (MIX or KL > 0)  # as in `_row_pass`
    # ROWS_AFTER: a padded query weighs 0 through r_i = +inf (`_row_pass`), and its row of dQ, which
    # DNAS's column weights exp(z_ij − c_j) still reach with noise, is set to 0 once after the loop;
    # the KL term and the mixture keep query padding per entry.
    ROWS_AFTER: tl.constexpr = HAS_QPAD and not (MIX or KL > 0)
    scale_z = scale
    if PLAIN:
        scale_z = _in_exp_base(scale)
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _block(Q, b, h, offs_m, offs_d, S_Q, D, stride_qb, stride_qh, stride_qs)
    share = scale  # read only under SHARE
    if SHARE:
        share = tl.load(SHARES + h).to(ACC)
    do = _block(DO, b, h, offs_m, offs_dv, S_Q, DV, stride_dob, stride_doh, stride_dos)
    r = _rows(R, b, h, offs_m, S_Q, stride_rb, stride_rh)
    r_c = r  # r as the column weights p·exp(r_i) read it: finite, so that 0·exp(r_i) is 0, not NaN
    if ROWS_AFTER:
        r_c = tl.where(r < float("inf"), r, 0.0)
    delta = _rows(DELTA, b, h, offs_m, S_Q, stride_rb, stride_rh)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    rho_d = tl.zeros([BLOCK_M], dtype=ACC)
    rho_s = tl.zeros([BLOCK_M], dtype=ACC)
    gu = tl.zeros([BLOCK_M], dtype=ACC)
    if MIX:
        inv_u = _exp(-tl.load(LOGU + 2 * h))
        inv_1mu = _exp(-tl.load(LOGU + 2 * h + 1))
        if not ROWS:
            rho_d = _rows(RHO_D, b, h, offs_m, S_Q, stride_rb, stride_rh)
            rho_s = _rows(RHO_S, b, h, offs_m, S_Q, stride_rb, stride_rh)
    end_n = S_K
    if CAUSAL:
        end_n = tl.minimum(S_K, start_m + BLOCK_M)
    for start_n in range(0, end_n, BLOCK_N):
        if _live(BLOCKS, b, h, start_m // BLOCK_M, start_n // BLOCK_N, stride_bb, stride_bh, stride_bm, stride_bn,
                 HAS_MASK):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = _block(K, b, kvh, offs_n, offs_d, S_K, D, stride_kb, stride_kh, stride_ks)
            v = _block(V, b, kvh, offs_n, offs_dv, S_K, DV, stride_vb, stride_vh, stride_vs)
            zr = _scores(q, k, scale_z, BIAS, b, h, offs_m, offs_n, S_Q, S_K, stride_ab, stride_ah, stride_am,
                         stride_an, HAS_BIAS, ACC, DOT)
            z = zr
            if SWEEPS > 0:
                z = zr - _key_block(C, b, h, offs_n, stride_cb, stride_ch)[None, :]
            ok = _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad,
                          HAS_QPAD and not ROWS_AFTER, HAS_KPAD and not KEYS_BY_C, CAUSAL, h, MASK, stride_mb,
                          stride_mh, stride_mm, stride_mn, HAS_MASK, BOUND_M=False, BOUND_N=not KEYS_BY_C)
            y, w_d, w_s, pi_d, pi_s = z, z, z, z, z  # the shares are MIX's
            if MIX:
                ok = ok & (zr > float("-inf"))
                y, w_d, w_s, pi_d, pi_s = _mix_shares(z, zr, ok, b, h, offs_m, S_Q, RD, RS, LOGU, stride_rb, stride_rh)
            if PLAIN:
                p = _plain_weights(zr, ok, r)
            else:
                p = _weights(y, ok, r, DRAWS, b, h, offs_m, offs_n, H, S_Q, S_K, noise_scale, NOISE, DRAW64, ACC)
            dp = _shared(tl.dot(do, tl.trans(v), out_dtype=ACC, input_precision=DOT), share, SHARE)
            ds = p * (dp - delta[:, None])
            if KL > 0:
                dy_kl, _ = _kl_tile(y, ok, b, h, offs_m, offs_n, S_Q, S_K, H, PRIOR, RB, KS, DKL, stride_pb, stride_ph,
                                    stride_pn, stride_rb, stride_rh, KL, ACC, INF=HAS_BIAS)
                ds += dy_kl
            if ROWS:
                rho_d += tl.sum(w_d * ds, 1)
                rho_s += tl.sum(w_s * ds, 1)
                gu += tl.sum(ds * (w_d * inv_u - w_s * inv_1mu), 1)
            else:
                dz = _query_dz(ds, p, z, ok, r_c, w_d, w_s, pi_d, pi_s, rho_d, rho_s, G, b, h, offs_n, S_K, stride_cb,
                               stride_ch, SWEEPS, MIX, NOISE)
                dq += tl.dot(dz.to(k.dtype), k, out_dtype=ACC, input_precision=DOT)
    if ROWS:
        _store_rows(RHO_D, rho_d, b, h, offs_m, S_Q, stride_rb, stride_rh)
        _store_rows(RHO_S, rho_s, b, h, offs_m, S_Q, stride_rb, stride_rh)
        _store_rows(GU, gu, b, h, offs_m, S_Q, stride_rb, stride_rh)
    else:
        dq = dq * scale
        if ROWS_AFTER:
            dq = tl.where(_padded(QPAD, b, offs_m, S_Q, stride_qpad)[:, None], 0.0, dq)
        if ADD:
            dq += _block(DQ, b, h, offs_m, offs_d, S_Q, D, stride_dqb, stride_dqh, stride_dqs).to(ACC)
        _store_block(DQ, dq, b, h, offs_m, offs_d, S_Q, D, stride_dqb, stride_dqh, stride_dqs)

"""What every kernel of the plans shares: which pairs of a tile take part, loading blocks, the
scores with the additive mask, the block map, and online log-sum-exps (`probattn_tools.kernels.plans`
describes the kernels)."""

import triton
import triton.language as tl


# A finite floor for the running maxima: a fully masked block then leaves them finite, and
# exp(-inf − floor) is exactly 0 where exp(-inf − -inf) would be NaN.
FLOOR = tl.constexpr(-1.0e30)
# log2 e: the exps are taken as exp2 of their argument times it (`_exp`, `_exp_less`).
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _padded(PAD, b, offs, n, stride_pad):
    """Whether each of a block's queries or keys is padded, from a (B, S) padding mask (nonzero where
    padded); those past n count as padded."""
    return tl.load(PAD + b * stride_pad + offs, mask=offs < n, other=1) != 0


@triton.jit
def _allowed(offs_m, offs_n, b, S_Q, S_K, QPAD, KPAD, stride_qpad, stride_kpad,
             HAS_QPAD: tl.constexpr, HAS_KPAD: tl.constexpr, CAUSAL: tl.constexpr,
             h, MASK, stride_mb, stride_mh, stride_mm, stride_mn, HAS_MASK: tl.constexpr,
             BOUND_M: tl.constexpr = True, BOUND_N: tl.constexpr = True):
    """(BLOCK_M, BLOCK_N): which (query, key) pairs of the tile take part. MASK: a boolean
    pattern broadcast to (B, H, S_q, S_k) through its strides (0 on broadcast dimensions),
    nonzero where the pair takes part.

    BOUND_M and BOUND_N: whether queries past S_Q and keys past S_K are excluded. A pass may
    leave out the bound of the axis it does not reduce over: what lies past it reaches only
    outputs that are never stored (a row pass's rows past S_Q, a key pass's keys past S_K),
    and each bound left out saves a select per score entry."""
    ok = True
    if BOUND_M:
        ok = offs_m[:, None] < S_Q
    if BOUND_N:
        ok = ok & (offs_n[None, :] < S_K)
    if HAS_MASK:
        at = MASK + b * stride_mb + h * stride_mh + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn
        pattern = tl.load(at, mask=(offs_m[:, None] < S_Q) & (offs_n[None, :] < S_K), other=0)
        ok = ok & (pattern != 0)
    if HAS_QPAD:
        ok = ok & ~_padded(QPAD, b, offs_m, S_Q, stride_qpad)[:, None]
    if HAS_KPAD:
        ok = ok & ~_padded(KPAD, b, offs_n, S_K, stride_kpad)[None, :]
    if CAUSAL:
        ok = ok & (offs_n[None, :] <= offs_m[:, None])
    return ok


@triton.jit
def _per_row(x, T: tl.constexpr):
    """A per-query vector broadcast over a tile's keys: x[:, None], or x[None, :] in a tile formed
    transposed (T: keys × queries, as the key pass forms its tiles)."""
    if T:
        return x[None, :]
    else:
        return x[:, None]


@triton.jit
def _per_key(x, T: tl.constexpr):
    """A per-key vector broadcast over a tile's queries: x[None, :], or x[:, None] in a tile formed
    transposed (T)."""
    if T:
        return x[:, None]
    else:
        return x[None, :]


@triton.jit
def _over_queries(x, T: tl.constexpr):
    """A tile's sums over its queries, one per key: along axis 0, or axis 1 when formed
    transposed (T)."""
    if T:
        return tl.sum(x, 1)
    else:
        return tl.sum(x, 0)


@triton.jit
def _block(P, b, h, offs, cols, n, width, stride_b, stride_h, stride_s):
    """Rows `offs` (< n) and columns `cols` (< width) of head h of batch b of a (B, H, S, width)
    tensor laid out by its strides; zeros outside."""
    return tl.load(P + b * stride_b + h * stride_h + offs[:, None] * stride_s + cols[None, :],
                   mask=(offs[:, None] < n) & (cols[None, :] < width), other=0.0)


@triton.jit
def _store_block(P, x, b, h, offs, cols, n, width, stride_b, stride_h, stride_s):
    """Writes x, in P's dtype, to rows `offs` (< n) and columns `cols` (< width) of head h of batch
    b of a (B, H, S, width) tensor laid out by its strides (`_block`'s inverse)."""
    tl.store(P + b * stride_b + h * stride_h + offs[:, None] * stride_s + cols[None, :],
             x.to(P.dtype.element_ty), mask=(offs[:, None] < n) & (cols[None, :] < width))


@triton.jit
def _rows(P, b, h, offs, n, stride_b, stride_h, FILL: tl.constexpr = 0.0):
    """Entries `offs` (< n) of head h of batch b of a (B, H, S) per-row or per-key statistic laid
    out by its strides; FILL outside (0 unless given)."""
    return tl.load(P + b * stride_b + h * stride_h + offs, mask=offs < n, other=FILL)


@triton.jit
def _key_block(P, b, h, offs_n, stride_b, stride_h):
    """Entries `offs_n` (one key block) of head h of batch b of a per-key statistic, read without
    a bound. The per-key statistics are laid out in whole blocks of keys (`plans.KEY_BLOCK`), their
    padding past S_k +inf for a column statistic c (so that exp(z − c) weighs those keys 0) and 0
    for the others. A bound took a compare, a select and the predicate's bookkeeping for each key
    a thread holds: DNAS's row pass went from 541 instructions a tile to 387 without it
    (bfloat16, sm_90)."""
    return tl.load(P + b * stride_b + h * stride_h + offs_n)


@triton.jit
def _store_rows(P, x, b, h, offs, n, stride_b, stride_h):
    """Writes x to entries `offs` (< n) of head h of batch b of a (B, H, S) statistic (`_rows`'s
    inverse)."""
    tl.store(P + b * stride_b + h * stride_h + offs, x, mask=offs < n)


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
def _exp(x):
    """exp(x). In float32 as exp2(x·log2 e): one approximate exp2 on the GPU, where `tl.exp` adds
    the handling of results below 2^-126 (three instructions more), which weights need not keep
    (they flush to 0). Float64 keeps `tl.exp`."""
    if x.dtype == tl.float64:
        return tl.exp(x)
    else:
        return tl.exp2(x * LOG2E)


@triton.jit
def _in_exp_base(m):
    """A statistic (per row or per key) as `_exp_less` takes it: m·log2 e in float32, where the
    exps are exp2; m itself in float64. One multiply per row or key, not one per entry."""
    if m.dtype == tl.float64:
        return m
    else:
        return m * LOG2E


@triton.jit
def _exp_less(x, m2):
    """exp(x − m) on a tile x, m2 = `_in_exp_base(m)` broadcast to it. In float32 as
    exp2(x·log2 e − m2): one fused multiply-add before the exp2, where `_exp(x − m)` takes a
    subtraction and a multiply, one instruction more per entry. Rounding m·log2 e is one more
    rounding of m, of the size of its own float32 rounding, shared by the entries that use it; an
    online fold rescales its sums by the exp2 of the difference of the same rounded values
    (`_rescale`), so the terms folded before and after its maximum moved stay on one footing. 0
    where x is −inf (m finite or +inf) and where m is +inf."""
    if x.dtype == tl.float64:
        return tl.exp(x - m2)
    else:
        return tl.exp2(x * LOG2E - m2)


@triton.jit
def _exp_in_base(x2):
    """exp of a value already in the exps' base (`_in_exp_base`): exp2(x2) in float32, exp(x2) in
    float64."""
    if x2.dtype == tl.float64:
        return tl.exp(x2)
    else:
        return tl.exp2(x2)


@triton.jit
def _rescale(m, m_new):
    """exp(m − m_new), the factor by which an online fold's sums move when its running maximum
    moves from m to m_new, as the exp2 of the difference of the two maxima rounded into the exps'
    base: the same rounded values that the entries folded against them were exponentiated
    against (`_exp_less`), so that a sum's terms from before and after the move carry the same
    rounding of each maximum (in the natural base they differed by up to 2^-23·|m| relatively).
    Its cost is per row or key, not per entry; both maxima stay finite (FLOOR)."""
    return _exp_in_base(_in_exp_base(m) - _in_exp_base(m_new))


@triton.jit
def _lse_fold(m, l, z, AXIS: tl.constexpr):
    """One block of an online log-sum-exp along AXIS: the running maximum m and the sum l of
    exp(x − m), updated with the block z (−inf where excluded)."""
    m_new = tl.maximum(m, tl.max(z, AXIS))
    return m_new, l * _rescale(m, m_new) + tl.sum(_exp_less(z, tl.expand_dims(_in_exp_base(m_new), AXIS)), AXIS)


@triton.jit
def _lse_value(m, l, EMPTY: tl.constexpr):
    """The log-sum-exp an online fold reached; EMPTY where nothing was allowed (l = 0)."""
    return tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), EMPTY)


@triton.jit
def _accumulate(m, l, acc, z, v, ACC: tl.constexpr, DOT: tl.constexpr):
    """One key block of the row pass's online softmax: the running maximum, sum and value
    accumulator, updated with the logits z (−inf where excluded) and the value block v."""
    m_new = tl.maximum(m, tl.max(z, 1))
    p = _exp_less(z, _in_exp_base(m_new)[:, None])
    alpha = _rescale(m, m_new)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=ACC, input_precision=DOT)
    return m_new, l * alpha + tl.sum(p, 1), acc


@triton.jit
def _finish_row(O, R, acc, m, l, b, h, offs_m, offs_dv, S_Q, DV, stride_ob, stride_oh, stride_os, stride_rb, stride_rh):
    """Writes a row pass's output acc / l and its row statistic m + log l (0 for an empty row,
    whose statistic is never read)."""
    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    r = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), 0.0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_dv[None, :],
             out.to(O.dtype.element_ty), mask=(offs_m[:, None] < S_Q) & (offs_dv[None, :] < DV))
    _store_rows(R, r, b, h, offs_m, S_Q, stride_rb, stride_rh)


@triton.jit
def _drop_rows(acc, m, l, padded):
    """A row pass's accumulators with the padded queries' rows emptied as `_finish_row` then writes
    them: output 0 and r_i = +inf (m = +inf, l = 1), so that the backward's weights exp(z − r_i)
    are 0 in those rows without query padding applied per entry. Per row, once after the loop."""
    return (tl.where(padded[:, None], 0.0, acc), tl.where(padded, float("inf"), m), tl.where(padded, 1.0, l))


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

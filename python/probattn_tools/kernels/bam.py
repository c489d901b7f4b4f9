"""BAM's sampling in the kernels of the plans (Fan et al. 2020; docs/kernels.md): the
counter-based draws of probattn-sys/csrc/noise.cpp, bit for bit, the noise term, the KL term's
gradient per tile, HNAS's log-weights as a base, and what a call says about them (`Sampling`,
`counter_noise`)."""

import math
import os

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from probattn_tools.kernels.tiles import (_exp, _exp_less, _in_exp_base, _lse_fold, _lse_value, _over_queries, _per_key,
                                          _per_row, _rows)


# ---------------------------------------------------------------------------------------------
# BAM's draws: the counter-based generator of probattn-sys/csrc/noise.cpp, bit for bit. Entry
# (b, h, i, j) of a (B, H, S_q, S_k) score tensor has the position e = ((b·H + h)·S_q + i)·S_k + j
# and the 32 bits hash(hash(low(e) ^ hash(high(e) ^ seed_hi)) ^ seed_lo); float64 draws are
# (bits + 1/2) / 2^32, float32 draws (bits >> 9 + 1/2) / 2^23 (exact in float32, below 1).


@triton.jit
def _hash32(x):
    """C. Wellons' two-round integer hash of uint32 values (noise.cpp's hash32)."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0xD35A2D97
    return x ^ (x >> 15)


@triton.jit
def _position(b, h, offs_m, offs_n, H, S_Q, S_K, T: tl.constexpr = False):
    """The int64 position of each entry of the tile in a contiguous (B, H, S_q, S_k) score tensor:
    the counter the draws hash, and where a given ε lies. T: the tile is formed transposed
    (keys × queries); each entry keeps its own position."""
    rows = _per_row(offs_m.to(tl.int64), T)
    return ((b * H + h).to(tl.int64) * S_Q + rows) * S_K + _per_key(offs_n.to(tl.int64), T)


@triton.jit
def _uniform(DRAWS, b, h, offs_m, offs_n, H, S_Q, S_K, DRAW64: tl.constexpr, T: tl.constexpr = False):
    """ε ~ U(0, 1) of the tile (offs_m × offs_n) of (batch b, query head h): float64 from 32 bits
    (DRAW64) or float32 from 23. DRAWS holds the seed's low and high 32-bit words (int64). A tile
    spans fewer than 2^32 positions (BLOCK_M·S_K ≤ 2^32, which the callers hold), so its positions
    have at most two high words, its first row's and the next: each is hashed once per tile. The
    int64 positions are formed per row (the row's key 0); an entry's low word is its row's plus
    its key, in 32 bits, and it takes the next high word where that sum carries: three integer
    instructions per entry where the entry's own int64 position took about ten. T: the tile
    formed transposed (keys × queries)."""
    seed_lo = tl.load(DRAWS).to(tl.uint32)
    seed_hi = tl.load(DRAWS + 1).to(tl.uint32)
    bh = (b * H + h).to(tl.int64)
    start = (bh * S_Q + offs_m.to(tl.int64)) * S_K  # each row's key 0
    word = ((bh * S_Q + tl.min(offs_m, 0).to(tl.int64)) * S_K) >> 32
    first = _hash32(word.to(tl.uint32) ^ seed_hi)
    second = _hash32((word + 1).to(tl.uint32) ^ seed_hi)
    start_lo = _per_row((start & 0xFFFFFFFF).to(tl.uint32), T)
    row_high = _per_row(tl.where((start >> 32) == word, first, second), T)
    low = start_lo + _per_key(offs_n.to(tl.uint32), T)  # wraps past 2^32, as the low word does
    high = tl.where(low < start_lo, second, row_high)
    bits = _hash32(_hash32(low ^ high) ^ seed_lo)
    if DRAW64:
        return (bits.to(tl.float64) + 0.5) * 2.3283064365386963e-10  # 2^-32
    else:
        # (m + 1/2)·2^-23 as one fused multiply-add, exact: m < 2^23.
        return (bits >> 9).to(tl.float32) * 1.1920928955078125e-07 + 5.9604644775390625e-08  # 2^-23, 2^-24


# The GPU's approximate float32 log2 (`lg2.approx.f32`, one MUFU.LG2). CUDA documents its error
# (as `__log2f`'s): at most 2^-22 absolute for x in [0.5, 2] and 2 units in the last place
# elsewhere, so at most 2^-22·max(1, |log2 x|). Triton's interpreter has no such instruction:
# there `_log2_approx` is exact, moved up by that bound, so that the checks run under it see the
# largest error the hardware may make, in the direction that shifts every term alike. APPROX also
# says whether the kernels are compiled, which `_fma32` needs to know.
APPROX = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")
LG2_ERROR = tl.constexpr(2.0 ** -22)
LN2 = tl.constexpr(0.6931471805599453)
LOG2_LN2 = tl.constexpr(-0.5287663729448977)  # log2(ln 2)


@triton.jit
def _log2_approx(x):
    """log2 of positive, normal float32 values, to within 2^-22·max(1, |log2 x|) (above)."""
    if APPROX:
        return libdevice.fast_log2f(x)
    else:
        y = tl.log2(x)
        return y + LG2_ERROR * tl.maximum(tl.abs(y), 1.0)


@triton.jit
def _weibull32(u, scale):
    """scale·log(−log(1 − u)) of float32 draws u (on the 2^-24 grid, in [2^-24, 1 − 2^-24]), in
    float32, from two approximate log2s and no exact log. t = −log2(1 − u) comes from
    `_log2_approx(1 − u)` (1 − u is exact) where u ≥ 1/16; below, where log2(1 − u) is small and
    the log2's error is absolute, from the series log2 e·(u + u²/2 + ... + u⁷/7), whose remainder
    is below 5e-10 of t there. Then log(t·ln 2) = ln 2·(log2 t + log2 ln 2). Within 6e-6 of the exact
    log(−log(1 − u)) for every draw (`weibull_error`; the value itself lies in [−16.6, 2.8], where
    float32's unit in the last place is up to 1.9e-6): where u ≥ 1/16, t's relative error is at
    most 2^-22 / 0.093 = 2.6e-6; the second log2 adds at most ln 2·2^-22·24 = 4.0e-6, at the
    smallest u, where t is 2^-24·log2 e."""
    p = 0.2060992915555662 * u + 0.2404491734814939  # log2 e / 7, / 6, ..., / 1
    p = p * u + 0.28853900817779266
    p = p * u + 0.36067376022224085
    p = p * u + 0.4808983469629878
    p = p * u + 0.7213475204444817
    p = p * u + 1.4426950408889634
    t = tl.where(u < 0.0625, u * p, -_log2_approx(1.0 - u))
    factor = scale * LN2
    return _log2_approx(t) * factor + LOG2_LN2 * factor


@triton.jit
def _weibull_terms(OUT, N, BLOCK: tl.constexpr):
    """`_weibull32` (scale 1) of the float32 draws (m + 1/2)·2^-23, m < N: what `weibull_error`
    checks."""
    m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u = (m.to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23
    tl.store(OUT + m, _weibull32(u, 1.0), mask=m < N)


def weibull_error(device="cpu", count=1 << 23, block=1 << 16):
    """The largest difference between the kernels' Weibull noise term (`_weibull32`, scale 1) and
    log(−log(1 − u)) in float64, over the float32 draws (m + 1/2)·2^-23, m < `count` (all 2^23 by
    default): (the difference, the m where it is largest)."""
    ours = torch.empty(count, dtype=torch.float32, device=device)
    _weibull_terms[(triton.cdiv(count, block),)](ours, count, BLOCK=block)
    u = (torch.arange(count, dtype=torch.float64) + 0.5) * 2.0 ** -23
    diff = (ours.cpu().double() - torch.log(-torch.log1p(-u))).abs()
    worst = int(diff.argmax())
    return float(diff[worst]), worst


@triton.jit
def _erfinv_guess(y):
    """ATen's calc_erfinv's rational first guess at erfinv(y), y in (−1, 1), in y's dtype."""
    z = y * y
    num = ((-0.140543331 * z + 0.914624893) * z + -1.645349621) * z + 0.886226899
    dem = (((0.012229801 * z + -0.329097515) * z + 1.442710462) * z + -2.118377725) * z + 1.0
    inner = y * num / dem
    w = tl.sqrt(-tl.log((1.0 - tl.abs(y)) / 2.0))
    num = ((1.641345311 * w + 3.429567803) * w + -1.624906493) * w + -1.970840454
    dem = (1.6370678 * w + 3.5438892) * w + 1.0
    signed = tl.where(y < 0, -tl.abs(num), tl.abs(num))  # copysign(num, y)
    return tl.where(tl.abs(y) <= 0.7, inner, signed / dem)


@triton.jit
def _erfinv(y):
    """The inverse error function of float64 values in (−1, 1), operation for operation as ATen's
    calc_erfinv (ATen/native/Math.h), which the CPU's `at::erfinv` maps over its inputs: a rational
    first guess, then two Newton steps."""
    x = _erfinv_guess(y)
    x = x - (tl.erf(x) - y) / (1.1283791670955126 * tl.exp(-x * x))  # 2/sqrt(pi)
    return x - (tl.erf(x) - y) / (1.1283791670955126 * tl.exp(-x * x))


@triton.jit
def _fma32(a, b, c):
    """fma(a, b, c) of float32 values, rounded once, as IEEE 754 and C's fmaf define it. Compiled,
    one FFMA. Triton's interpreter rounds the product and the sum apart, so there the product is
    taken in float64, where it is exact, and the sum rounded to odd in float64 (the nearest float64
    with an odd last bit where the sum is inexact); rounding that to float32 rounds the exact sum
    once, since float64 carries at least two bits more than float32 (Boldo and Melquiond,
    "Emulation of FMA and correctly rounded sums: proved algorithms using rounding to odd", IEEE
    Transactions on Computers, 2008)."""
    if APPROX:
        return tl.fma(a, b, c)
    else:
        p = a.to(tl.float64) * b.to(tl.float64)
        c = c + tl.zeros_like(p)
        s = p + c
        back = s - p
        err = (p - (s - back)) + (c - back)  # p + c − s exactly (Knuth's two-sum)
        bits = s.to(tl.int64, bitcast=True)
        away = tl.where((err > 0) == (s > 0), bits + 1, bits - 1)
        odd = tl.where((err != 0) & ((bits & 1) == 0), away, bits)
        return odd.to(tl.float64, bitcast=True).to(tl.float32)


@triton.jit
def _poly8(x, c0, c1, c2, c3, c4, c5, c6, c7, c8):
    """c0 + c1·x + ... + c8·x⁸ of float32 x by Horner's rule, one fused multiply-add a step."""
    p = _fma32(tl.zeros_like(x) + c8, x, c7)
    p = _fma32(p, x, c6)
    p = _fma32(p, x, c5)
    p = _fma32(p, x, c4)
    p = _fma32(p, x, c3)
    p = _fma32(p, x, c2)
    p = _fma32(p, x, c1)
    return _fma32(p, x, c0)


@triton.jit
def _normal32(u):
    """Lognormal's ε of float32 draws u, noise.cpp's `normal32`: the same float32 operations,
    each rounded as IEEE 754 defines it, with the same constants, so that the kernels, the tiles
    and the CPU loop draw the same bits (checked for all 2^23 draws against a numpy form,
    `normal_draws_differ`). It approximates sqrt(2)·erfinv(2u − 1) to within 3.3e-7 of its value:
    y = 2u − 1 and t = (1 − y)(1 + y), whose factors are exact (u lies on the 2^-24 grid below
    1); w = −log t from t's exponent e and significand m in [1/sqrt(2), sqrt(2)),
    log t = e·ln 2 + f·P(f) with f = m − 1; then ε = y·C(w − 2.5) where w < 5 and
    y·T(sqrt(w) − c) beyond. No product here meets a sum that the compiler could fuse into one
    multiply-add: each multiply-add is written as one."""
    y = u * 2.0 - 1.0
    t = (1.0 - y) * (1.0 + y)
    bits = t.to(tl.int32, bitcast=True)
    e = (bits - 0x3F3504F3) >> 23  # 0x3F3504F3: the bits of 1/sqrt(2); an arithmetic shift
    f = (bits - (e << 23)).to(tl.float32, bitcast=True) - 1.0
    p = _poly8(f, 1.0, -0.49999988079071045, 0.3333418667316437, -0.25002074241638184, 0.19956833124160767,
               -0.16562391817569733, 0.14952267706394196, -0.1436685025691986, 0.08722364157438278)
    w = -_fma32(f, p, e.to(tl.float32) * 0.6931471824645996)  # ln 2 in float32
    central = _poly8(w - 2.5, 2.1233136653900146, 0.3488026559352875, -0.005908171180635691,
                     -0.0017730101244524121, 0.00030915020033717155, -6.2179865381040145e-06,
                     -4.990561592421727e-06, 4.861032607550442e-07, 4.035433320837001e-08)
    tail = _poly8(tl.sqrt_rn(w) - 3.075547695159912, 4.113525390625, 1.4184273481369019, 0.01116629783064127,
                  -0.008617010898888111, 0.00628342991694808, -0.004288535565137863, 0.0020290387328714132,
                  -5.513682481250726e-05, -0.00035237043630331755)
    return y * tl.where(w < 5.0, central, tail)


@triton.jit
def _normals(OUT, N, BLOCK: tl.constexpr):
    """`_normal32` of the float32 draws (m + 1/2)·2^-23, m < N: what `normal_draws_differ` checks."""
    m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u = (m.to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23
    tl.store(OUT + m, _normal32(u), mask=m < N)


def normal_draws_differ(device="cpu", count=1 << 23, block=1 << 16):
    """The float32 draws m < `count` (all 2^23 by default) whose Lognormal ε from the kernels'
    `_normal32` differs from its definition's, numpy's `normal32.normal32`: (how many, the first
    few m)."""
    from probattn_tools.kernels.normal32 import normal32

    ours = torch.empty(count, dtype=torch.float32, device=device)
    _normals[(triton.cdiv(count, block),)](ours, count, BLOCK=block)
    theirs = torch.from_numpy(normal32(np.arange(count)))
    differ = (ours.cpu().view(torch.int32) != theirs.view(torch.int32)).nonzero().flatten()
    return int(differ.numel()), differ[:5].tolist()


@triton.jit
def _epsilon(DRAWS, b, h, offs_m, offs_n, H, S_Q, S_K, NOISE: tl.constexpr,
             DRAW64: tl.constexpr, T: tl.constexpr = False):
    """The eager path's ε of a tile: uniform (NOISE 1, Weibull) in the draws' dtype, or standard
    normal (NOISE 2, Lognormal), sqrt(2)·erfinv(2u − 1) as noise.cpp forms it (float64 draws op
    for op as calc_erfinv, float32 draws by `_normal32`, the same float32 values), from the
    seed's words in DRAWS. NOISE 3 (Weibull) and 4 (Lognormal): the caller's ε, read from DRAWS, a
    contiguous (B, H, S_q, S_k) tensor in the statistics' dtype. T: the tile formed transposed."""
    if NOISE >= 3:
        inside = (_per_row(offs_m, T) < S_Q) & (_per_key(offs_n, T) < S_K)
        return tl.load(DRAWS + _position(b, h, offs_m, offs_n, H, S_Q, S_K, T), mask=inside, other=0.5)
    u = _uniform(DRAWS, b, h, offs_m, offs_n, H, S_Q, S_K, DRAW64, T)
    if NOISE == 2:
        if DRAW64:
            return _erfinv(u * 2.0 - 1.0) * 1.4142135623730951
        else:
            return _normal32(u)
    else:
        return u


@triton.jit
def _noise(DRAWS, b, h, offs_m, offs_n, H, S_Q, S_K, noise_scale, NOISE: tl.constexpr,
           DRAW64: tl.constexpr, ACC: tl.constexpr, T: tl.constexpr = False):
    """BAM's noise term of a tile in ACC: (1/k)·log(−log(1 − ε)) for Weibull (float32 draws by
    `_weibull32`; 1 − ε is exact for drawn ε, which lies on the 2^-24 or 2^-33 grid; a given ε
    takes log1p(−ε) by Goldberg's identity, as the eager path's log1p), σ·ε for Lognormal;
    `noise_scale` is 1/k or σ. T: the tile formed transposed."""
    eps = _epsilon(DRAWS, b, h, offs_m, offs_n, H, S_Q, S_K, NOISE, DRAW64, T)
    if NOISE == 1 and not DRAW64:
        return _weibull32(eps, noise_scale).to(ACC)
    if NOISE == 1 or NOISE == 3:
        eps = tl.maximum(eps, 1.1754943508222875e-38)  # FLT_MIN, as noise.cpp's and the eager path's clamp
        w = 1.0 - eps
        if NOISE == 1:
            eps = tl.log(-tl.log(w))
        else:
            # log1p(−ε) = log(w)·(−ε)/(w − 1), exact to a few ulp, and −ε where w rounds to 1.
            eps = tl.log(-tl.where(w == 1.0, -eps, tl.log(w) * (-eps) / (w - 1.0)))
    return eps.to(ACC) * noise_scale


@triton.jit
def _draws(OUT, DRAWS, H, S_Q, S_K, ROW0, ROWS, NOISE: tl.constexpr, DRAW64: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """ε of rows [ROW0, ROW0 + ROWS) of a (B, H, S_q, S_k) score tensor, laid out (B, H, ROWS,
    S_k) in OUT's dtype: what noise.cpp's `counter_noise` returns for those rows."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    local = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_m = ROW0 + local
    for start_n in range(0, S_K, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        eps = _epsilon(DRAWS, b, h, offs_m, offs_n, H, S_Q, S_K, NOISE, DRAW64)
        at = OUT + (bh.to(tl.int64) * ROWS + local[:, None]) * S_K + offs_n[None, :]
        tl.store(at, eps.to(OUT.dtype.element_ty), mask=(local[:, None] < ROWS) & (offs_n[None, :] < S_K))


@triton.jit
def _weights(y, ok, r, DRAWS, b, h, offs_m, offs_n, H, S_Q, S_K, noise_scale, NOISE: tl.constexpr,
             DRAW64: tl.constexpr, ACC: tl.constexpr, T: tl.constexpr = False):
    """A tile's weights recomputed from its logits y and its row statistic r: exp(y + n − r), n
    BAM's noise term (none without NOISE), exactly 0 where excluded. T: the tile formed transposed
    (keys × queries)."""
    x = y
    if NOISE > 0:
        x = y + _noise(DRAWS, b, h, offs_m, offs_n, H, S_Q, S_K, noise_scale, NOISE, DRAW64, ACC, T)
    return tl.where(ok, _exp_less(x, _per_row(_in_exp_base(r), T)), 0.0)


@triton.jit
def _prior(PRIOR, b, h, offs_n, S_K, stride_pb, stride_ph, stride_pn):
    """The prior's per-key values a_j of (batch b, query head h), through their strides."""
    return tl.load(PRIOR + b * stride_pb + h * stride_ph + offs_n * stride_pn, mask=offs_n < S_K, other=0.0)


@triton.jit
def _kl_tile(y, ok, b, h, offs_m, offs_n, S_Q, S_K, H, PRIOR, RB, KS, DKL, stride_pb, stride_ph, stride_pn,
             stride_rb, stride_rh, KL: tl.constexpr, ACC: tl.constexpr, T: tl.constexpr = False,
             INF: tl.constexpr = True, LINEAR: tl.constexpr = False):
    """The KL part's gradient on one tile: in the logits y, dkl·(∂K/∂log π − π·Σ_j ∂K/∂log π)
    (π = exp(y − RB_i) the base's weights, KS_i = Σ_j ∂K/∂log π_ij from the row pass), and in
    the prior's values, dkl·Σ_i ∂K/∂a_j over the tile's queries. The part K is Σ a_j log π_ij
    (KL 1, Weibull) or Σ (log π_ij − a_j)² (KL 2, Lognormal), over the allowed entries (`_kl_rows`'
    T). With T the tile is formed transposed (keys × queries). INF: the logits may hold −inf
    (an additive mask's), which are excluded pairs; without one, a compare per entry less. π is
    formed unmasked (excluded entries' values are discarded by the select that forms dy): a
    select per entry less, and one use less of the allowed pairs, which a thread holding 32
    entries keeps as bits of a register when its predicates run out.

    LINEAR (`linear_kl`): the part's terms in dy that are the logits' own (Weibull's dkl·a_j,
    Lognormal's 2·dkl·(log π_ij − a_j)) and the prior's gradient are the caller's, formed from
    sums over the sequence; the tile gives −dkl·KS_i·π_ij alone, and no prior's gradient (0)."""
    dkl = tl.load(DKL + b * H + h).to(ACC)
    rb = _rows(RB, b, h, offs_m, S_Q, stride_rb, stride_rh)
    ks = _rows(KS, b, h, offs_m, S_Q, stride_rb, stride_rh)
    if LINEAR:
        pi = _exp_less(y, _per_row(_in_exp_base(rb), T))
        dy = tl.where(ok, pi * _per_row(-dkl * ks, T), 0.0)
        da = 0.0
    else:
        if INF:
            ok = ok & (y > float("-inf"))  # an additive mask's -inf entries are excluded pairs
        a = _prior(PRIOR, b, h, offs_n, S_K, stride_pb, stride_ph, stride_pn).to(ACC)
        log_pi = y - _per_row(rb, T)
        pi = _exp(log_pi)
        if KL == 1:
            dy = tl.where(ok, _per_key(a, T) - pi * _per_row(ks, T), 0.0) * dkl
            da = _over_queries(tl.where(ok, log_pi, 0.0), T) * dkl
        else:
            diff = tl.where(ok, log_pi - _per_key(a, T), 0.0)
            dy = tl.where(ok, 2.0 * diff - pi * _per_row(ks, T), 0.0) * dkl
            da = -2.0 * _over_queries(diff, T) * dkl
    return dy, da


@triton.jit
def _kl_fold(z, y, ok, mb, lb, t0, t1, t2, PRIOR, b, h, offs_n, S_K, stride_pb, stride_ph, stride_pn,
             KL: tl.constexpr, ACC: tl.constexpr):
    """One key block of the row pass's KL sums, over the tile's allowed entries: the base's online
    row log-sum-exp (mb, lb) of its logits y = z (excluded: −inf), and per row, for Weibull (KL 1),
    t0 = Σ a_j and t1 = Σ a_j y_ij; for Lognormal (KL 2), t0 the allowed keys, t1 = Σ (y − a − m)
    and t2 = Σ (y − a − m)², m the running maximum mb, re-centred as it grows (so that the sums
    do not cancel)."""
    ok = ok & (z > float("-inf"))  # an additive mask's -inf entries are excluded pairs
    a = _prior(PRIOR, b, h, offs_n, S_K, stride_pb, stride_ph, stride_pn).to(ACC)
    m_old = mb
    mb, lb = _lse_fold(mb, lb, y, 1)
    if KL == 1:
        t0 += tl.sum(tl.where(ok, a[None, :], 0.0), 1)
        t1 += tl.sum(a[None, :] * tl.where(ok, z, 0.0), 1)
    else:
        shift = tl.where(t0 > 0, mb - m_old, 0.0)
        t2 = t2 - 2.0 * shift * t1 + t0 * shift * shift
        t1 = t1 - t0 * shift
        w = tl.where(ok, z - a[None, :] - mb[:, None], 0.0)
        t0 += tl.sum(ok.to(ACC), 1)
        t1 += tl.sum(w, 1)
        t2 += tl.sum(w * w, 1)
    return mb, lb, t0, t1, t2


@triton.jit
def _kl_rows(RB, KS, TROW, mb, lb, t0, t1, t2, b, h, offs_m, S_Q, stride_rb, stride_rh, KL: tl.constexpr,
             LINEAR: tl.constexpr = False):
    """Writes what `_kl_fold`'s sums give per row: the base's row log-sum-exp RB_i (π =
    exp(y − RB)), the KL part TROW_i (T = Σ_i TROW_i, `_kl_tile`) and KS_i = Σ_j ∂T/∂log π_ij:
    for Weibull Σ_j a_j y_ij − RB_i Σ_j a_j and Σ_j a_j; for Lognormal Σ_j (y_ij − a_j − RB_i)²
    and its derivative, re-centred from m_i to RB_i. LINEAR (`linear_kl`): RB_i alone; the caller
    forms TROW and KS from it."""
    rb = _lse_value(mb, lb, 0.0)
    at = b * stride_rb + h * stride_rh + offs_m
    tl.store(RB + at, rb, mask=offs_m < S_Q)
    if not LINEAR:
        if KL == 1:
            trow = t1 - rb * t0
            ks = t0
        else:
            d = tl.where(t0 > 0, rb - mb, 0.0)
            trow = t2 - 2.0 * d * t1 + t0 * d * d
            ks = 2.0 * (t1 - t0 * d)
        tl.store(KS + at, ks, mask=offs_m < S_Q)
        tl.store(TROW + at, trow, mask=offs_m < S_Q)


@triton.jit
def _mix_split(e, w_d, w_s, pi_d, pi_s, rho_d, rho_s, T: tl.constexpr = False):
    """BAM over HNAS: the gradient e in HNAS's log-weights split into each branch's gradient in its
    own logits, w·e − π·ρ (ρ the branch's per-row sum Σ_j w·e): (DNAS's, the two summed). T: the
    tile formed transposed."""
    dy_d = w_d * e - pi_d * _per_row(rho_d, T)
    return dy_d, dy_d + w_s * e - pi_s * _per_row(rho_s, T)


@triton.jit
def _mix_shares(zd, zs, ok, b, h, offs_m, S_Q, RD, RS, LOGU, stride_rb, stride_rh, T: tl.constexpr = False):
    """HNAS's weights as logits, for BAM over an HNAS base: log π = log(u·π_D + (1 − u)·π_S),
    π_D = exp(zd − RD_i) DNAS's weights (zd = z − c) and π_S = exp(zs − RS_i) softmax's, −inf where
    excluded; with the shares w_D = u·π_D/π and w_S = (1 − u)·π_S/π and the two weights. LOGU holds
    log u and log(1 − u) per head. T: the tile formed transposed (keys × queries)."""
    rd = _rows(RD, b, h, offs_m, S_Q, stride_rb, stride_rh)
    rs = _rows(RS, b, h, offs_m, S_Q, stride_rb, stride_rh)
    log_d = tl.where(ok, zd - _per_row(rd, T), 0.0)
    log_s = tl.where(ok, zs - _per_row(rs, T), 0.0)
    part_d = tl.load(LOGU + 2 * h) + log_d
    part_s = tl.load(LOGU + 2 * h + 1) + log_s
    top = tl.maximum(part_d, part_s)
    y = top + tl.log(_exp(part_d - top) + _exp(part_s - top))
    w_d = tl.where(ok, _exp(part_d - y), 0.0)
    w_s = tl.where(ok, _exp(part_s - y), 0.0)
    return tl.where(ok, y, float("-inf")), w_d, w_s, tl.where(ok, _exp(log_d), 0.0), tl.where(ok, _exp(log_s), 0.0)


class Sampling:
    """BAM's sampling on a plan (Fan et al. 2020; docs/formulas.md §2): the weights are
    row-softmax(y + n), y the base plan's logits, n = scale·log(−log(1 − ε)) with ε ~ U(0, 1)
    (`noise="weibull"`, scale 1/k) or n = scale·ε with ε ~ N(0, 1) (`"lognormal"`, scale σ),
    ε drawn by the counter-based generator keyed by `seed` (0 ≤ seed < 2^64) and the entry's
    position, the same ε as the tiles and the CPU's loop draw for that seed; or ε given as
    `draws`, a (B, H, S_q, S_k) tensor, as the library's `noise=` takes it. `kl`: the KL term's
    score-dependent part T over the allowed entries, `"weibull"` (Σ a_j log π_ij, a_j the Gamma
    prior's shape α_j) or `"lognormal"` (Σ (log π_ij − a_j)², a_j = μ_p,j + σ²/2), None for none;
    π = exp(y − LSE_j y) are the base's weights. The rest of the KL (per-key and per-row terms,
    the averaging) is the caller's, as for the tiles (src/attention/tiled.rs)."""

    NOISES = {"weibull": 1, "lognormal": 2}

    def __init__(self, noise, scale, seed=None, kl=None, draws=None):
        if (seed is None) == (draws is None):
            raise ValueError("sampling takes a seed or the draws (a tensor of ε), one of the two")
        if draws is not None and (not isinstance(draws, torch.Tensor) or not draws.is_floating_point()
                                  or draws.dim() != 4):
            got = f"{draws.dtype} of rank {draws.dim()}" if isinstance(draws, torch.Tensor) else type(draws).__name__
            raise ValueError(f"draws must be a floating-point (B, H, S_q, S_k) tensor of ε, got {got}")
        if noise not in self.NOISES:
            raise ValueError(f"noise must be one of {sorted(self.NOISES)}, got {noise!r}")
        if kl is not None and kl not in self.NOISES:
            raise ValueError(f"kl must be None or one of {sorted(self.NOISES)}, got {kl!r}")
        if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"the noise scale (1/k or sigma) must be positive and finite, got {scale!r}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 64):
            raise ValueError(f"seed must be an integer in [0, 2^64), got {seed!r}")
        self.noise, self.scale, self.seed, self.kl, self.draws = noise, float(scale), seed, kl, draws

    def code(self):
        """The kernels' NOISE: 1 Weibull and 2 Lognormal from the seed, 3 and 4 given."""
        return self.NOISES[self.noise] + (2 if self.draws is not None else 0)

    def source(self, shape, dtype, device):
        """What the kernels read the draws from: the seed's two words, or the given ε checked
        against the scores' `shape`, contiguous in the statistics' `dtype`."""
        if self.draws is None:
            return _seed_words(self.seed, device)
        if tuple(self.draws.shape) != tuple(shape):
            raise ValueError(f"draws have shape {tuple(self.draws.shape)}, expected the scores' {tuple(shape)}")
        eps = self.draws.detach().to(device=device, dtype=dtype).contiguous()
        if not bool(torch.isfinite(eps).all()):
            raise ValueError("draws hold a NaN or an infinite value")
        return eps


def _seed_words(seed, device):
    """The seed's low and high 32-bit words, as the kernels read them."""
    return torch.tensor([seed & 0xFFFFFFFF, seed >> 32], dtype=torch.int64, device=device)


def _prior_values(prior, shape, dtype, device):
    """The prior's per-key values broadcast to (B, H, S_k) through stride-0 views, and their strides."""
    b, h, _, s_k = shape
    if not isinstance(prior, torch.Tensor) or not prior.is_floating_point() or prior.dim() > 4:
        got = f"{prior.dtype} of rank {prior.dim()}" if isinstance(prior, torch.Tensor) else type(prior).__name__
        raise ValueError(f"prior must be a floating-point tensor broadcastable to ({b}, {h}, 1, {s_k}), got {got}")
    own = prior.detach().to(device=device, dtype=dtype)
    own = own.reshape((1,) * (4 - own.dim()) + tuple(own.shape))
    if own.shape[2] != 1:
        raise ValueError(f"prior has shape {tuple(prior.shape)}: one value per key, (B, H, 1, S_k), not per query")
    try:
        wide = own.expand(b, h, 1, s_k)[:, :, 0]
    except RuntimeError:
        raise ValueError(f"prior of shape {tuple(prior.shape)} does not broadcast to ({b}, {h}, 1, {s_k})") from None
    if not bool(torch.isfinite(wide).all()):
        raise ValueError("prior holds a NaN or an infinite value")
    return wide, wide.stride()


def linear_kl(kl, sweeps, mix, has_mask, has_bias, causal):
    """Whether the kernels leave the KL part's terms that are sums over the logits to their caller
    (the passes' KL_LINEAR): over softmax's base, where the allowed pairs are those of the
    paddings and, for Weibull's part, the causal mask. The logits are then z_ij = s·q_i·k_j, and
    those terms are sums over the sequence (`LinearKl`): the row pass keeps the base's row
    log-sum-exp alone, and the key pass forms −dkl·KS_i·π_ij alone, where it formed the part's
    sums, its own term in dy and the prior's gradient per entry too. Lognormal's part is
    quadratic in the logits: its sums take a d × d matrix per head, which the causal mask would
    make one per key, so under it the kernels keep the part per entry."""
    return (kl == 1 or (kl == 2 and not causal)) and sweeps == 0 and not (mix or has_mask or has_bias)


class LinearKl:
    """The KL part's terms that are sums over the logits z_ij = s·q_i·k_j, from sums over the
    sequence (`linear_kl`), for Weibull's part (kl 1) or Lognormal's (kl 2).

    Weibull's part is T = Σ_i Σ_j a_j (z_ij − RB_i) over the allowed pairs, so

        TROW_i = s·q_i·W_i − RB_i·KS_i,   W_i = Σ_j a_j k_j,   KS_i = Σ_j a_j   (j allowed for i),

    and of its gradient (dkl the gradient in T), what the tiles do not form:

        dQ_i += s·dkl·W_i,   dK_j += s·dkl·a_j·Q_j,   dA_j = dkl·(s·k_j·Q_j − Σ_i RB_i),
        Q_j = Σ_i q_i   (i allowed for j).

    The allowed pairs are the unpadded queries and keys, and j ≤ i under the causal mask, where
    the sums are prefix sums (over keys) and suffix sums (over queries).

    Lognormal's part is T = Σ_i Σ_j e_ij², e_ij = z_ij − RB_i − a_j, over the allowed pairs
    without the causal mask: every allowed query sees the same n keys. About the keys' means k̄
    and ā, with k̃_j = k_j − k̄ and ã_j = a_j − ā (0 at a padded key), e_ij = s·q_i·k̃_j + m_i − ã_j
    with m_i = s·q_i·k̄ − RB_i − ā, and Σ_j k̃_j = 0, Σ_j ã_j = 0, so

        TROW_i = s²·q_iᵀ C q_i − 2s·q_i·U + n·m_i² + Σ_j ã_j²,   KS_i = Σ_j 2e_ij = 2n·m_i,
        C = Σ_j k̃_j k̃_jᵀ (d × d),   U = Σ_j ã_j k̃_j;

    of its gradient, the terms of 2·dkl·e_ij in dy (the tiles keep −dkl·KS_i·π_ij):

        dQ_i += 2s·dkl·(s·C q_i − U + n·m_i·k̄),   dK_j += s·2dkl·(s·P k̃_j + M − ã_j·Q),
        dA_j = −2dkl·(s·Q·k̃_j + Σ_i m_i − n_q·ã_j),
        P = Σ_i q_i q_iᵀ,   M = Σ_i m_i q_i,   Q = Σ_i q_i   (the n_q allowed queries).

    The centred form keeps each sum as small as the spread of the logits about their row's mean,
    where the plain expansion Σ_j z_ij² − 2 Σ_j z_ij (RB_i + a_j) + ... would cancel.

    `q` (B, H, S_q, d), `k` (B, H_kv, S_k, d) (a group of query heads shares a key head; nothing
    is copied per query head), `a` the prior's values (B, H, S_k), `qpad` and `kpad` (B, S) nonzero
    where padded, or None; sums in `dtype`."""

    def __init__(self, q, k, a, qpad, kpad, causal, scale, dtype, kl=1):
        if kl not in (1, 2):
            raise ValueError(f"kl must be 1 (Weibull) or 2 (Lognormal), got {kl!r}")
        if kl == 2 and causal:
            raise ValueError("Lognormal's KL part has no sums over the sequence under the causal mask")
        b, h, s_q, d = q.shape
        h_kv, s_k = k.shape[1], k.shape[2]
        self.shape, self.causal, self.scale, self.dtype, self.kl = (b, h, h_kv, s_q, s_k, d), causal, scale, dtype, kl
        self.q, self.k = q, k
        self.qv = (torch.ones(b, s_q, dtype=dtype, device=q.device) if qpad is None
                   else (qpad == 0).to(dtype))  # 1 for an allowed query
        kv = torch.ones(b, s_k, dtype=dtype, device=q.device) if kpad is None else (kpad == 0).to(dtype)
        self.kv, self.a = kv, a.to(dtype) * kv[:, None, :]  # a_j where key j is allowed, else 0

    def _grouped(self, x):
        """A per-query-head (B, H, ...) tensor as (B, H_kv, H / H_kv, ...)."""
        b, h, h_kv = self.shape[:3]
        return x.reshape(b, h_kv, h // h_kv, *x.shape[2:])

    def _heads(self, x):
        """(B, H_kv, H / H_kv, ...) back to (B, H, ...)."""
        return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])

    def _key_sums(self):
        """(W (B, H, S_q, d), KS (B, H, S_q)): Σ a_j k_j and Σ a_j over the keys each query sees."""
        b, h, h_kv, s_q, s_k, d = self.shape
        ak = self._grouped(self.a)  # (B, H_kv, G, S_k)
        k = self.k.to(self.dtype)  # (B, H_kv, S_k, d)
        if self.causal:
            w = self._heads(torch.cumsum(ak[..., None] * k[:, :, None], 3))  # (B, H, S_k, d): keys 0..j
            t0 = torch.cumsum(self.a, 2)
            last = torch.clamp(torch.arange(s_q, device=self.q.device), max=s_k - 1)  # the last key query i sees
            w, t0 = w[:, :, last], t0[:, :, last]
        else:
            w = self._heads(torch.matmul(ak, k)[:, :, :, None]).expand(b, h, s_q, d)  # one product, no (S_k, d) one per head
            t0 = self.a.sum(2, keepdim=True).expand(b, h, s_q)
        qv = self.qv[:, None, :]
        return w * qv[..., None], t0 * qv

    def _query_sums(self, rows):
        """(Q (B, H, S_k, d), R (B, H, S_k)): Σ q_i and Σ rows_i over the queries each key is seen
        by (rows: a per-query statistic, (B, H, S_q))."""
        b, h, h_kv, s_q, s_k, d = self.shape
        q = self.q.to(self.dtype) * self.qv[:, None, :, None]
        rows = rows * self.qv[:, None, :]
        if self.causal:
            # suffix sums over the queries i ≥ j, for the keys j < S_q; none sees a key past them
            qs, rs = (torch.flip(torch.cumsum(torch.flip(x, (2,)), 2), (2,)) for x in (q, rows))
            if s_k <= s_q:
                qs, rs = qs[:, :, :s_k], rs[:, :, :s_k]
            else:
                qs = torch.nn.functional.pad(qs, (0, 0, 0, s_k - s_q))
                rs = torch.nn.functional.pad(rs, (0, s_k - s_q))
        else:
            qs = q.sum(2, keepdim=True).expand(b, h, s_k, d)
            rs = rows.sum(2, keepdim=True).expand(b, h, s_k)
        kv = self.kv[:, None, :]
        return qs * kv[..., None], rs * kv

    def _centred(self):
        """Lognormal's sums about the keys' means: (n (B, 1, 1), k̄ (B, H, d), k̃ (B, H_kv, S_k, d),
        ã (B, H, S_k), C (B, H_kv, d, d), U (B, H, d), Σ_j ã_j² (B, H)), 0 at a padded key."""
        b, h, h_kv, s_q, s_k, d = self.shape
        n = self.kv.sum(1)[:, None, None]  # (B, 1, 1)
        per = 1.0 / n.clamp(min=1.0)
        k = self.k.to(self.dtype) * self.kv[:, None, :, None]
        kbar = k.sum(2, keepdim=True) * per[..., None]  # (B, H_kv, 1, d)
        kc = (k - kbar) * self.kv[:, None, :, None]
        ac = (self.a - self.a.sum(2, keepdim=True) * per) * self.kv[:, None, :]
        c = kc.transpose(-2, -1) @ kc
        u = self._heads(self._grouped(ac) @ kc)  # (B, H, d)
        kbar = self._heads(kbar.expand(b, h_kv, h // h_kv, d))
        return n, kbar, kc, ac, c, u, (ac * ac).sum(2)

    def _row_means(self, rb, kbar):
        """m_i = s·q_i·k̄ − RB_i − ā, 0 at a padded query and where every key is padded (B, H, S_q)."""
        n = self.kv.sum(1)[:, None, None]
        abar = self.a.sum(2, keepdim=True) / n.clamp(min=1.0)
        m = self.scale * (self.q.to(self.dtype) @ kbar[..., None])[..., 0] - rb.to(self.dtype) - abar
        return torch.where((self.qv[:, None, :] > 0) & (n > 0), m, 0.0)

    def _quadratic(self, q, c):
        """(q_i C (B, H, S_q, d), q_iᵀ C q_i (B, H, S_q)) with C one (d × d) per key head."""
        qc = self._heads(self._grouped(q) @ c[:, :, None])
        return qc, (qc * q).sum(-1)

    def rows(self, rb):
        """(KS, TROW) per row (B, H, S_q), from the row pass's RB."""
        if self.kl == 2:
            n, kbar, _, _, c, u, a2 = self._centred()
            m = self._row_means(rb, kbar)
            q = self.q.to(self.dtype)
            _, qcq = self._quadratic(q, c)
            trow = self.scale ** 2 * qcq - 2 * self.scale * (q @ u[..., None])[..., 0] + n * m * m + a2[..., None]
            return 2 * n * m, torch.where(self.qv[:, None, :] > 0, trow, 0.0)
        w, ks = self._key_sums()
        t1 = self.scale * (self.q.to(self.dtype) * w).sum(-1)
        return ks, t1 - rb * ks

    def grads(self, rb, dkl):
        """(the key pass's QBAR: dK's term before the scale s, (B, H, S_k, d) in q's dtype; dA
        (B, H, S_k); dQ's term (B, H, S_q, d)), for dkl (B, H)."""
        if self.kl == 2:
            return self._lognormal_grads(rb, dkl)
        w, _ = self._key_sums()
        qs, rs = self._query_sums(rb)
        dkl = dkl.to(self.dtype)[:, :, None]
        qbar = ((dkl * self.a)[..., None] * qs).to(self.q.dtype)
        k = self._heads(self._grouped(qs) * self.k.to(self.dtype)[:, :, None]).sum(-1)  # k_j·Q_j per query head
        da = dkl * (self.scale * k - rs) * self.kv[:, None, :]
        return qbar, da, self.scale * dkl[..., None] * w

    def _lognormal_grads(self, rb, dkl):
        s = self.scale
        n, kbar, kc, ac, c, u, _ = self._centred()
        m = self._row_means(rb, kbar)
        qv = self.qv[:, None, :]
        q = self.q.to(self.dtype) * qv[..., None]  # the allowed queries, 0 elsewhere
        dkl2 = 2 * dkl.to(self.dtype)[:, :, None]
        qc, _ = self._quadratic(q, c)
        dq = dkl2[..., None] * s * (s * qc - u[:, :, None] + (n * m)[..., None] * kbar[:, :, None]) * qv[..., None]
        p = q.transpose(-2, -1) @ q  # (B, H, d, d): Σ_i q_i q_iᵀ
        big_m, big_q = (m[..., None] * q).sum(2), q.sum(2)  # (B, H, d)
        kv = self.kv[:, None, :]
        # P k̃_j per query head: (B, H_kv, G, S_k, d) from (B, H_kv, 1, S_k, d) against (B, H_kv, G, d, d)
        pk = self._heads(kc[:, :, None] @ self._grouped(p))
        qbar = dkl2[..., None] * (s * pk + big_m[:, :, None] - ac[..., None] * big_q[:, :, None]) * kv[..., None]
        kq = self._heads((kc[:, :, None] * self._grouped(big_q)[:, :, :, None]).sum(-1))  # Q·k̃_j (B, H, S_k)
        da = -dkl2 * (s * kq + m.sum(2, keepdim=True) - qv.sum(2, keepdim=True) * ac) * kv
        return qbar.to(self.q.dtype), da, dq


def counter_noise(shape, seed, noise, precision, rows=None, device="cpu", block=(16, 64)):
    """The counter-based draws ε of rows `rows` (a range; all by default) of a (B, H, S_q, S_k)
    score tensor `shape`, drawn by the kernels' own generator, (B, H, len(rows), S_k) in
    `precision` (torch.float32: 23-bit draws; torch.float64: 32-bit): uniform for `noise`
    "weibull", standard normal for "lognormal", as noise.cpp's `counter_noise` returns them."""
    b, h, s_q, s_k = shape
    rows = range(s_q) if rows is None else rows
    if noise not in Sampling.NOISES:
        raise ValueError(f"noise must be one of {sorted(Sampling.NOISES)}, got {noise!r}")
    if precision not in (torch.float32, torch.float64):
        raise ValueError(f"precision must be torch.float32 or torch.float64, got {precision}")
    if rows.step != 1 or rows.start < 0 or rows.stop > s_q:
        raise ValueError(f"rows must be a contiguous range inside [0, {s_q}), got {rows}")
    if s_k * block[0] > 2 ** 32:
        raise ValueError(f"the draws take at most 2^32 / {block[0]} keys, got {s_k}")
    out = torch.empty(b, h, len(rows), s_k, dtype=precision, device=device)
    if len(rows) and s_k:
        _draws[(triton.cdiv(len(rows), block[0]), b * h)](
            out, _seed_words(seed, device), h, s_q, s_k, rows.start, len(rows), NOISE=Sampling.NOISES[noise],
            DRAW64=precision == torch.float64, BLOCK_M=block[0], BLOCK_N=block[1])
    return out

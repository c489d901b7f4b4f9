"""Lognormal's ε of float32 draws, as its definition reads, in numpy: the reference that the
kernels' `bam._normal32` and noise.cpp's `normal32` are held to, bit for bit, over every float32
draw (`bam.normal_draws_differ`).

A float32 draw is u = (m + 1/2)·2^-23 for m < 2^23, and its ε a fixed sequence of float32
operations, each rounded once as IEEE 754 defines it, that approximates sqrt(2)·erfinv(2u − 1):

    y = 2u − 1,  t = (1 − y)·(1 + y)                      (both factors exact)
    t = 2^e·m',  m' in [1/sqrt(2), sqrt(2)),  f = m' − 1  (exact)
    w = −fma(f, P(f), e·ln 2)                             (w = −log t)
    ε = y·C(w − 2.5)            where w < 5
    ε = y·T(sqrt(w) − c)        elsewhere

P, C and T are polynomials of degree 8 evaluated by Horner's rule, one fused multiply-add a step;
their coefficients, fitted to relative error on those ranges, are below as the float32 values
they are. numpy has no fused multiply-add: `fma32` takes the product exactly in float64 and
rounds the sum to odd there (Boldo and Melquiond), which makes its rounding to float32 the single
rounding of the exact a·b + c.
"""

import numpy as np

LOG1P = ("0x1p+0", "-0x1.fffff8p-2", "0x1.555792p-2", "-0x1.00057p-2", "0x1.98b748p-3",
         "-0x1.5332a2p-3", "0x1.3238f2p-3", "-0x1.263bacp-3", "0x1.65449ep-4")
CENTRAL = ("0x1.0fc8bep+1", "0x1.652c86p-2", "-0x1.8332aap-8", "-0x1.d0c8b2p-10", "0x1.442aep-12",
           "-0x1.a14832p-18", "-0x1.4ee932p-18", "0x1.04f986p-21", "0x1.5aa41ep-25")
TAIL = ("0x1.0744p+2", "0x1.6b1e0ep+0", "0x1.6de5b2p-7", "-0x1.1a5cbap-7", "0x1.9bca76p-8",
        "-0x1.190dbp-8", "0x1.09f33ep-9", "-0x1.ce856ep-15", "-0x1.717cb8p-12")
CENTRE, SPLIT, TAIL_SHIFT, LN2 = "0x1.4p+1", "0x1.4p+2", "0x1.89ab8cp+1", "0x1.62e43p-1"
SQRT_HALF_BITS = 0x3F3504F3  # the float32 bits of 1/sqrt(2)


def _f32(x):
    return np.float32(float.fromhex(x))


def fma32(a, b, c):
    """fma(a, b, c) of float32 arrays, rounded once to float32."""
    a, b, c = (np.asarray(x, np.float32).astype(np.float64) for x in (a, b, c))
    p = a * b  # exact: two 24-bit significands
    s = p + c
    back = s - p
    err = (p - (s - back)) + (c - back)  # p + c − s, exactly
    bits = s.view(np.int64)
    away = np.where((err > 0) == (s > 0), bits + 1, bits - 1)
    s = np.where((err != 0) & ((bits & 1) == 0), away, bits).view(np.float64)
    return s.astype(np.float32)


def _horner(coefficients, x):
    p = np.full_like(x, _f32(coefficients[-1]))
    for c in coefficients[-2::-1]:
        p = fma32(p, x, _f32(c))
    return p


def normal32(m):
    """ε of the float32 draws (m + 1/2)·2^-23, for integers m in [0, 2^23), as float32."""
    u = ((np.asarray(m, np.float64) + 0.5) * 2.0 ** -23).astype(np.float32)
    y = u * np.float32(2) - np.float32(1)
    t = (np.float32(1) - y) * (np.float32(1) + y)
    bits = t.view(np.int32)
    e = (bits - np.int32(SQRT_HALF_BITS)) >> 23
    f = (bits - (e << 23)).view(np.float32) - np.float32(1)
    w = -fma32(f, _horner(LOG1P, f), e.astype(np.float32) * _f32(LN2))
    central = _horner(CENTRAL, w - _f32(CENTRE))
    tail = _horner(TAIL, np.sqrt(w) - _f32(TAIL_SHIFT))
    return y * np.where(w < _f32(SPLIT), central, tail)


def error(count=1 << 23):
    """The largest relative difference between `normal32` and sqrt(2)·erfinv(2u − 1) (torch's, in
    float64) over the draws m < `count`, and the largest in float32's units in the last place."""
    import torch

    m = np.arange(count)
    ours = normal32(m).astype(np.float64)
    u = torch.from_numpy((m + 0.5) * 2.0 ** -23)
    exact = (torch.erfinv(u * 2.0 - 1.0) * 2.0 ** 0.5).numpy()
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    return float((np.abs(ours - exact) / np.abs(exact)).max()), float((np.abs(ours - exact) / ulp).max())

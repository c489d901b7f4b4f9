"""`probattn.functional.scaled_dot_product_attention` against PyTorch's own
`torch.nn.functional.scaled_dot_product_attention`, which is the oracle: every argument
combination SDPA documents (shapes with any leading dimensions, boolean and float masks broadcast,
`is_causal` with L < S and L > S, `scale`, `enable_gqa`, broadcast heads), forward and gradients
(q, k, v and a float mask), on the eager path, the library's automatic choice and the
memory-efficient path. float64 to 1e-12 and float32 to 1e-6, relative to the largest entry of
each compared tensor (at least 1). In bfloat16 and float16 our error against float64 may not
exceed twice PyTorch's own in that dtype, four times on the memory-efficient path (plus a floor of
a few units of its rounding): PyTorch's CPU kernel keeps the backward's products in float32, the
tiles multiply dZ and P in the inputs' dtype, as FlashAttention's backward does on a GPU. Then the other variants: the same arguments mean the same thing (the mask is added
to the scores before the normalizer), checked against the formulas of
python/probattn_tools/reference."""

import itertools
import math
import unittest

import torch
import torch.nn.functional as F

import probattn
from probattn.functional import attention_with_info, scaled_dot_product_attention as sdpa
from probattn_tools.reference import formulas as R

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-6}
# The floor of the low-precision comparison: a few units in the last place at the outputs' size.
FLOOR = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
PATHS = {"auto": {}, "eager": {}, "memory-efficient": {"memory_efficient": True, "tile": 3}}


def cases():
    """(name, shapes of q, k, v, SDPA's keyword arguments, a mask maker) over the documented combinations."""
    B, H, L, S, E, Ev = 2, 4, 5, 7, 8, 6
    g = torch.Generator().manual_seed(0)

    def bool_mask(shape, full_row=False):
        m = torch.rand(shape, generator=g) > 0.3
        m[..., 0] = True
        if full_row:
            m[..., 1, :] = False  # one query with no key: SDPA gives zeros
        return m

    def float_mask(shape, full_row=False):
        m = torch.randn(shape, generator=g, dtype=torch.float64)
        m[..., 2, 3] = -math.inf
        if full_row:
            m[..., 1, :] = -math.inf
        return m

    four = ((B, H, L, E), (B, H, S, E), (B, H, S, Ev))
    yield "plain", four, {}, None
    yield "L == S", ((B, H, S, E), (B, H, S, E), (B, H, S, Ev)), {}, None
    yield "3-D inputs", ((H, L, E), (H, S, E), (H, S, Ev)), {}, None
    yield "2-D inputs", ((L, E), (S, E), (S, Ev)), {}, None
    yield "5-D inputs", ((3, B, H, L, E), (3, B, H, S, E), (3, B, H, S, Ev)), {}, lambda: bool_mask((3, 1, 1, L, S))
    yield "5-D inputs, a 4-D mask", ((3, B, H, L, E), (3, B, H, S, E), (3, B, H, S, Ev)), {}, lambda: float_mask((B, 1, L, S))
    yield "broadcast key/value batch", four[:1] + ((1, H, S, E), (1, H, S, Ev)), {}, None
    yield "one key/value head, broadcast", four[:1] + ((B, 1, S, E), (B, 1, S, Ev)), {}, None
    yield "bool (L, S)", four, {}, lambda: bool_mask((L, S))
    yield "bool (B, 1, L, S), a row with no key", four, {}, lambda: bool_mask((B, 1, L, S), full_row=True)
    yield "bool (1, S)", four, {}, lambda: bool_mask((1, S))
    yield "float (L, S)", four, {}, lambda: float_mask((L, S))
    yield "float (B, H, L, S), a row all -inf", four, {}, lambda: float_mask((B, H, L, S), full_row=True)
    yield "float (1, H, 1, S), ALiBi-like", four, {}, lambda: torch.arange(S, dtype=torch.float64).mul(-0.25).expand(1, H, 1, S).clone()
    yield "causal L < S", four, {"is_causal": True}, None
    yield "causal L > S", ((B, H, S, E), (B, H, L, E), (B, H, L, Ev)), {"is_causal": True}, None
    yield "causal L == S", ((B, H, S, E), (B, H, S, E), (B, H, S, Ev)), {"is_causal": True}, None
    yield "scale 0.3", four, {"scale": 0.3}, None
    yield "scale -0.5, float mask", four, {"scale": -0.5}, lambda: float_mask((L, S))
    yield "gqa 4 over 2", four[:1] + ((B, 2, S, E), (B, 2, S, Ev)), {"enable_gqa": True}, None
    yield "gqa 4 over 1, causal", four[:1] + ((B, 1, S, E), (B, 1, S, Ev)), {"enable_gqa": True, "is_causal": True}, None
    yield "gqa 4 over 2, float mask, scale", four[:1] + ((B, 2, S, E), (B, 2, S, Ev)), {"enable_gqa": True, "scale": 0.2}, \
        lambda: float_mask((B, H, L, S))
    yield "gqa 5-D", ((3, B, H, L, E), (3, B, 2, S, E), (3, B, 2, S, Ev)), {"enable_gqa": True}, None


def inputs(shapes, make_mask, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
    mask = make_mask() if make_mask is not None else None
    return q, k, v, mask


def run(fn, q, k, v, mask, kwargs, dtype, path=None):
    """The output and the gradients in q, k, v (and a float mask) for a fixed cotangent, in `dtype`."""
    ts = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    m = None
    if mask is not None:
        m = mask if mask.dtype == torch.bool else mask.to(dtype).requires_grad_()
    extra = PATHS[path] if path is not None else {}
    if path == "eager":
        with probattn.attention_backend("eager"):
            out = fn(*ts, attn_mask=m, **kwargs, **extra)
    else:
        out = fn(*ts, attn_mask=m, **kwargs, **extra)
    ct = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(dtype)
    wrt = ts + ([m] if m is not None and m.requires_grad else [])
    grads = torch.autograd.grad(out, wrt, ct)
    return [out.double()] + [g.double() for g in grads]


class Conformance(unittest.TestCase):
    def test_softmax_is_sdpa(self):
        checked = 0
        for (name, shapes, kwargs, make_mask), dtype, path in itertools.product(
                list(cases()), (torch.float64, torch.float32, torch.bfloat16, torch.float16), PATHS):
            with self.subTest(f"{name} {dtype} {path}"):
                q, k, v, mask = inputs(shapes, make_mask, dtype, seed=checked)
                ours = run(sdpa, q, k, v, mask, kwargs, dtype, path)
                theirs = run(F.scaled_dot_product_attention, q, k, v, mask, kwargs, dtype)
                self.assertEqual(ours[0].shape, theirs[0].shape)
                if dtype in TOLERANCE:
                    for i, (a, b) in enumerate(zip(ours, theirs)):
                        atol = TOLERANCE[dtype] * max(1.0, b.abs().max().item())
                        torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=lambda m, i=i: f"output/grad {i}: {m}")
                else:
                    exact = run(F.scaled_dot_product_attention, q, k, v, mask, kwargs, torch.float64)
                    for i, (a, b, x) in enumerate(zip(ours, theirs, exact)):
                        ours_err, their_err = (a - x).abs().max().item(), (b - x).abs().max().item()
                        factor = 4 if path == "memory-efficient" else 2
                        bound = factor * their_err + FLOOR[dtype] * max(1.0, x.abs().max().item()) / 8
                        self.assertLessEqual(ours_err, bound, f"output/grad {i}: ours {ours_err:.2e}, torch {their_err:.2e}")
                checked += 1
        self.assertEqual(checked, len(list(cases())) * 4 * len(PATHS))

    def test_the_comparison_can_fail(self):
        # A boolean mask read the other way round, or the default scale for another, is caught.
        q, k, v, mask = inputs(((2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 6)), lambda: torch.rand(5, 7) > 0.5, torch.float64, 1)
        mask[:, 0] = True
        mask[:, 1] = False
        self.assertGreater((sdpa(q, k, v, attn_mask=~mask) - F.scaled_dot_product_attention(q, k, v, attn_mask=mask)).abs().max(), 1e-3)
        self.assertGreater((sdpa(q, k, v, scale=0.2) - F.scaled_dot_product_attention(q, k, v)).abs().max(), 1e-3)

    def test_dropout_applies_whenever_p_is_above_zero(self):
        # As PyTorch's: no training flag; p = 0 is deterministic; the memory-efficient path refuses it.
        q, k, v, _ = inputs(((2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 6)), None, torch.float64, 2)
        torch.manual_seed(0)
        dropped = sdpa(q, k, v, dropout_p=0.5)
        self.assertGreater((dropped - sdpa(q, k, v)).abs().max(), 1e-3)
        torch.testing.assert_close(sdpa(q, k, v, dropout_p=0.0), F.scaled_dot_product_attention(q, k, v), rtol=0, atol=1e-12)
        with self.assertRaisesRegex(ValueError, "no attention dropout"):
            sdpa(q, k, v, dropout_p=0.1, memory_efficient=True)
        with self.assertRaisesRegex(ValueError, r"dropout_p must be a number in \[0, 1\)"):
            sdpa(q, k, v, dropout_p=1.5)


class OtherVariants(unittest.TestCase):
    """The same arguments mean the same thing for every deterministic variant: z = scale · q kᵀ +
    mask (boolean: excluded where False), with keys and values read per group."""

    def test_every_deterministic_variant_reads_the_arguments_as_sdpa(self):
        B, H, L, S, E = 2, 4, 5, 7, 8
        g = torch.Generator().manual_seed(4)
        q = torch.randn(B, H, L, E, generator=g, dtype=torch.float64, requires_grad=True)
        k = torch.randn(B, 2, S, E, generator=g, dtype=torch.float64, requires_grad=True)
        v = torch.randn(B, 2, S, 3, generator=g, dtype=torch.float64, requires_grad=True)
        bias = torch.randn(L, S, generator=g, dtype=torch.float64)
        bias[1, 4] = -math.inf
        bias.requires_grad_()
        logit = torch.tensor([0.3, -1.0, 2.0, 0.1], dtype=torch.float64, requires_grad=True)
        allowed = torch.isfinite(bias).expand(B, H, L, S)
        for variant in ("softmax", "dnas", "sinkhorn-3", "hnas"):
            for path in ({}, {"memory_efficient": True, "tile": 2}):
                with self.subTest(f"{variant} {path}"):
                    extra = {"hybrid_logit": logit} if variant == "hnas" else {}
                    out, info = attention_with_info(q, k, v, attn_mask=bias, scale=0.4, enable_gqa=True, variant=variant,
                                                    **path, **extra)
                    kx, vx = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
                    z = 0.4 * q @ kx.transpose(-2, -1) + bias.masked_fill(~torch.isfinite(bias), 0)
                    w = R.normalize(variant, z, allowed, hybrid_logit=logit)
                    ref = w @ vx
                    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
                    torch.testing.assert_close(info.received_mass, w.detach().sum(-2), rtol=0, atol=1e-10)
                    wrt = [q, k, v, bias] + ([logit] if extra else [])
                    for a, b in zip(torch.autograd.grad(out.sum(), wrt), torch.autograd.grad(ref.sum(), wrt)):
                        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


if __name__ == "__main__":
    unittest.main()

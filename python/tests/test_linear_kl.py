"""The Weibull KL part's terms linear in the logits, formed from sums over the sequence
(`bam.LinearKl`, which the kernels leave them to over softmax's base), against the same terms
summed over the whole (S_q × S_k) score matrix in float64, for every padding, the causal mask,
fewer key heads than query heads and both orders of S_q and S_k."""

import itertools
import math
import unittest

import torch

from probattn_tools.kernels.bam import LinearKl, linear_kl


def dense(q, k, a, qpad, kpad, causal, scale, rb, dkl):
    """(KS, TROW, QBAR, dA, the dQ term) from the allowed pairs and the scores themselves."""
    b, h, s_q, _ = q.shape
    s_k, group = k.shape[2], h // k.shape[1]
    kk = k.repeat_interleave(group, 1)
    z = scale * q @ kk.transpose(-2, -1)
    allowed = torch.ones(b, h, s_q, s_k, dtype=torch.bool)
    if qpad is not None:
        allowed &= ~qpad[:, None, :, None]
    if kpad is not None:
        allowed &= ~kpad[:, None, None, :]
    if causal:
        allowed &= torch.ones(s_q, s_k, dtype=torch.bool).tril()
    m = allowed.double()
    am = a[:, :, None, :] * m  # a_j on the allowed pairs
    ks = am.sum(-1)
    trow = (am * (z - rb[..., None])).sum(-1)
    dkl = dkl[:, :, None]
    # the terms of T's gradient with a_j in them: dkl·a_j on each allowed pair
    dq = scale * dkl[..., None] * (am @ kk)
    qsum = m.transpose(-2, -1) @ q  # Σ_i q_i over the queries that see key j
    qbar = (dkl * a)[..., None] * qsum
    da = dkl * (m * (z - rb[..., None])).sum(-2)
    return ks, trow, qbar, da, dq


class LinearKlTerms(unittest.TestCase):
    def test_the_sums_over_the_sequence_equal_the_sums_over_the_scores(self):
        gen = torch.Generator().manual_seed(7)
        for (s_q, s_k), causal, (pad_q, pad_k), (h, h_kv) in itertools.product(
                ((9, 6), (5, 11), (7, 7)), (False, True), ((False, False), (True, False), (False, True), (True, True)),
                ((4, 2), (2, 2))):
            b, d, scale = 2, 8, 0.6 / math.sqrt(8)
            with self.subTest(s_q=s_q, s_k=s_k, causal=causal, pad_q=pad_q, pad_k=pad_k, heads=(h, h_kv)):
                q = torch.randn(b, h, s_q, d, generator=gen, dtype=torch.float64)
                k = torch.randn(b, h_kv, s_k, d, generator=gen, dtype=torch.float64)
                a = torch.rand(b, h, s_k, generator=gen, dtype=torch.float64) + 0.1
                qpad = torch.rand(b, s_q, generator=gen) < 0.3 if pad_q else None
                kpad = torch.rand(b, s_k, generator=gen) < 0.3 if pad_k else None
                rb = torch.randn(b, h, s_q, generator=gen, dtype=torch.float64)
                dkl = torch.randn(b, h, generator=gen, dtype=torch.float64)
                ours = LinearKl(q, k, a, None if qpad is None else qpad.to(torch.uint8),
                                None if kpad is None else kpad.to(torch.uint8), causal, scale, torch.float64)
                ks, trow = ours.rows(rb)
                qbar, da, dq = ours.grads(rb, dkl)
                for name, got, want in zip(("KS", "TROW", "QBAR", "dA", "dQ"), (ks, trow, qbar, da, dq),
                                           dense(q, k, a, qpad, kpad, causal, scale, rb, dkl)):
                    self.assertEqual(got.shape, want.shape, name)
                    self.assertLess(float((got - want).abs().max()), 1e-12 * (1 + float(want.abs().max())), name)

    def test_the_kernels_leave_the_terms_to_the_caller_over_softmax_alone_without_patterns(self):
        self.assertTrue(linear_kl(1, 0, False, False, False))
        self.assertFalse(linear_kl(2, 0, False, False, False))  # Lognormal's part is not linear
        self.assertFalse(linear_kl(1, 1, False, False, False))  # DNAS's logits hold c_j
        self.assertFalse(linear_kl(1, 0, True, False, False))   # HNAS's log-weights
        self.assertFalse(linear_kl(1, 0, False, True, False))   # a boolean pattern
        self.assertFalse(linear_kl(1, 0, False, False, True))   # an additive mask


if __name__ == "__main__":
    unittest.main()

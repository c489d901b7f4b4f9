"""The KL part's terms that are sums over the logits, formed from sums over the sequence
(`bam.LinearKl`, which the kernels leave them to over softmax's base), against the same terms
summed over the whole (S_q × S_k) score matrix in float64, for every padding, fewer key heads
than query heads and both orders of S_q and S_k: Weibull's part (linear in the logits) with and
without the causal mask, Lognormal's (quadratic) without it."""

import itertools
import math
import unittest

import torch

from probattn_tools.kernels.bam import LinearKl, linear_kl


def dense(q, k, a, qpad, kpad, causal, scale, rb, dkl, kl=1):
    """(KS, TROW, QBAR, dA, the dQ term) from the allowed pairs and the scores themselves: for
    Weibull's part T = Σ a_j (z_ij − RB_i), for Lognormal's T = Σ (z_ij − RB_i − a_j)², and of
    T's gradient (times dkl) the terms that do not pass through RB_i: dQ's s·Σ_j ∂T/∂z_ij k_j, dK's
    (before the scale s) Σ_i ∂T/∂z_ij q_i, and the prior's."""
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
    if kl == 2:
        e = (z - rb[..., None] - a[:, :, None, :]) * m  # e_ij on the allowed pairs, 0 elsewhere
        dkl = dkl[:, :, None]
        dz = 2 * dkl[..., None] * e  # ∂T/∂z_ij at fixed RB_i, times dkl
        return (2 * e.sum(-1), (e * e).sum(-1), dz.transpose(-2, -1) @ q, -2 * dkl * e.sum(-2),
                scale * (dz @ kk))
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
        for kl, (s_q, s_k), causal, (pad_q, pad_k), (h, h_kv) in itertools.product(
                (1, 2), ((9, 6), (5, 11), (7, 7)), (False, True),
                ((False, False), (True, False), (False, True), (True, True)), ((4, 2), (2, 2))):
            if kl == 2 and causal:
                continue
            b, d, scale = 2, 8, 0.6 / math.sqrt(8)
            with self.subTest(kl=kl, s_q=s_q, s_k=s_k, causal=causal, pad_q=pad_q, pad_k=pad_k, heads=(h, h_kv)):
                q = torch.randn(b, h, s_q, d, generator=gen, dtype=torch.float64)
                k = torch.randn(b, h_kv, s_k, d, generator=gen, dtype=torch.float64)
                a = torch.rand(b, h, s_k, generator=gen, dtype=torch.float64) + 0.1
                qpad = torch.rand(b, s_q, generator=gen) < 0.3 if pad_q else None
                kpad = torch.rand(b, s_k, generator=gen) < 0.3 if pad_k else None
                rb = torch.randn(b, h, s_q, generator=gen, dtype=torch.float64)
                dkl = torch.randn(b, h, generator=gen, dtype=torch.float64)
                if kl == 2:  # logits far from 0, as a trained model's are, and the row's log-sum-exp
                    q = q * 4 + 1
                    rb = (scale * q @ k.repeat_interleave(h // h_kv, 1).transpose(-2, -1)).logsumexp(-1)
                ours = LinearKl(q, k, a, None if qpad is None else qpad.to(torch.uint8),
                                None if kpad is None else kpad.to(torch.uint8), causal, scale, torch.float64, kl)
                ks, trow = ours.rows(rb)
                qbar, da, dq = ours.grads(rb, dkl)
                for name, got, want in zip(("KS", "TROW", "QBAR", "dA", "dQ"), (ks, trow, qbar, da, dq),
                                           dense(q, k, a, qpad, kpad, causal, scale, rb, dkl, kl)):
                    self.assertEqual(got.shape, want.shape, name)
                    self.assertLess(float((got - want).abs().max()), 1e-12 * (1 + float(want.abs().max())), name)

    def test_lognormal_terms_hold_in_float32_where_the_logits_are_far_from_0(self):
        # The centred sums against float64's, on logits of 60 ± 6: in float32 they are within
        # 2.5e-6 of the largest of each term, where the plain expansion Σ_j z_ij² − 2 Σ_j z_ij
        # (RB_i + a_j) + Σ_j (RB_i + a_j)² misses TROW by 5.6e-5 (4.6e-4 at 96 ± 3.5).
        gen = torch.Generator().manual_seed(3)
        b, h, s_q, s_k, d, scale = 1, 2, 64, 96, 16, 0.25
        q = torch.randn(b, h, s_q, d, generator=gen, dtype=torch.float64) + 3
        k = torch.randn(b, h, s_k, d, generator=gen, dtype=torch.float64) + 5
        a = torch.rand(b, h, s_k, generator=gen, dtype=torch.float64) - 5
        rb = (scale * q @ k.transpose(-2, -1)).logsumexp(-1)
        dkl = torch.ones(b, h, dtype=torch.float64)
        want = dense(q, k, a, None, None, False, scale, rb, dkl, 2)
        ours = LinearKl(q.float(), k.float(), a.float(), None, None, False, scale, torch.float32, 2)
        got = (*ours.rows(rb.float()), *ours.grads(rb.float(), dkl.float()))
        for name, g, w in zip(("KS", "TROW", "QBAR", "dA", "dQ"), got, want):
            err = float((g.double() - w).abs().max() / w.abs().max())
            self.assertLess(err, 1e-5, name)

    def test_the_kernels_leave_the_terms_to_the_caller_over_softmax_alone_without_patterns(self):
        self.assertTrue(linear_kl(1, 0, False, False, False, False))
        self.assertTrue(linear_kl(1, 0, False, False, False, True))   # Weibull's sums: prefix sums
        self.assertTrue(linear_kl(2, 0, False, False, False, False))
        self.assertFalse(linear_kl(2, 0, False, False, False, True))  # Lognormal's: a d × d matrix per key
        self.assertFalse(linear_kl(1, 1, False, False, False, False))  # DNAS's logits hold c_j
        self.assertFalse(linear_kl(1, 0, True, False, False, False))   # HNAS's log-weights
        self.assertFalse(linear_kl(1, 0, False, True, False, False))   # a boolean pattern
        self.assertFalse(linear_kl(1, 0, False, False, True, False))   # an additive mask
        with self.assertRaises(ValueError):
            LinearKl(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2), None, None, True, 1.0,
                     torch.float64, 2)


if __name__ == "__main__":
    unittest.main()

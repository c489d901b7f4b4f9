"""The probattn Python package against the independent PyTorch references
(python/probattn_tools/reference: formulas written from the papers, and the pure-PyTorch
multi-head module) and against torch.nn.MultiheadAttention: every variant's values and
gradients, the module, training, the repulsive step, the backends, the calls' fixed cost, bad
input and the registry. Run by `cargo test` (tests/python.rs beside this file builds the
extension and runs `python -m unittest discover` here)."""

import math
import os
import subprocess
import sys
import unittest
from unittest import mock

import torch

import probattn
from common import BAM, BAM_CFG, D, DETERMINISTIC, allowed, bam_noise, causal_safe, gradcheck_every_variant, layouts, prior_params, qkv, sdpa
from probattn_tools.reference import formulas as R
from probattn_tools.reference import variants as registry
from probattn_tools.reference.mha import MultiheadAttention as ReferenceMha


class Reference(unittest.TestCase):
    """Outputs and gradients equal the formulas to 1e-10 (float64), eager and memory-efficient."""

    def check(self, ours, theirs, inputs, what):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10, msg=lambda m: f"{what}: output: {m}")
        g = torch.randn_like(ours)
        mine = torch.autograd.grad(ours, inputs, g, retain_graph=True, allow_unused=True)
        ref = torch.autograd.grad(theirs, inputs, g, retain_graph=True, allow_unused=True)
        for i, (a, b) in enumerate(zip(mine, ref)):
            a = torch.zeros_like(inputs[i]) if a is None else a
            b = torch.zeros_like(inputs[i]) if b is None else b
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=lambda m: f"{what}: gradient {i}: {m}")

    def test_deterministic_variants(self):
        b, h, sq, sk = 2, 3, 5, 6
        for variant in DETERMINISTIC:
            for layout, masks in layouts(b, h, sq, sk):
                if layout == "causal" and not causal_safe(variant):
                    continue
                for memory_efficient in (False, True):
                    what = f"{variant} {layout} {'memory-efficient' if memory_efficient else 'eager'}"
                    with self.subTest(what):
                        q, k, v = qkv()
                        logit = torch.tensor([0.3, -1.0, 2.0], dtype=D, requires_grad=True)
                        extra = {"hybrid_logit": logit} if "hybrid_logit" in registry.entry(variant)["parameters"] else {}
                        tile = {"tile": 2} if memory_efficient else {}
                        ours, info = probattn.attention_with_info(q, k, v, variant=variant, memory_efficient=memory_efficient,
                                                                  **sdpa(masks), **extra, **tile)
                        theirs, w = R.attention(variant, q, k, v, allowed(b, h, sq, sk, masks), hybrid_logit=logit)
                        self.check(ours, theirs, [q, k, v, logit], what)
                        torch.testing.assert_close(info.received_mass, R.received_mass(w).detach(), rtol=0, atol=1e-10)
                        self.assertIsNone(info.kl)

    def test_bam_variants_sampling_a_given_draw(self):
        b, h, sq, sk, d = 2, 3, 5, 6, 4
        for variant in BAM:
            for layout, masks in layouts(b, h, sq, sk)[:4]:
                for memory_efficient in (False, True):
                    what = f"{variant} {layout} {'memory-efficient' if memory_efficient else 'eager'}"
                    with self.subTest(what):
                        q, k, v = qkv()
                        prior = {n: t.requires_grad_() for n, t in prior_params(h, d, 4).items()}
                        noise = bam_noise(variant, (b, h, sq, sk))
                        bam = dict(BAM_CFG, noise=noise)
                        if variant in ("bam-wc", "bam-lc"):
                            bam["prior"] = prior
                        tile = {"tile": 4} if memory_efficient else {}
                        ours, info = probattn.attention_with_info(q, k, v, variant=variant, training=True, bam=bam,
                                                                  memory_efficient=memory_efficient, **sdpa(masks), **tile)
                        ok = allowed(b, h, sq, sk, masks)
                        cfg = dict(BAM_CFG, base="softmax")
                        w, kl = R.bam_weights(variant, q @ k.transpose(-2, -1) / d ** 0.5, ok, k, noise, True, cfg,
                                              prior={"prior." + n: t for n, t in prior.items()})
                        self.check(ours, w @ v, [q, k, v] + list(prior.values()), what)
                        if kl is None:
                            self.assertIsNone(info.kl)
                        else:
                            torch.testing.assert_close(info.kl, kl, rtol=0, atol=1e-10)
                            gk = torch.autograd.grad(info.kl, [q, k], allow_unused=True)
                            gr = torch.autograd.grad(kl, [q, k], allow_unused=True)
                            for a, r in zip(gk, gr):
                                torch.testing.assert_close(a if a is not None else torch.zeros_like(q), r if r is not None else torch.zeros_like(q), rtol=0, atol=1e-10)

    def test_bam_without_sampling_is_its_base(self):
        q, k, v = qkv()
        prior = prior_params(3, 4, 10)
        out = probattn.attention(q, k, v, variant="bam-wc", bam={"prior": prior})
        torch.testing.assert_close(out, probattn.attention(q, k, v, variant="softmax"), rtol=0, atol=1e-12)


class Gradcheck(unittest.TestCase):
    """torch.autograd.gradcheck in float64 through every variant, eager and memory-efficient."""

    def test_every_variant(self):
        gradcheck_every_variant(self, "cpu")


class MultiheadAttention(unittest.TestCase):
    def test_softmax_equals_torch_both_ways(self):
        torch.manual_seed(0)
        ours = probattn.nn.MultiheadAttention(16, 4, dtype=D)
        theirs = torch.nn.MultiheadAttention(16, 4, dtype=D)
        self.assertEqual(sorted(ours.state_dict()), sorted(theirs.state_dict()))
        x = torch.randn(7, 3, 16, dtype=D)  # (L, N, E)
        kp = torch.zeros(3, 7, dtype=torch.bool)
        kp[1, -3:] = True
        for direction in ("theirs -> ours", "ours -> theirs"):
            with self.subTest(direction):
                if direction == "theirs -> ours":
                    ours.load_state_dict(theirs.state_dict())
                else:
                    with torch.no_grad():
                        for p in ours.parameters():
                            p.normal_()
                    theirs.load_state_dict(ours.state_dict())
                a, wa = ours(x, x, x, key_padding_mask=kp)
                b, wb = theirs(x, x, x, key_padding_mask=kp)
                torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
                torch.testing.assert_close(wa, wb, rtol=0, atol=1e-12)
                names = [n for n, _ in ours.named_parameters()]
                ga = torch.autograd.grad(a.sum(), [dict(ours.named_parameters())[n] for n in names])
                gb = torch.autograd.grad(b.sum(), [dict(theirs.named_parameters())[n] for n in names])
                for name, p, q in zip(names, ga, gb):
                    torch.testing.assert_close(p, q, rtol=0, atol=1e-12, msg=lambda m: f"{name}: {m}")

    def test_the_pure_pytorch_module_refuses_a_registry_variant_it_does_not_write(self):
        from probattn_tools.reference import mha

        entry = dict(mha._REGISTRY["dnas"], name="warm-dnas", example="warm-dnas")
        with mock.patch.dict(mha._REGISTRY, {"warm-dnas": entry}):
            with self.assertRaisesRegex(ValueError, "warm-dnas: not written in this pure-PyTorch module"):
                ReferenceMha(12, 3, variant="warm-dnas")

    def test_every_deterministic_variant_equals_the_pure_pytorch_module(self):
        for variant in DETERMINISTIC:
            try:
                ReferenceMha(12, 3, variant=variant)
            except ValueError as e:  # a variant added to the library after the module's branches
                self.assertIn(f"{variant}: not written", str(e))
                continue
            for batch_first in (False, True):
                with self.subTest(f"{variant} batch_first={batch_first}"):
                    torch.manual_seed(1)
                    ours = probattn.nn.MultiheadAttention(12, 3, variant=variant, batch_first=batch_first, dtype=D)
                    ref = ReferenceMha(12, 3, variant=variant, batch_first=batch_first).to(D)
                    ref.load_state_dict(ours.state_dict())
                    x = torch.randn(4, 6, 12, dtype=D)
                    kp = torch.zeros(4 if batch_first else 6, 6 if batch_first else 4, dtype=torch.bool)
                    kp[0, -1] = True
                    a, wa = ours(x, x, x, key_padding_mask=kp, average_attn_weights=False)
                    b, wb = ref(x, x, x, key_padding_mask=kp, average_attn_weights=False)
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
                    torch.testing.assert_close(wa, wb, rtol=0, atol=1e-10)
                    ga = torch.autograd.grad(a.square().sum(), list(ours.parameters()))
                    gb = dict(zip([n for n, _ in ref.named_parameters()], torch.autograd.grad(b.square().sum(), list(ref.parameters()))))
                    for (name, _), g in zip(ours.named_parameters(), ga):
                        torch.testing.assert_close(g, gb[name], rtol=0, atol=1e-10, msg=lambda m: f"{name}: {m}")

    def test_memory_efficient_module_equals_the_eager_one_and_keeps_the_kl(self):
        torch.manual_seed(2)
        eager = probattn.nn.MultiheadAttention(12, 3, variant="dnas", batch_first=True, dtype=D)
        tiled = probattn.nn.MultiheadAttention(12, 3, variant="dnas", batch_first=True, dtype=D, memory_efficient=True, tile=2)
        tiled.load_state_dict(eager.state_dict())
        x = torch.randn(2, 5, 12, dtype=D)
        a, _ = eager(x, x, x, need_weights=False)
        b, w = tiled(x, x, x, need_weights=False)
        self.assertIsNone(w)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
        with self.assertRaisesRegex(ValueError, "need_weights=False"):
            tiled(x, x, x)
        bam = probattn.nn.MultiheadAttention(12, 3, variant="bam-wc", batch_first=True, dtype=D)
        self.assertIn("prior.f1.weight", dict(bam.named_parameters()))
        bam.train()
        bam(x, x, x)
        self.assertEqual(bam.kl.dim(), 0)
        bam.kl.backward()
        self.assertIsNotNone(bam.prior.f1.weight.grad)
        bam.eval()
        bam(x, x, x)
        self.assertIsNone(bam.kl)


class Training(unittest.TestCase):
    def test_the_readme_loop_lowers_the_loss(self):
        # The README's five lines, with each kind of variant (BAM's KL added to the loss).
        for variant in ("dnas", "hnas", "bam-wc"):
            with self.subTest(variant):
                torch.manual_seed(0)
                mha = probattn.nn.MultiheadAttention(32, 4, variant=variant, batch_first=True)
                opt = torch.optim.Adam(mha.parameters(), lr=1e-2)
                x, y = torch.randn(8, 10, 32), torch.randn(8, 10, 32)
                losses = []
                for _ in range(30):
                    out, _ = mha(x, x, x, need_weights=False)
                    loss = (out - y).square().mean() + (0.01 * mha.kl if mha.kl is not None else 0)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    losses.append(loss.item())
                self.assertLess(losses[-1], 0.9 * losses[0], losses)
                if variant == "hnas":
                    self.assertIsNotNone(mha.hybrid_logit.grad)


class Repulsive(unittest.TestCase):
    """probattn.repulsive.attach against the reference formulas' SVGD/SPOS direction."""

    def step(self, method, selection=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16, dtype=D), torch.nn.Identity())
        model.attn = torch.nn.MultiheadAttention(16, 4, dtype=D, batch_first=True)
        x = torch.randn(3, 5, 8, dtype=D)
        h = model[0](x)
        model.attn(h, h, h)[0].square().sum().backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        hook = probattn.repulsive.attach(opt, model, kind=method, alpha=0.05, stepsize=0.1, beta=0.7, selection=selection)
        torch.manual_seed(42)
        opt.step()
        return model, hook, before, grads

    def expected_in_proj(self, method, before, grads, projections):
        w, g = before["attn.in_proj_weight"].view(3, 4, -1), grads["attn.in_proj_weight"].view(3, 4, -1)
        torch.manual_seed(42)
        xi = torch.randn(3, 4, w.shape[-1], dtype=D) if method == "spos" else None
        out = g.clone()
        for i, p in enumerate("qkv"):
            if p in projections:
                out[i] = R.svgd_direction(w[i], g[i], 0.05, 0.1, method=method, beta=0.7, xi=None if xi is None else xi[i])
        return before["attn.in_proj_weight"] - out.view_as(before["attn.in_proj_weight"])

    def test_svgd_and_spos_move_the_heads_as_the_formulas_say(self):
        for method in ("svgd", "spos"):
            with self.subTest(method):
                model, hook, before, grads = self.step(method)
                self.assertEqual(hook.modules, [("attn", "other", 0)])
                self.assertEqual(hook.sets, ["attn.q", "attn.k", "attn.v"])
                torch.testing.assert_close(model.attn.in_proj_weight.detach(), self.expected_in_proj(method, before, grads, "qkv"), rtol=0, atol=1e-12)
                # Everything else took its plain gradient.
                for name in ("0.weight", "attn.out_proj.weight", "attn.in_proj_bias"):
                    torch.testing.assert_close(dict(model.named_parameters())[name].detach(), before[name] - grads[name], rtol=0, atol=1e-15)

    def test_the_selection_is_the_command_lines(self):
        model, hook, before, grads = self.step("svgd", selection={"projections": ["q"]})
        self.assertEqual(hook.sets, ["attn.q"])
        torch.testing.assert_close(model.attn.in_proj_weight.detach(), self.expected_in_proj("svgd", before, grads, "q"), rtol=0, atol=1e-12)
        with self.assertRaisesRegex(ValueError, "selection"):
            probattn.repulsive.attach(torch.optim.SGD(model.parameters(), lr=1), model, selection={"kind": ["cross"]})

    def test_kinds_and_layers_of_a_transformer(self):
        t = torch.nn.Transformer(16, 2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=8, batch_first=True)
        found = [(n, k, l) for n, _, k, l in probattn.repulsive.attention_modules(t)]
        self.assertIn(("encoder.layers.1.self_attn", "encoder-self", 1), found)
        self.assertIn(("decoder.layers.0.self_attn", "decoder-self", 0), found)
        self.assertIn(("decoder.layers.1.multihead_attn", "cross", 1), found)
        self.assertEqual(len(found), 6)


class Backends(unittest.TestCase):
    def test_each_backend_gives_the_eager_result_or_says_why_not(self):
        q, k, v = qkv(dv=4)
        reference = probattn.attention(q, k, v, variant="dnas")
        probattn.attention_routes(reset=True)
        for backend, route in (("eager", "eager"), ("tiles", "tiles"), ("fused", "fused-cpu")):
            with self.subTest(backend):
                with probattn.attention_backend(backend):
                    out = probattn.attention(q, k, v, variant="dnas")
                torch.testing.assert_close(out, reference, rtol=0, atol=1e-12)
                self.assertEqual(probattn.attention_routes(reset=True), {route: 1})
        # The fused CPU kernel takes no attention mask: a named error, not a quiet change of route.
        am = torch.zeros(5, 6, dtype=torch.bool)
        am[1, 0] = True
        with probattn.attention_backend("fused"):
            with self.assertRaisesRegex(ValueError, "dnas: the fused CPU kernel does not serve this call"):
                probattn.attention(q, k, v, variant="dnas", attn_mask=~am)
            with self.assertRaisesRegex(ValueError, "forms no weights, and they were asked for"):
                probattn.attention_with_info(q, k, v, variant="dnas")
        # Left on leaving the block, even by an exception.
        self.assertEqual(probattn.attention_routes(reset=True), {})
        probattn.attention(q, k, v, variant="dnas")
        self.assertEqual(probattn.attention_routes(reset=True), {"eager": 1})
        with self.assertRaisesRegex(ValueError, "unknown attention backend 'flash'"):
            with probattn.attention_backend("flash"):
                pass

    def test_a_padding_mask_broadcast_over_the_queries_takes_the_fused_kernel(self):
        # As transformers builds a padded batch's mask: (B, 1, 1, S) True = takes part, expanded
        # over the queries. It runs as key padding, on the fused CPU kernel; stored whole, it is a
        # pattern, on the tiles; both give the eager result.
        from probattn.functional import scaled_dot_product_attention as sdpa_ours
        q, k, v = qkv(dv=4)
        keep = torch.ones(2, 1, 1, 6, dtype=torch.bool)
        keep[1, ..., -2:] = False
        expanded = keep.expand(2, 1, 5, 6)
        eager = sdpa_ours(q, k, v, attn_mask=expanded.contiguous(), variant="dnas")
        probattn.attention_routes(reset=True)
        for mask, route in ((expanded, "fused-cpu"), (expanded.contiguous(), "tiles")):
            with self.subTest(route):
                out = sdpa_ours(q, k, v, attn_mask=mask, variant="dnas", memory_efficient=True)
                self.assertEqual(probattn.attention_routes(reset=True), {route: 1})
                torch.testing.assert_close(out, eager, rtol=0, atol=1e-12)
                g = torch.randn_like(out)
                torch.testing.assert_close(torch.autograd.grad(out, q, g)[0], torch.autograd.grad(eager, q, g, retain_graph=True)[0],
                                           rtol=0, atol=1e-12)


class LeanCalls(unittest.TestCase):
    def test_a_variant_is_resolved_once_and_every_path_agrees(self):
        from probattn import _native, _registry, functional
        q, k, v = qkv(dv=4)
        functional._SPECS.clear()
        _registry.spec.cache_clear()
        for _ in range(3):
            probattn.attention(q, k, v, variant="dnas")
            probattn.attention(q, k, v, variant="dnas", memory_efficient=True)
        self.assertIn("dnas", functional._SPECS)
        self.assertEqual(_registry.spec.cache_info().misses, 1)  # both paths share the one spec
        # The common call is the extension's whole; others are the general path's, with the same numbers.
        spec = functional._SPECS["dnas"]
        whole = _native.sdpa(spec, q, k, v, None, 0.0, False, None, False, False)
        self.assertIsNotNone(whole)
        torch.testing.assert_close(whole, probattn.attention(q, k, v, variant="dnas", memory_efficient=True),
                                   rtol=0, atol=1e-12)
        self.assertIsNone(_native.sdpa(spec, q[:1], k, v, None, 0.0, False, None, False, False))  # batches broadcast
        self.assertIsNone(_native.sdpa(spec, q, k, v, torch.ones(4, 6, dtype=torch.bool), 0.0, False, None, False,
                                       False))  # a mask that does not broadcast: the general path names it
        self.assertIsNone(_native.sdpa(spec, q, "k", v, None, 0.0, False, None, False, False))
        broadcast = probattn.attention(q[:1], k, v, variant="dnas")
        torch.testing.assert_close(broadcast, probattn.attention(q[:1].expand_as(q), k, v, variant="dnas"),
                                   rtol=0, atol=1e-12)

    def test_a_seeded_call_draws_the_same_whether_or_not_it_names_its_variant_first(self):
        # Resolving a variant with a contextual prior builds it once per variant and base, which
        # draws the prior's initial values; the generator comes back as it was. bam-lc over
        # sinkhorn-7 is named by no other test, so this process resolves it here first, and the
        # first of two calls seeded alike draws what the second draws.
        q, k, v = qkv(dv=4)
        bam = dict(BAM_CFG, base="sinkhorn-7", prior=prior_params(3, 4, int(BAM_CFG["prior_hidden"])))
        draws = []
        for _ in range(2):
            torch.manual_seed(11)
            draws.append(probattn.attention(q, k, v, variant="bam-lc", training=True, bam=bam))
        torch.testing.assert_close(draws[0], draws[1], rtol=0, atol=0)

    def test_a_built_normalizer_is_reused_only_where_it_reads_no_parameters(self):
        # HNAS reads the caller's gate logits at every call: a changed logit changes the output.
        q, k, v = qkv(dv=4)
        logit = torch.zeros(3, dtype=D)
        a = probattn.attention(q, k, v, variant="hnas", hybrid_logit=logit)
        b = probattn.attention(q, k, v, variant="hnas", hybrid_logit=logit + 2.0)
        self.assertGreater((a - b).abs().max().item(), 1e-3)
        torch.testing.assert_close(a, 0.5 * (probattn.attention(q, k, v, variant="dnas") + probattn.attention(q, k, v)),
                                   rtol=0, atol=1e-12)

    def test_the_rust_timing_runs_the_call_it_names(self):
        from probattn import _native
        forward, both = _native.rust_timing("dnas", 8, repeats=3, heads=2, dim=4)
        self.assertEqual((len(forward), len(both)), (3, 3))
        self.assertTrue(all(t > 0 for t in forward + both))
        with self.assertRaisesRegex(ValueError, "unknown attention variant 'dnaz'"):
            _native.rust_timing("dnaz", 8)


class Errors(unittest.TestCase):
    def test_bad_inputs_raise_with_the_library_message(self):
        q, k, v = qkv(grad=False)
        cases = [
            (ValueError, "unknown attention variant 'nope'", lambda: probattn.attention(q, k, v, variant="nope")),
            (ValueError, "same embedding size", lambda: probattn.attention(q, k[..., :2], v)),
            (ValueError, r"query has shape \(4,\): expected \(..., L, E\)", lambda: probattn.attention(q[0, 0, 0], k, v)),
            (TypeError, "share one dtype", lambda: probattn.attention(q, k.float(), v)),
            (TypeError, "attn_mask must be boolean .* or floating-point",
             lambda: probattn.attention(q, k, v, attn_mask=torch.zeros(5, 6, dtype=torch.int64))),
            (ValueError, r"attn_mask has shape \(4, 6\), which does not broadcast",
             lambda: probattn.attention(q, k, v, attn_mask=torch.zeros(4, 6, dtype=torch.bool))),
            (ValueError, "additive mask \\(bias\\) holds NaN",
             lambda: probattn.attention(q, k, v, attn_mask=torch.full((5, 6), math.nan, dtype=D))),
            (ValueError, "attn_mask and is_causal are both set",
             lambda: probattn.attention(q, k, v, attn_mask=torch.ones(5, 6, dtype=torch.bool), is_causal=True)),
            (ValueError, "query has 3 heads, key 2 and value 2: .*enable_gqa=True",
             lambda: probattn.attention(q, k[:, :2], v[:, :2])),
            (ValueError, r"enable_gqa: the key/value heads \(2\) must divide the query heads \(3\)",
             lambda: probattn.attention(q, k[:, :2], v[:, :2], enable_gqa=True)),
            (TypeError, "torch.Tensor", lambda: probattn.attention(q, [1], v)),
            (ValueError, "hybrid_logit", lambda: probattn.attention(q, k, v, variant="hnas")),
            (ValueError, "prior", lambda: probattn.attention(q, k, v, variant="bam-wc", training=True)),
            (ValueError, "causal", lambda: probattn.attention(q, k, v, variant="dnas", is_causal=True)),
            (ValueError, "unknown bam settings", lambda: probattn.attention(q, k, v, variant="bam-wf", bam={"kk": 1})),
            (TypeError, "key_padding_mask", lambda: probattn.attention(q, k, v, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))),
            (ValueError, "memory_efficient=True", lambda: probattn.attention(q, k, v, tile=4)),
            (ValueError, r"tile must be at least 1 \(queries a tile\), got 0",
             lambda: probattn.attention(q, k, v, memory_efficient=True, tile=0)),
            (ValueError, "tile must be at least 1 .*, got 1180591620717411303424",
             lambda: probattn.attention(q, k, v, memory_efficient=True, tile=2**70)),
            (TypeError, "tile must be an integer, got float",
             lambda: probattn.attention(q, k, v, memory_efficient=True, tile=2.5)),
            (TypeError, "tile must be an integer, got float",
             lambda: probattn.nn.MultiheadAttention(4, 2, memory_efficient=True, tile=2.5)),
            (ValueError, "embed_dim and num_heads must be greater than 0, got embed_dim=4 and num_heads=0 instead",
             lambda: probattn.nn.MultiheadAttention(4, 0)),
            (ValueError, "seed keys the memory-efficient path's BAM draws",
             lambda: probattn.attention(q, k, v, variant="bam-wf", training=True, seed=3)),
            (ValueError, "construct it with memory_efficient=True",
             lambda: probattn.nn.MultiheadAttention(4, 2, variant="bam-wf", batch_first=True, dtype=D)(
                 q[0], q[0], q[0], need_weights=False, seed=3)),
            # The draws' key is 64 bits: outside them, or not an integer, the seed is named.
            (ValueError, r"seed must be an integer in \[0, 2\*\*64\), the key of BAM's draws, got -1",
             lambda: probattn.attention(q, k, v, variant="bam-wf", training=True, memory_efficient=True, seed=-1)),
            (ValueError, r"seed must be an integer in \[0, 2\*\*64\), the key of BAM's draws, got 18446744073709551616",
             lambda: probattn.attention(q, k, v, variant="bam-wf", training=True, memory_efficient=True, seed=2**64)),
            (TypeError, "seed must be an integer, got float",
             lambda: probattn.attention(q, k, v, variant="bam-wf", training=True, memory_efficient=True, seed=1.5)),
            (TypeError, "seed must be an integer, got bool",
             lambda: probattn.nn.MultiheadAttention(4, 2, variant="bam-wf", batch_first=True, dtype=D, memory_efficient=True)(
                 q[0], q[0], q[0], need_weights=False, seed=True)),
        ]
        for kind, message, call in cases:
            with self.subTest(message):
                with self.assertRaisesRegex(kind, message):
                    call()
        # The whole range is taken: the largest key draws as any other.
        out = probattn.attention(q, k, v, variant="bam-wf", training=True, memory_efficient=True, seed=2**64 - 1)
        self.assertTrue(torch.isfinite(out).all())

    def test_another_torch_is_refused_at_import_by_name(self):
        code = "import torch; torch.__version__ = '2.99.0'; import probattn"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn(f"ImportError: probattn was built against torch {probattn.REQUIRED_TORCH}, but this interpreter has torch "
                      "2.99.0", out.stderr)


class Registry(unittest.TestCase):
    def test_the_registry_is_the_binarys(self):
        self.assertEqual(probattn.variants(), registry.registry())

    def test_the_package_keeps_no_variant_names_of_its_own(self):
        """The package's code reads what a variant is from the registry: apart from docstrings and
        default argument values ("softmax"), no string constant is a variant's name, alias or
        `name-` prefix, so a variant added to the registry needs no edit here."""
        import ast
        import pathlib

        names = set()
        for e in registry.registry():
            names.update([e["name"], e["example"], *e["aliases"]] + ([e["name"][:-1]] if e["name"].endswith("-N") else []))
        found = []
        for path in sorted(pathlib.Path(probattn.__file__).parent.glob("*.py")):
            tree = ast.parse(path.read_text())
            allowed = set()
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node, clean=False):
                    allowed.add(id(node.body[0].value))
                if isinstance(node, ast.FunctionDef):
                    allowed.update(id(d) for d in node.args.defaults + node.args.kw_defaults if d is not None)
            found += [f"{path.name}:{node.lineno} {node.value!r}" for node in ast.walk(tree)
                      if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in allowed
                      and node.value in names]
        self.assertGreaterEqual(len(names), 10)
        self.assertEqual(found, [])


if __name__ == "__main__":
    unittest.main()

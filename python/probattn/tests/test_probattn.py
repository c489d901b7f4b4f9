"""The probattn Python package against the independent PyTorch references
(python/probattn_tools/reference: formulas written from the papers, and the pure-PyTorch
multi-head module) and against torch.nn.MultiheadAttention. Run by `cargo test` (tests/python.rs
beside this file builds the extension and runs `python -m unittest discover` here)."""

import importlib.util
import math
import os
import subprocess
import sys
import unittest
from unittest import mock

import torch
from torch.autograd import gradcheck

import probattn
from probattn_tools.reference import formulas as R
from probattn_tools.reference import variants as registry
from probattn_tools.reference.mha import MultiheadAttention as ReferenceMha

D = torch.float64
DETERMINISTIC = [e["example"] for e in registry.registry() if not e["stochastic"]]
BAM = registry.examples(family="bayesian")
BAM_CFG = {"k": 10.0, "sigma": 0.5, "prior_alpha": 1.5, "prior_beta": 2.0, "prior_mu": -0.3, "prior_sigma": 1.2, "prior_hidden": 4}


def qkv(b=2, h=3, sq=5, sk=6, d=4, dv=3, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(b, h, sq, d, generator=g, dtype=D), torch.randn(b, h, sk, d, generator=g, dtype=D),
          torch.randn(b, h, sk, dv, generator=g, dtype=D)]
    return [t.requires_grad_(grad) for t in ts]


def layouts(b, h, sq, sk):
    """Mask layouts: none, key padding, a 2-D attn_mask, a 4-D one with padding, causal."""
    kp = torch.zeros(b, sk, dtype=torch.bool)
    kp[0, -2:] = True
    am = torch.zeros(sq, sk, dtype=torch.bool)
    am[1, 0] = am[3, 2] = True
    am4 = torch.rand(b, h, sq, sk, generator=torch.Generator().manual_seed(1)) < 0.2
    am4[..., 0] = False
    return [("none", {}), ("key_padding", {"key_padding_mask": kp}), ("attn_mask", {"attn_mask": am}),
            ("attn_mask_4d", {"attn_mask": am4, "key_padding_mask": kp}), ("causal", {"is_causal": True})]


def sdpa(masks):
    """A layout's masks as probattn.attention takes them, in PyTorch's SDPA convention:
    `is_causal`, or one boolean `attn_mask` whose True marks an entry that takes part."""
    if masks.get("is_causal"):
        return {"is_causal": True}
    kp, am = masks.get("key_padding_mask"), masks.get("attn_mask")
    if kp is None and am is None:
        return {}
    excluded = torch.zeros((), dtype=torch.bool)
    if kp is not None:
        excluded = excluded | kp[:, None, None, :]
    if am is not None:
        excluded = excluded | am
    return {"attn_mask": ~excluded}


def allowed(b, h, sq, sk, masks):
    return R.allowed_mask(b, h, sq, sk, key_padding_mask=masks.get("key_padding_mask"), attn_mask=masks.get("attn_mask"),
                          causal=masks.get("is_causal", False))


def causal_safe(variant):
    return next(e for e in registry.registry() if variant in (e["name"], e["example"]))["causal_safe"]


def prior_params(h, d, hidden, seed=3):
    g = torch.Generator().manual_seed(seed)
    return {"f1.weight": torch.randn(h, hidden, d, generator=g, dtype=D), "f1.bias": torch.randn(h, hidden, generator=g, dtype=D),
            "f2.weight": torch.randn(h, hidden, generator=g, dtype=D), "f2.bias": torch.randn(h, generator=g, dtype=D)}


def bam_noise(variant, shape, seed=5):
    g = torch.Generator().manual_seed(seed)
    if registry.noise(variant) == "weibull":
        return torch.rand(shape, generator=g, dtype=D).clamp(1e-6, 1 - 1e-6)
    return torch.randn(shape, generator=g, dtype=D)


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


def gradcheck_every_variant(test, device, layouts_used=3):
    """torch.autograd.gradcheck in float64 through every variant, eager and memory-efficient, on
    `device`, under the first `layouts_used` mask layouts."""
    b, h, sq, sk = 1, 2, 4, 5
    on = lambda t: t.to(device)  # noqa: E731
    for variant in registry.examples():
        for layout, masks in layouts(b, h, sq, sk)[:layouts_used]:
            masks = {n: on(m) if torch.is_tensor(m) else m for n, m in masks.items()}
            for memory_efficient in (False, True):
                with test.subTest(f"{variant} {layout} {memory_efficient} {device}"):
                    inputs = [on(t.detach()).requires_grad_() for t in qkv(b, h, sq, sk, 3, 2, seed=7)]
                    if variant == "hnas":
                        inputs.append(torch.tensor([0.2, -0.4], dtype=D, device=device, requires_grad=True))
                    bam = None
                    if variant.startswith("bam"):
                        bam = dict(BAM_CFG, noise=on(bam_noise(variant, (b, h, sq, sk))))
                        if variant in ("bam-wc", "bam-lc"):
                            bam["prior"] = {n: on(t) for n, t in prior_params(h, 3, 4).items()}

                    def f(*xs):
                        kw = {"hybrid_logit": xs[3]} if variant == "hnas" else {}
                        out, info = probattn.attention_with_info(xs[0], xs[1], xs[2], variant=variant,
                                                                 memory_efficient=memory_efficient,
                                                                 tile=2 if memory_efficient else None,
                                                                 training=bam is not None, bam=bam, **sdpa(masks), **kw)
                        return (out, info.kl) if info.kl is not None else out

                    test.assertTrue(gradcheck(f, tuple(inputs), eps=1e-6, atol=1e-8))


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


class Autocast(unittest.TestCase):
    def test_attention_under_torch_autocast_runs_in_bfloat16_with_float32_statistics(self):
        # torch.autocast and the library share libtorch's autocast state: float32 inputs attend in
        # bfloat16 (as sdpa does), within docs/precision.md's tolerance of float64, and the
        # received mass stays float32; bfloat16 inputs need no region.
        q, k, v = (t.detach().float() for t in qkv(seed=7))
        for variant in ("softmax", "dnas", "sinkhorn-3"):
            for me in (False, True):
                with self.subTest(variant=variant, memory_efficient=me):
                    want = probattn.attention(q.double(), k.double(), v.double(), variant=variant)
                    with torch.autocast("cpu", torch.bfloat16):
                        out, info = probattn.attention_with_info(q, k, v, variant=variant, memory_efficient=me)
                    self.assertEqual(out.dtype, torch.bfloat16)
                    if me:
                        self.assertEqual(info.received_mass.dtype, torch.float32)
                    direct = probattn.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), variant=variant, memory_efficient=me)
                    for got in (out, direct):
                        err = (got.double() - want).abs().max() / want.abs().max()
                        self.assertLess(err.item(), 0.02)

    def test_a_compiled_call_under_autocast_equals_the_eager_one(self):
        # The custom operator is registered for autocast, so the compiled graph casts as eager does:
        # q, k and v to bfloat16, HNAS's gate logits kept float32.
        q, k, v = (t.detach().float() for t in qkv(seed=8))
        logit = torch.tensor([0.3, -1.2, 2.0])
        for memory_efficient in (True, False):
            for variant in ("dnas", "hnas"):
                with self.subTest(f"memory_efficient={memory_efficient} {variant}"):
                    extra = {"hybrid_logit": logit} if variant == "hnas" else {}

                    def call(q, k, v):
                        return probattn.attention(q, k, v, variant=variant, memory_efficient=memory_efficient, **extra)

                    torch._dynamo.reset()
                    backend = "inductor" if (memory_efficient, variant) == (True, "dnas") else "aot_eager"
                    compiled = torch.compile(call, fullgraph=True, backend=backend)
                    with torch.autocast("cpu", torch.bfloat16):
                        eager, traced = call(q, k, v), compiled(q, k, v)
                    self.assertEqual((eager.dtype, traced.dtype), (torch.bfloat16, torch.bfloat16))
                    self.assertTrue(torch.equal(eager, traced))


    def test_the_module_casts_a_shared_input_once_under_autocast(self):
        # Self-attention's one input, and cross-attention's memory as keys and values, are cast to
        # bfloat16 once (the library keeps that one copy for every projection's weight gradient),
        # counted in libtorch's profiler; distinct tensors, one cast each. Batch first, sequence
        # first and unbatched. The output is the same either way.
        from torch.profiler import ProfilerActivity, profile

        torch.manual_seed(0)
        for batch_first, shape in ((True, (2, 5, 16)), (False, (5, 2, 16)), (True, (5, 16))):
            attn = probattn.nn.MultiheadAttention(16, 4, variant="dnas", batch_first=batch_first)
            x, q = torch.randn(shape), torch.randn(shape)
            for label, args, casts in (("self", (x, x, x), 1), ("cross", (q, x, x), 2),
                                       ("distinct", (x, x.clone(), x.clone()), 3)):
                with self.subTest(f"batch_first={batch_first} {shape} {label}"):
                    with torch.autocast("cpu", torch.bfloat16), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                        out = attn(*args, need_weights=False)[0]
                    # The module casts its batch-first views: counted by size (no parameter has the input's).
                    counted = sum(1 for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes
                                  and len(e.input_shapes[0]) == 3 and math.prod(e.input_shapes[0]) == x.numel())
                    self.assertEqual(counted, casts)
                    with torch.autocast("cpu", torch.bfloat16):
                        apart = attn(*(a.clone() for a in args), need_weights=False)[0]
                    self.assertTrue(torch.equal(out, apart))

    def test_a_compiled_module_under_autocast_equals_the_uncompiled_one(self):
        # The module's operator runs the module under the autocast state it was traced in (and its
        # backward recomputes in it, though the backward pass runs outside the region), so a model
        # compiled into one graph under autocast equals the uncompiled one: bit for bit in the output
        # (bfloat16 from float32 inputs; float64, which autocast leaves alone, stays float64) and in
        # the gradients of both modules' parameters, which the operator computes. The gradients
        # before the modules (the input's, the linear layer's) sum the attention's and the
        # residual's bfloat16 gradients in another order: within 2^-6 of their largest entry there
        # (1e-12 in float64). Self-attention with masks and cross-attention with kdim and vdim,
        # both paths; inductor once.
        cases = [(variant, memory_efficient, torch.float32) for variant in ("softmax", "dnas", "hnas", "sinkhorn-3")
                 for memory_efficient in (False, True)] + [("dnas", True, D)]
        for variant, memory_efficient, dtype in cases:
            backend = "inductor" if (variant, memory_efficient) == ("dnas", False) else "aot_eager"
            with self.subTest(f"{variant} memory_efficient={memory_efficient} {dtype} {backend}"):
                torch.manual_seed(0)
                model = Compile.model(variant, memory_efficient, batch_first=True, dtype=dtype)
                inputs = Compile.inputs(batch_first=True, dtype=dtype)
                torch._dynamo.reset()
                compiled = torch.compile(model, fullgraph=True, backend=backend)
                with torch.autocast("cpu", torch.bfloat16):
                    eager, traced = model(*inputs), compiled(*inputs)
                    self.assertEqual(torch._dynamo.explain(model)(*inputs).graph_break_count, 0)
                self.assertEqual((eager.dtype, traced.dtype), (torch.bfloat16 if dtype == torch.float32 else dtype,) * 2)
                self.assertTrue(torch.equal(eager, traced))
                names = ["x"] + [name for name, _ in model.named_parameters()]
                wrt = [inputs[0]] + list(model.parameters())
                g = torch.randn(eager.shape, dtype=eager.dtype)
                for name, a, r in zip(names, torch.autograd.grad(traced, wrt, g), torch.autograd.grad(eager, wrt, g)):
                    self.assertEqual(a.dtype, dtype)
                    if name.startswith(("attn.", "cross.")):
                        self.assertTrue(torch.equal(a, r), name)
                    else:
                        atol = 1e-12 if dtype == D else 2 ** -6 * r.abs().max().item()
                        torch.testing.assert_close(a, r, rtol=0, atol=atol, msg=name)

    def test_the_module_operator_passes_opcheck_under_autocast(self):
        from probattn import _ops

        torch.manual_seed(0)
        attn = probattn.nn.MultiheadAttention(8, 2, variant="dnas", batch_first=True, kdim=6, vdim=6)
        q = torch.randn(2, 3, 8, requires_grad=True)
        kv = torch.randn(2, 4, 6, requires_grad=True)
        params = [p.detach().requires_grad_() for p in attn.parameters()]
        config = attn._op_config[(False, "bfloat16")]
        self.assertEqual(_ops.multi_head_attention(q, kv, None, params, config, None, None, False, None, None)[0].dtype,
                         torch.bfloat16)
        torch.library.opcheck(_ops.multi_head_attention, (q, kv, None, params, config, None, None, False, None, None))


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


class Compile(unittest.TestCase):
    @staticmethod
    def model(variant, memory_efficient, batch_first, dtype=D, **options):
        tile = {"memory_efficient": True, "tile": 2, **options} if memory_efficient else options

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(16, 16, dtype=dtype)
                self.attn = probattn.nn.MultiheadAttention(16, 4, variant=variant, batch_first=batch_first, dtype=dtype,
                                                           **tile)
                self.cross = probattn.nn.MultiheadAttention(16, 4, variant=variant, batch_first=batch_first, dtype=dtype,
                                                            kdim=8, vdim=6, **tile)

            def forward(self, x, memory, values, padding, mask):
                h = torch.relu(self.lin(x))
                h = h + self.attn(h, h, h, need_weights=False, key_padding_mask=padding, attn_mask=mask)[0]
                return self.cross(h, memory, values, need_weights=False)[0].sum(-1)

        return Model()

    @staticmethod
    def inputs(batch_first, dtype=D):
        """The model's inputs: x (a gradient's input), the memory's keys and values, a key padding
        mask with two padded keys in the second sequence, and an attention mask excluding one pair."""
        g = torch.Generator().manual_seed(1)
        shape = (lambda n, l, e: (n, l, e)) if batch_first else (lambda n, l, e: (l, n, e))
        x = torch.randn(shape(2, 5, 16), generator=g, dtype=dtype, requires_grad=True)
        memory = torch.randn(shape(2, 7, 8), generator=g, dtype=dtype)
        values = torch.randn(shape(2, 7, 6), generator=g, dtype=dtype)
        padding = torch.zeros(2, 5, dtype=torch.bool)
        padding[1, -2:] = True
        mask = torch.zeros(5, 5, dtype=torch.bool)
        mask[0, 3] = True
        return x, memory, values, padding, mask

    def test_a_model_with_the_module_compiles_into_one_graph(self):
        # Each traceable variant, on both paths, in self-attention with masks and in cross-attention
        # with kdim and vdim; in float64 against the uncompiled model, the output and the gradients in
        # the input and every parameter, through Dynamo and AOTAutograd ("aot_eager"; inductor once).
        for variant in ("softmax", "dnas", "hnas", "sinkhorn-3"):
            for memory_efficient in (False, True):
                batch_first = memory_efficient
                backend = "inductor" if (variant, memory_efficient) == ("dnas", False) else "aot_eager"
                with self.subTest(f"{variant} memory_efficient={memory_efficient} {backend}"):
                    torch.manual_seed(0)
                    model = self.model(variant, memory_efficient, batch_first)
                    inputs = self.inputs(batch_first)
                    x = inputs[0]
                    eager = model(*inputs)
                    torch._dynamo.reset()
                    compiled = torch.compile(model, fullgraph=True, backend=backend)(*inputs)
                    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-12)
                    wrt = [x] + list(model.parameters())
                    for a, r in zip(torch.autograd.grad(compiled.sum(), wrt), torch.autograd.grad(eager.sum(), wrt)):
                        torch.testing.assert_close(a, r, rtol=0, atol=1e-12)
                    self.assertEqual(torch._dynamo.explain(model)(*inputs).graph_break_count, 0)

    def test_bam_in_evaluation_compiles_into_one_graph(self):
        # A BAM module in evaluation draws nothing (its mean: the base variant, here softmax and
        # DNAS): the module's operator takes it. Output and gradients (zeros where the uncompiled
        # call has none: the prior's parameters, unused without draws) to 1e-12 in float64, with
        # no graph break.
        for variant, base in (("bam-wc", "softmax"), ("bam-lf", "dnas")):
            for memory_efficient in (False, True):
                with self.subTest(f"{variant} base {base} memory_efficient={memory_efficient}"):
                    torch.manual_seed(0)
                    model = self.model(variant, memory_efficient, batch_first=True, bam={"base": base}).eval()
                    inputs = self.inputs(batch_first=True)
                    eager = model(*inputs)
                    torch._dynamo.reset()
                    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(*inputs)
                    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-12)
                    wrt = [inputs[0]] + list(model.parameters())
                    grads = [torch.autograd.grad(r.sum(), wrt, allow_unused=True) for r in (compiled, eager)]
                    for t, a, r in zip(wrt, *grads):
                        zero = torch.zeros_like(t)
                        torch.testing.assert_close(a if a is not None else zero, r if r is not None else zero, rtol=0, atol=1e-12)
                    self.assertEqual(torch._dynamo.explain(model)(*inputs).graph_break_count, 0)

    def test_bam_in_training_compiles_into_one_graph_with_a_seed_or_a_draw(self):
        # A BAM module in training, its draws from a seed (memory-efficient path) or given: the
        # module's operator returns the KL term beside the output and its backward recomputes from
        # the same draws. A loss of the output and the KL, compiled with fullgraph, equals the
        # uncompiled one, the KL and the gradients in the input and every parameter (the contextual
        # prior's included) to 1e-12 in float64, with no graph break.
        x = torch.randn(2, 5, 16, dtype=D, generator=torch.Generator().manual_seed(1), requires_grad=True)
        padding = self.inputs(batch_first=True)[3]
        for variant, memory_efficient, options in (("bam-wc", True, {"seed": 5}), ("bam-lf", False, {"noise": True}),
                                                   ("bam-wf", True, {"noise": True}), ("bam-lc", True, {"seed": 6})):
            with self.subTest(f"{variant} memory_efficient={memory_efficient} {sorted(options)}"):
                torch.manual_seed(0)
                tile = {"memory_efficient": True, "tile": 2} if memory_efficient else {}
                attn = probattn.nn.MultiheadAttention(16, 4, variant=variant, batch_first=True, dtype=D, **tile).train()
                if options.get("noise"):
                    options = {"noise": bam_noise(variant, (2, 4, 5, 5))}

                def f(x):
                    out = attn(torch.relu(x), x, x, need_weights=False, key_padding_mask=padding, **options)[0]
                    return torch.tanh(out).sum() + 0.1 * attn.kl, attn.kl

                torch._dynamo.reset()
                (compiled, kl_compiled), (eager, kl_eager) = torch.compile(f, fullgraph=True, backend="aot_eager")(x), f(x)
                torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-12)
                torch.testing.assert_close(kl_compiled, kl_eager, rtol=0, atol=1e-12)
                wrt = [x] + list(attn.parameters())
                for a, r in zip(torch.autograd.grad(compiled, wrt), torch.autograd.grad(eager, wrt)):
                    torch.testing.assert_close(a, r, rtol=0, atol=1e-12)
                self.assertEqual(torch._dynamo.explain(f)(x).graph_break_count, 0)

    def test_a_seed_makes_the_modules_draws_repeat(self):
        torch.manual_seed(0)
        attn = probattn.nn.MultiheadAttention(16, 4, variant="bam-wf", batch_first=True, memory_efficient=True, tile=2)
        x = torch.randn(2, 5, 16)
        first, again, other = (attn(x, x, x, need_weights=False, seed=s)[0] for s in (3, 3, 4))
        self.assertTrue(torch.equal(first, again))
        self.assertFalse(torch.equal(first, other))

    def test_a_module_call_the_operator_cannot_take_breaks_the_graph_and_still_runs(self):
        # Weights asked for: the call runs uncompiled, the code around it compiled (Dynamo counts two
        # breaks for a call that returns weights). BAM drawing from libtorch's generator (training
        # without a seed or a draw) cannot be replayed: it runs, and fullgraph refuses it.
        torch.manual_seed(0)
        attn = probattn.nn.MultiheadAttention(16, 4, variant="dnas", batch_first=True, dtype=D).eval()
        x = torch.randn(2, 5, 16, dtype=D)

        def f(x):
            return attn(torch.relu(x), x, x, need_weights=True)[0].sum(-1)

        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(f, backend="aot_eager")(x), f(x), rtol=0, atol=1e-12)
        self.assertGreater(torch._dynamo.explain(f)(x).graph_break_count, 0)
        sampling = probattn.nn.MultiheadAttention(16, 4, variant="bam-wf", batch_first=True, dtype=D).train()

        def g(x):
            return sampling(x, x, x, need_weights=False)[0].sum()

        torch._dynamo.reset()
        self.assertTrue(torch.compile(g, backend="aot_eager")(x).isfinite())
        torch._dynamo.reset()
        with self.assertRaises(torch._dynamo.exc.Unsupported):
            torch.compile(g, fullgraph=True, backend="aot_eager")(x)

    def test_the_module_operator_passes_opcheck(self):
        from probattn import _ops

        torch.manual_seed(0)
        attn = probattn.nn.MultiheadAttention(8, 2, variant="hnas", batch_first=True, dtype=D, kdim=6, vdim=6)
        q = torch.randn(2, 3, 8, dtype=D, requires_grad=True)
        kv = torch.randn(2, 4, 6, dtype=D, requires_grad=True)
        padding = torch.tensor([[False, False, False, True], [False] * 4])
        params = [p.detach().requires_grad_() for p in attn.parameters()]
        torch.library.opcheck(_ops.multi_head_attention,
                              (q, kv, None, params, attn._op_config[(False, None)], padding, None, False, None, None))
        # BAM in training with seeded draws: the KL is the second output, with its own gradient.
        torch.manual_seed(0)
        bam = probattn.nn.MultiheadAttention(8, 2, variant="bam-wc", batch_first=True, dtype=D, memory_efficient=True, tile=2)
        params = [p.detach().requires_grad_() for p in bam.parameters()]
        args = (q, None, None, params, bam._op_config[(False, None)], None, None, True, None, 7)
        self.assertEqual(_ops.multi_head_attention(*args)[1].shape, ())
        torch.library.opcheck(_ops.multi_head_attention, args)


@unittest.skipUnless(importlib.util.find_spec("transformers"), "transformers is not installed")
class HuggingFace(unittest.TestCase):
    """Every registered implementation in tiny Llama and BERT models built from configs (no download)."""

    @classmethod
    def setUpClass(cls):
        import probattn.hf
        from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM

        cls.names = probattn.hf.register()
        cls.llama = staticmethod(lambda: LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)))
        cls.bert = staticmethod(lambda: BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                      num_attention_heads=4, max_position_embeddings=32, attention_probs_dropout_prob=0.0)))
        cls.ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(0))
        cls.mask = torch.ones(2, 10, dtype=torch.long)
        cls.mask[1, :3] = 0

    def model(self, kind, impl, train=True):
        torch.manual_seed(0)
        m = self.llama() if kind == "llama" else self.bert()
        m.set_attn_implementation(impl)
        return m.train(train)

    def loss(self, m):
        return m(input_ids=self.ids, attention_mask=self.mask, labels=self.ids).loss

    def train(self, m, with_kl):
        """Eight Adam steps; `with_kl`: each of the two attention modules leaves BAM's KL, added to
        the loss. Returns the losses."""
        opt = torch.optim.Adam(m.parameters(), lr=3e-3)
        losses = []
        for _ in range(8):
            loss = self.loss(m)
            if with_kl:
                kl = [mod.probattn_kl for mod in m.modules() if getattr(mod, "probattn_kl", None) is not None]
                self.assertEqual(len(kl), 2)
                loss = loss + 0.01 * sum(kl)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    def test_softmax_equals_sdpa(self):
        # The tiny Llama has 2 key/value heads for 4 query heads: they reach the library grouped.
        for kind in ("llama", "bert"):
            for impl in ("probattn", "probattn-softmax", "probattn-softmax-me"):
                with self.subTest(f"{kind} {impl}"):
                    ours, theirs = self.model(kind, impl, False), self.model(kind, "sdpa", False)
                    a, b = self.loss(ours), self.loss(theirs)
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
                    a.backward()
                    b.backward()
                    for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
                        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")

    def test_memory_efficient_forms_equal_the_eager_ones(self):
        for impl in ("probattn-dnas", "probattn-sinkhorn-3", "probattn-bam-wf"):
            with self.subTest(impl):
                a, b = self.loss(self.model("bert", impl, False)), self.loss(self.model("bert", impl + "-me", False))
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)

    def test_the_config_chooses_the_variant(self):
        # "probattn" reads config.probattn at every call: dnas from the config equals its alias, a
        # change of the config applies at the next call, and a bad config is named.
        m = self.model("bert", "probattn", False)
        m.config.probattn = {"variant": "dnas", "memory_efficient": True, "tile": 3}
        torch.testing.assert_close(self.loss(m), self.loss(self.model("bert", "probattn-dnas", False)), rtol=0, atol=1e-5)
        m.config.probattn = {"variant": "softmax"}
        torch.testing.assert_close(self.loss(m), self.loss(self.model("bert", "sdpa", False)), rtol=0, atol=1e-5)
        for bad, message in (({"variant": "dnaz"}, "unknown variant 'dnaz'"), ({"varient": "dnas"}, "unknown settings"),
                             ("dnas", "must be a dict")):
            m.config.probattn = bad
            with self.assertRaisesRegex((ValueError, TypeError), message):
                self.loss(m)

    def test_bam_wc_from_the_config_trains_a_grouped_query_llama(self):
        m = self.model("llama", "probattn")
        m.config.probattn = {"variant": "bam-wc", "bam": {"k": 20.0}}
        self.assertEqual(len(probattn.hf.prepare(m)), 2)
        losses = self.train(m, with_kl=True)
        self.assertLess(losses[-1], losses[0], losses)

    def test_a_position_bias_is_an_additive_mask(self):
        # transformers' own SDPA function is the oracle: a T5-style bias (B, H, L, S) with the
        # boolean padding mask, with and without the causal pattern, grouped heads.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        g = torch.Generator().manual_seed(3)
        q, k, v = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
        bias = torch.randn(2, 4, 5, 5, generator=g, requires_grad=True)
        mask = torch.ones(2, 1, 5, 5, dtype=torch.bool)
        mask[1, ..., :2] = False
        for causal, m in ((False, mask), (True, None)):
            with self.subTest(causal=causal):
                module = torch.nn.Module()
                module.num_key_value_groups, module.is_causal = 2, causal
                module.eval()
                ours = probattn.hf._forward()(module, q, k, v, m, scaling=0.3, position_bias=bias)[0]
                theirs = sdpa_attention_forward(module, q, k, v, m, scaling=0.3, position_bias=bias)[0]
                torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
                (a,), (b,) = (torch.autograd.grad(o.sum(), [bias]) for o in (ours, theirs))
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    def test_every_implementation_trains(self):
        for name in self.names:
            if name == "probattn":
                continue  # the config's variant: softmax here, the aliases cover each variant
            variant = name.removeprefix("probattn-").removesuffix("-me")
            kinds = ["bert"] + (["llama"] if variant.startswith(("softmax", "bam")) else [])
            for kind in kinds:
                with self.subTest(f"{kind} {name}"):
                    m = self.model(kind, name)
                    if registry.entry(variant)["parameters"]:
                        self.assertEqual(len(probattn.hf.prepare(m, variant)), 2)
                    losses = self.train(m, with_kl=variant in ("bam-wf", "bam-lf", "bam-wc", "bam-lc"))
                    self.assertLess(losses[-1], losses[0], losses)
                    for n, p in m.named_parameters():
                        if ".probattn." in n:
                            self.assertIsNotNone(p.grad, n)

    def test_parameters_are_asked_for_by_name(self):
        with self.assertRaisesRegex(ValueError, r"call probattn.hf.prepare\(model, 'hnas'\)"):
            self.loss(self.model("bert", "probattn-hnas"))
        with self.assertRaisesRegex(ValueError, "no parameters of its own"):
            probattn.hf.prepare(self.model("bert", "probattn-dnas"), "dnas")
        with self.assertRaisesRegex(ValueError, "no parameters of its own"):
            probattn.hf.prepare(self.model("bert", "probattn"))  # the config's variant: softmax

    def test_a_causal_model_refuses_a_variant_that_would_see_the_future(self):
        for impl in ("probattn-dnas", "probattn-sinkhorn-3-me"):
            with self.assertRaisesRegex(ValueError, "causal model"):
                self.loss(self.model("llama", impl))
        with self.assertRaisesRegex(ValueError, "no attention dropout"):
            m = self.model("llama", "probattn-softmax-me")
            m.config.attention_dropout = 0.1
            for layer in m.model.layers:
                layer.self_attn.attention_dropout = 0.1
            self.loss(m)


@unittest.skipUnless(torch.cuda.is_available(), "no CUDA device")
class Cuda(unittest.TestCase):
    """The package on a GPU: gradcheck in float64 on CUDA tensors, a tiny Llama on CUDA whose
    probattn-softmax step equals sdpa's and whose BAM-WC training lowers the loss, and the compiled
    forms' operators on CUDA."""

    def test_gradcheck_on_cuda(self):
        gradcheck_every_variant(self, "cuda", layouts_used=2)

    def test_a_tiny_llama_on_cuda(self):
        try:
            import probattn.hf
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError as e:
            self.skipTest(f"transformers is not installed: {e}")
        probattn.hf.register()
        ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(0)).cuda()
        mask = torch.ones(2, 10, dtype=torch.long, device="cuda")
        mask[1, :3] = 0

        def model(impl, train):
            torch.manual_seed(0)
            config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=32)
            m = LlamaForCausalLM(config).cuda()
            m.set_attn_implementation(impl)
            return m.train(train)

        ours, theirs = model("probattn-softmax", False), model("sdpa", False)
        a = ours(input_ids=ids, attention_mask=mask, labels=ids).loss
        b = theirs(input_ids=ids, attention_mask=mask, labels=ids).loss
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        a.backward()
        b.backward()
        for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
        m = model("probattn-bam-wc", True)
        probattn.hf.prepare(m, "bam-wc")
        m.cuda()
        opt = torch.optim.Adam(m.parameters(), lr=3e-3)
        losses = []
        for _ in range(8):
            loss = m(input_ids=ids, attention_mask=mask, labels=ids).loss
            loss = loss + 0.01 * sum(mod.probattn_kl for mod in m.modules() if getattr(mod, "probattn_kl", None) is not None)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        self.assertLess(losses[-1], losses[0], losses)


    def test_compiled_bam_and_module_under_autocast_on_cuda(self):
        # The operators on CUDA tensors: BAM's seeded draws replayed by its backward (float64, to
        # 1e-12), and a model of the module compiled under CUDA autocast, bit for bit in the output
        # and in the module's. CUDA autocast sums in float32 (its float32 list has `sum`, the CPU's
        # has not), so the model's output is float32 there; the module's output is bfloat16.
        f, inputs = CompileWithoutGraphBreaks.bam_case("bam-wc", "seed", True, device="cuda")
        torch._dynamo.reset()
        compiled, eager = torch.compile(f, fullgraph=True, backend="aot_eager")(*inputs), f(*inputs)
        for a, r in zip(compiled, eager):
            torch.testing.assert_close(a, r, rtol=0, atol=1e-12)
        for a, r in zip(torch.autograd.grad(compiled[0].sum() + compiled[2], inputs),
                        torch.autograd.grad(eager[0].sum() + eager[2], inputs)):
            torch.testing.assert_close(a, r, rtol=0, atol=1e-12)
        torch.manual_seed(0)
        model = Compile.model("dnas", True, batch_first=True, dtype=torch.float32).cuda()
        inputs = [t.cuda() for t in Compile.inputs(batch_first=True, dtype=torch.float32)]
        torch._dynamo.reset()
        with torch.autocast("cuda", torch.bfloat16):
            eager, traced = model(*inputs), torch.compile(model, fullgraph=True, backend="aot_eager")(*inputs)
            h = torch.relu(model.lin(inputs[0]))
            attended = [f(h, inputs[1], inputs[2], need_weights=False)[0]
                        for f in (model.cross, torch.compile(model.cross, fullgraph=True, backend="aot_eager"))]
        self.assertEqual((eager.dtype, traced.dtype), (torch.float32, torch.float32))
        self.assertTrue(torch.equal(eager, traced))
        self.assertEqual([a.dtype for a in attended], [torch.bfloat16, torch.bfloat16])
        self.assertTrue(torch.equal(*attended))


class CompileWithoutGraphBreaks(unittest.TestCase):
    def test_attention_compiles_into_one_graph_on_both_paths(self):
        # Every traceable variant on the eager and the memory-efficient path, under every mask layout
        # its path allows, through Dynamo and AOTAutograd (the "aot_eager" backend: the custom
        # operators, their fake forms and backward, as inductor receives them); inductor's own
        # code generation once per path.
        b, h, sq, sk = 2, 3, 5, 6
        logit = torch.randn(h, dtype=D, generator=torch.Generator().manual_seed(7)).requires_grad_()
        for memory_efficient in (False, True):
            for variant in ("softmax", "dnas", "hnas", "sinkhorn-3"):
                for layout, masks in layouts(b, h, sq, sk):
                    if masks.get("is_causal") and not causal_safe(variant):
                        continue
                    backend = "inductor" if (variant, layout) == ("hnas", "attn_mask_4d") else "aot_eager"
                    with self.subTest(f"memory_efficient={memory_efficient} {variant} {layout} {backend}"):
                        q, k, v = qkv(b, h, sq, sk)
                        inputs = (q, k, v, logit) if variant == "hnas" else (q, k, v)
                        path = {"memory_efficient": True, "tile": 2} if memory_efficient else {}

                        def f(q, k, v, *gate):
                            extra = {"hybrid_logit": gate[0]} if gate else {}
                            return torch.tanh(probattn.attention(q * 1.5, k, v, variant=variant, **path, **sdpa(masks),
                                                                 **extra)).sum()

                        torch._dynamo.reset()
                        compiled = torch.compile(f, fullgraph=True, backend=backend)(*inputs)
                        eager = f(*inputs)
                        torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-12)
                        for a, r in zip(torch.autograd.grad(compiled, inputs), torch.autograd.grad(eager, inputs)):
                            torch.testing.assert_close(a, r, rtol=0, atol=1e-12)
                        self.assertEqual(torch._dynamo.explain(f)(*inputs).graph_break_count, 0)

    def test_the_operator_passes_opcheck_and_gradcheck(self):
        from probattn import _ops

        q, k, v = qkv()
        logit = torch.randn(3, dtype=D, generator=torch.Generator().manual_seed(7)).requires_grad_()
        for tile in (None, 2):
            for variant, gate in (("dnas", None), ("hnas", logit)):
                with self.subTest(f"tile={tile} {variant}"):
                    args = (q, k, v, variant, tile, None, None, False, gate, None, None, False)
                    torch.library.opcheck(_ops.attention, args)

                    def call(*ts):
                        return _ops.attention(*ts[:3], variant, tile, None, None, False, ts[3] if gate is not None else None,
                                              None, None, False)

                    self.assertTrue(gradcheck(call, (q, k, v) + ((gate,) if gate is not None else ())))

    @staticmethod
    def bam_case(variant, how, memory_efficient, dtype=D, device="cpu"):
        """A BAM call's inputs and a function of them returning (output, received mass, KL):
        `how` is "seed" (training, draws from a seed), "noise" (training, a given draw) or
        "evaluation"; key padding; the contextual prior's parameters for bam-wc and bam-lc."""
        b, h, sq, sk, d = 2, 3, 5, 6, 4
        to = {"dtype": dtype, "device": device}
        q, k, v = (t.detach().to(**to).requires_grad_() for t in qkv(b, h, sq, sk, d))
        prior = {n: t.to(**to).requires_grad_() for n, t in prior_params(h, d, 4).items()}
        bam = dict(BAM_CFG, prior=prior) if variant in ("bam-wc", "bam-lc") else dict(BAM_CFG)
        padding = layouts(b, h, sq, sk)[1][1]["key_padding_mask"].to(device)
        options = {"training": how != "evaluation", "attn_mask": ~padding[:, None, None, :],
                   "memory_efficient": memory_efficient}
        if memory_efficient:
            options["tile"] = 2
        if how == "noise":
            bam["noise"] = bam_noise(variant, (b, h, sq, sk)).to(**to)
        if how == "seed":
            options["seed"] = 11

        def f(q, k, v, *prior_values):
            call = probattn.attention_with_info if memory_efficient else probattn.attention
            result = call(q, k, v, variant=variant, bam=bam, **options)
            return (result[0], result[1].received_mass, result[1].kl) if memory_efficient else (result, None, None)

        return f, (q, k, v, *(prior.values() if "prior" in bam else ()))

    def test_bam_compiles_into_one_graph_where_its_draws_replay(self):
        # BAM's draws replay in evaluation (none: its mean), with a given draw, and from a seed on the
        # memory-efficient path: its operator recomputes the same draws for the backward pass, so
        # the compiled call equals the uncompiled one in the output, the received mass and the KL
        # term (return_info, on the memory-efficient path) and in the gradients of q, k, v and the
        # contextual prior's parameters, to 1e-12 in float64, with no graph break. Inductor once.
        cases = [("seed", True), ("noise", True), ("noise", False), ("evaluation", True), ("evaluation", False)]
        for variant in BAM:
            for how, memory_efficient in cases:
                backend = "inductor" if (variant, how) == ("bam-wc", "seed") else "aot_eager"
                with self.subTest(f"{variant} {how} memory_efficient={memory_efficient} {backend}"):
                    f, inputs = self.bam_case(variant, how, memory_efficient)
                    torch._dynamo.reset()
                    compiled, eager = torch.compile(f, fullgraph=True, backend=backend)(*inputs), f(*inputs)
                    for a, r in zip(compiled, eager):
                        self.assertEqual(a is None, r is None)
                        if r is not None:
                            torch.testing.assert_close(a, r, rtol=0, atol=1e-12)
                    self.assertEqual(eager[2] is not None, memory_efficient and how != "evaluation" and variant != "bam-nokl")
                    if memory_efficient:
                        self.assertFalse(compiled[1].requires_grad)

                    def loss(out, mass, kl):
                        return torch.tanh(out).sum() + (kl if kl is not None else 0)

                    # Without the KL the prior is unused: no gradient uncompiled, zeros compiled.
                    grads = [torch.autograd.grad(loss(*result), inputs, allow_unused=True) for result in (compiled, eager)]
                    for t, a, r in zip(inputs, *grads):
                        zero = torch.zeros_like(t)
                        torch.testing.assert_close(a if a is not None else zero, r if r is not None else zero, rtol=0, atol=1e-12)
                    self.assertEqual(torch._dynamo.explain(f)(*inputs).graph_break_count, 0)

    def test_return_info_on_the_memory_efficient_path_compiles_into_one_graph(self):
        # The received mass (which the DNAS paper reads to see which keys are explained away) under
        # the compiler: the memory-efficient path forms no weights, so the statistics' operator
        # takes the call. Output, mass and gradients to 1e-12 in float64, with no graph break.
        b, h, sq, sk = 2, 3, 5, 6
        logit = torch.randn(h, dtype=D, generator=torch.Generator().manual_seed(7)).requires_grad_()
        kp = layouts(b, h, sq, sk)[1][1]["key_padding_mask"]
        for variant in ("softmax", "dnas", "hnas", "sinkhorn-3"):
            with self.subTest(variant):
                q, k, v = qkv(b, h, sq, sk)
                inputs = (q, k, v, logit) if variant == "hnas" else (q, k, v)

                def f(q, k, v, *gate):
                    extra = {"hybrid_logit": gate[0]} if gate else {}
                    out, info = probattn.attention_with_info(q, k, v, variant=variant, memory_efficient=True, tile=2,
                                                             attn_mask=~kp[:, None, None, :], **extra)
                    return out, info.received_mass, info.kl, info.weights

                torch._dynamo.reset()
                compiled, eager = torch.compile(f, fullgraph=True, backend="aot_eager")(*inputs), f(*inputs)
                self.assertEqual((compiled[2], compiled[3]), (None, None))
                for a, r in zip(compiled[:2], eager[:2]):
                    torch.testing.assert_close(a, r, rtol=0, atol=1e-12)
                for a, r in zip(torch.autograd.grad(compiled[0].sum(), inputs), torch.autograd.grad(eager[0].sum(), inputs)):
                    torch.testing.assert_close(a, r, rtol=0, atol=1e-12)
                self.assertEqual(torch._dynamo.explain(f)(*inputs).graph_break_count, 0)

    def test_bam_compiled_under_autocast_equals_the_uncompiled_call(self):
        # The operator runs the call in the autocast state it was traced in: float32 inputs give a
        # bfloat16 output and float32 mass and KL, bit for bit as uncompiled, gradients too.
        f, inputs = self.bam_case("bam-wc", "seed", True, dtype=torch.float32)
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        with torch.autocast("cpu", torch.bfloat16):
            traced, eager = compiled(*inputs), f(*inputs)
        self.assertEqual([t.dtype for t in traced], [torch.bfloat16, torch.float32, torch.float32])
        for a, r in zip(traced, eager):
            self.assertTrue(torch.equal(a, r))
        g = torch.randn(eager[0].shape, dtype=eager[0].dtype)
        for a, r in zip(torch.autograd.grad([traced[0], traced[2]], inputs, [g, torch.tensor(0.7)]),
                        torch.autograd.grad([eager[0], eager[2]], inputs, [g, torch.tensor(0.7)])):
            self.assertTrue(torch.equal(a, r))

    def test_the_bam_operator_passes_opcheck_and_gradcheck(self):
        from probattn import _ops

        q, k, v = qkv()
        prior = [t.requires_grad_() for t in prior_params(3, 4, 4).values()]
        names = tuple("prior." + n for n in ("f1.weight", "f1.bias", "f2.weight", "f2.bias"))
        settings = tuple(sorted(BAM_CFG.items()))
        for variant, tile, noise, seed in (("bam-wc", 2, None, 11), ("bam-lc", None, bam_noise("bam-lc", (2, 3, 5, 6)), None)):
            with self.subTest(f"{variant} tile={tile}"):
                config = _ops.info_config(variant, settings, None, True, names, None)
                torch.library.opcheck(_ops.attention_with_info, (q, k, v, config, tile, None, None, False, prior, noise, seed))

                def call(q, k, v, *prior):
                    out, _, kl = _ops.attention_with_info(q, k, v, config, tile, None, None, False, list(prior), noise, seed)
                    return out, kl

                self.assertTrue(gradcheck(call, (q, k, v, *prior)))
        # Traced under autocast, in float32: a bfloat16 output, float32 mass and KL, as the fake form says.
        config = _ops.info_config("bam-wc", settings, None, True, names, "bfloat16")
        args = [t.detach().float().requires_grad_() for t in (q, k, v, *prior)]
        out, mass, kl = _ops.attention_with_info(*args[:3], config, 2, None, None, False, args[3:], None, 11)
        self.assertEqual((out.dtype, mass.dtype, kl.dtype), (torch.bfloat16, torch.float32, torch.float32))
        torch.library.opcheck(_ops.attention_with_info, (*args[:3], config, 2, None, None, False, args[3:], None, 11))

    def test_a_call_the_operator_cannot_take_breaks_the_graph_and_still_runs(self):
        # The weights (return_info on the eager path) are a second output, and BAM's draws from
        # libtorch's generator (training without a seed or a given draw) cannot be replayed: those
        # calls run uncompiled.
        q, k, v = qkv()
        noise = bam_noise("bam-wf", (2, 3, 5, 6))
        for variant, options in (("dnas", {}), ("bam-wf", {"training": True, "bam": {"noise": noise}})):
            with self.subTest(variant):
                def f(q, k, v):
                    out, info = probattn.attention_with_info(q, k, v, variant=variant, **options)
                    return out.sum() + info.received_mass.sum() + (info.kl if info.kl is not None else 0)

                torch._dynamo.reset()
                torch.testing.assert_close(torch.compile(f, backend="aot_eager")(q, k, v), f(q, k, v), rtol=0, atol=1e-12)
                # One break at the extension's call, counted once in each Python frame between f
                # and it (attention_with_info, its argument conversion, the library call).
                self.assertIn(torch._dynamo.explain(f)(q, k, v).graph_break_count, (1, 2, 3))

        def sampled(q, k, v):
            return probattn.attention(q, k, v, variant="bam-wf", training=True, memory_efficient=True).sum()

        torch._dynamo.reset()
        self.assertTrue(torch.compile(sampled, backend="aot_eager")(q, k, v).isfinite())
        torch._dynamo.reset()
        with self.assertRaises(torch._dynamo.exc.Unsupported):
            torch.compile(sampled, fullgraph=True, backend="aot_eager")(q, k, v)


    def test_a_compiled_call_raises_the_uncompiled_calls_error(self):
        q, k, v = (t.detach() for t in qkv())
        for variant, extra in (("hnas", {}), ("softmax", {"hybrid_logit": torch.zeros(3, dtype=D)}), ("dnaz", {})):
            with self.subTest(variant):
                def f(q, k, v):
                    return probattn.attention(q, k, v, variant=variant, **extra)

                with self.assertRaises(ValueError) as uncompiled:
                    f(q, k, v)
                torch._dynamo.reset()
                with self.assertRaises(ValueError) as compiled:
                    torch.compile(f, backend="aot_eager")(q, k, v)
                self.assertEqual(str(compiled.exception), str(uncompiled.exception))


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
            (ValueError, "seed keys the memory-efficient path's BAM draws",
             lambda: probattn.attention(q, k, v, variant="bam-wf", training=True, seed=3)),
            (ValueError, "construct it with memory_efficient=True",
             lambda: probattn.nn.MultiheadAttention(4, 2, variant="bam-wf", batch_first=True, dtype=D)(
                 q[0], q[0], q[0], need_weights=False, seed=3)),
        ]
        for kind, message, call in cases:
            with self.subTest(message):
                with self.assertRaisesRegex(kind, message):
                    call()

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

"""The package under torch.compile and torch.autocast: one graph where the operators can take
the call, opcheck and gradcheck of the operators, and the compiled results equal to the
uncompiled ones."""

import math
import unittest

import torch
from torch.autograd import gradcheck

import probattn
from common import BAM, BAM_CFG, D, bam_noise, causal_safe, layouts, prior_params, qkv, sdpa


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


if __name__ == "__main__":
    unittest.main()

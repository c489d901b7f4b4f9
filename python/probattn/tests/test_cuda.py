"""The package on a GPU (skipped without one): gradcheck on CUDA, a tiny Llama trained through the
registered implementation, and the compiled BAM call and module under autocast."""

import unittest

import torch

from common import gradcheck_every_variant
import test_compile  # its model and inputs (a module, so that its tests are not collected twice)


@unittest.skipUnless(torch.cuda.is_available(), "no CUDA device")
class Cuda(unittest.TestCase):
    """The package on a GPU: gradcheck in float64 on CUDA tensors, a tiny Llama on CUDA whose
    probattn-softmax step equals sdpa's, whose BAM-WC training lowers the loss and whose padded
    bfloat16 batch takes the fused CUDA route, and the compiled forms' operators on CUDA."""

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
        # In bfloat16 the padded batch's causal mask reaches the library as the causal pattern and
        # key padding, which the fused CUDA route serves BAM under: both layers' calls take it.
        m = model("probattn-bam-wc-me", True)
        probattn.hf.prepare(m, "bam-wc")
        m.to(device="cuda", dtype=torch.bfloat16)
        probattn.attention_routes(reset=True)
        m(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        self.assertEqual(probattn.attention_routes(reset=True), {"fused-cuda": 2})


    def test_compiled_bam_and_module_under_autocast_on_cuda(self):
        # The operators on CUDA tensors: BAM's seeded draws replayed by its backward (float64, to
        # 1e-12), and a model of the module compiled under CUDA autocast, bit for bit in the output
        # and in the module's. CUDA autocast sums in float32 (its float32 list has `sum`, the CPU's
        # has not), so the model's output is float32 there; the module's output is bfloat16.
        f, inputs = test_compile.CompileWithoutGraphBreaks.bam_case("bam-wc", "seed", True, device="cuda")
        torch._dynamo.reset()
        compiled, eager = torch.compile(f, fullgraph=True, backend="aot_eager")(*inputs), f(*inputs)
        for a, r in zip(compiled, eager):
            torch.testing.assert_close(a, r, rtol=0, atol=1e-12)
        for a, r in zip(torch.autograd.grad(compiled[0].sum() + compiled[2], inputs),
                        torch.autograd.grad(eager[0].sum() + eager[2], inputs)):
            torch.testing.assert_close(a, r, rtol=0, atol=1e-12)
        torch.manual_seed(0)
        model = test_compile.Compile.model("dnas", True, batch_first=True, dtype=torch.float32).cuda()
        inputs = [t.cuda() for t in test_compile.Compile.inputs(batch_first=True, dtype=torch.float32)]
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


if __name__ == "__main__":
    unittest.main()

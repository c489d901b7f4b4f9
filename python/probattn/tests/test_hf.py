"""probattn in Hugging Face transformers' models: the registered implementation in tiny Llama and
BERT models built from configs (no download)."""

import importlib.util
import unittest

import torch

import probattn
from probattn_tools.reference import variants as registry


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
                a = self.loss(self.model("bert", impl, False))
                probattn.attention_routes(reset=True)
                b = self.loss(self.model("bert", impl + "-me", False))
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
                # The padded batch's mask is the padding broadcast over the queries: key padding,
                # which the fused CPU kernel serves in both layers.
                self.assertEqual(probattn.attention_routes(reset=True), {"fused-cpu": 2})

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

    def test_a_causal_mask_with_padding_is_marked_with_its_key_row(self):
        # The row the mask builder marks, with the causal pattern from the top left, is the whole
        # mask: left, right and no padding, a key axis longer than the queries' (a static cache's
        # prefill), offsets that start together. A sliding window or offsets apart are not marked.
        from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

        padding = torch.ones(3, 7, dtype=torch.bool)  # as transformers passes it to the builder
        padding[1, :3] = False
        padding[2, 5:] = False
        for kv_length, offset, given in ((7, 0, padding), (9, 0, padding), (7, 2, padding), (7, 0, None)):
            with self.subTest(kv_length=kv_length, offset=offset, padded=given is not None):
                mask = probattn.hf._sdpa_mask(batch_size=3, q_length=7, kv_length=kv_length, q_offset=offset, kv_offset=offset,
                                              mask_function=causal_mask_function, attention_mask=given, allow_is_causal_skip=False)
                keys = mask._probattn_causal_keys
                self.assertEqual(tuple(keys.shape), (3, 1, 1, kv_length))
                self.assertTrue(torch.equal(mask, torch.ones(7, kv_length, dtype=torch.bool).tril() & keys))
                if given is not None and offset == 0:
                    self.assertTrue(torch.equal(keys[:, 0, 0, :7], given))
        for function, offsets in ((sliding_window_causal_mask_function(3), (0, 0)), (causal_mask_function, (2, 0))):
            mask = probattn.hf._sdpa_mask(batch_size=3, q_length=7, kv_length=9, q_offset=offsets[0], kv_offset=offsets[1],
                                          mask_function=function, attention_mask=padding, allow_is_causal_skip=False)
            self.assertFalse(hasattr(mask, "_probattn_causal_keys"))

    def test_a_padded_causal_batch_runs_as_the_causal_pattern_and_key_padding(self):
        # A padded Llama batch reaches the library as the causal pattern and key padding (one call
        # per layer), and gives what transformers' own mask builder, a whole (L, S) pattern, gives:
        # softmax and BAM-WC sampling, eager and memory-efficient, loss and gradients.
        from unittest import mock

        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        ids = torch.randint(0, 50, (3, 10), generator=torch.Generator().manual_seed(1))
        mask = torch.ones(3, 10, dtype=torch.long)
        mask[1, :3] = 0  # left padding, as for generation
        mask[2, 6:] = 0  # right padding, as for training

        def run(impl, variant):
            m = self.model("llama", impl, train=variant.startswith("bam"))
            if registry.entry(variant)["parameters"]:
                probattn.hf.prepare(m, variant)
            torch.manual_seed(5)
            loss = m(input_ids=ids, attention_mask=mask, labels=ids).loss
            loss.backward()
            return loss, [(n, p.grad) for n, p in m.named_parameters()]

        for impl in ("probattn-softmax", "probattn-softmax-me", "probattn-bam-wc", "probattn-bam-wc-me"):
            with self.subTest(impl):
                variant = impl.removeprefix("probattn-").removesuffix("-me")
                spy = mock.patch.object(probattn.functional, "_call", wraps=probattn.functional._call)
                with spy as called:
                    folded = run(impl, variant)
                self.assertEqual([c.kwargs.get("joined") for c in called.call_args_list], [True, True])
                AttentionMaskInterface.register(impl, sdpa_mask)
                try:
                    with spy as called:
                        whole = run(impl, variant)
                finally:
                    probattn.hf.register()
                self.assertFalse(any(c.kwargs.get("joined") for c in called.call_args_list))
                torch.testing.assert_close(folded[0], whole[0], rtol=0, atol=1e-6)
                for (n, a), (_, b) in zip(folded[1], whole[1]):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")

    def test_greedy_generation_from_a_left_padded_batch_equals_sdpas(self):
        # The prompt's pass takes the causal pattern and key padding; each new token's pass, one
        # query against the cache, takes the mask as it is: the same tokens as SDPA's.
        from transformers import LlamaConfig, LlamaForCausalLM

        ids = torch.randint(3, 50, (3, 10), generator=torch.Generator().manual_seed(1))
        mask = torch.ones(3, 10, dtype=torch.long)
        mask[1, :3] = 0
        mask[2, :6] = 0
        tokens = {}
        for impl in ("sdpa", "probattn-softmax", "probattn-softmax-me"):
            torch.manual_seed(0)
            m = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                             pad_token_id=0, bos_token_id=1, eos_token_id=2))
            m.set_attn_implementation(impl)
            with torch.no_grad():
                tokens[impl] = m.eval().generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        for impl in ("probattn-softmax", "probattn-softmax-me"):
            self.assertTrue(torch.equal(tokens[impl], tokens["sdpa"]), f"{impl}: {tokens[impl]} against {tokens['sdpa']}")

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


if __name__ == "__main__":
    unittest.main()

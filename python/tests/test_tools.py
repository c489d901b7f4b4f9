"""The Python package's own checks (`python -m unittest discover -s python/tests`, run by
`cargo test` through experiments/tests/cli.rs): every module imports, the table helpers compute
what their docstrings say, results are written atomically, and the reference formulas keep their
defining properties."""

import contextlib
import importlib
import importlib.util
import io
import os
import pkgutil
import unittest

import torch

import probattn_tools
from probattn_tools import files
from probattn_tools.reference import formulas, variants
from probattn_tools.tables import common


def runs_on_import(module):
    """The diagnostics' one-off probes run at import (they have no main guard); the rest do not."""
    spec = importlib.util.find_spec(module)
    with open(spec.origin) as f:
        source = f.read()
    return module.startswith("probattn_tools.diagnostics.") and "__main__" not in source


class EveryModuleImports(unittest.TestCase):
    def test_walk(self):
        names = [m.name for m in pkgutil.walk_packages(probattn_tools.__path__, "probattn_tools.")]
        self.assertGreaterEqual(len(names), 35)
        names = [n for n in names if not runs_on_import(n)]
        self.assertGreaterEqual(len(names), 30)
        for name in names:
            with self.subTest(module=name):
                importlib.import_module(name)


class TableHelpers(unittest.TestCase):
    def test_mean_std(self):
        self.assertEqual(common.mean_std([1.0, 2.0, 3.0]), (2.0, 1.0))
        self.assertEqual(common.mean_std([4.0]), (4.0, 0.0))

    def test_cells(self):
        self.assertEqual(common.cell([1.0, 2.0, 3.0]), "2.00 ± 1.00 (n=3)")
        self.assertEqual(common.cell([4.0]), "4.00 (n=1)")
        # se = sqrt(1/3 + 4/3) = 1.29
        self.assertEqual(common.diff_cell([1.0, 2.0, 3.0], [0.0, 2.0, 4.0]), "+0.00 ± 1.29 (n=3 vs 3)")
        self.assertEqual(common.diff_cell([1.0], [2.0, 3.0]), "–")

    def test_paired(self):
        a, b = {1: 3.0, 2: 5.0, 3: 4.0, 9: 0.0}, {1: 1.0, 2: 4.0, 3: 4.0}
        # differences 2, 1, 0 on the three shared seeds: mean 1, se 1/sqrt(3)
        self.assertEqual(common.paired_cell(a, b), "+1.00 ± 0.58 (above on 2 of 3 seeds)")
        self.assertEqual(common.paired_cell({1: 1.0}, {1: 2.0}), "–")

    def test_translation_rows(self):
        from probattn_tools.tables import translate

        def run(precision=None, **config):
            config = {"model": {"transformer": {}}, "kl_weight": 1, **config}
            if precision:
                config["precision"] = precision
            return {"attention": "dnas", "repulsive": "none", "config": config}
        self.assertEqual(translate.row_name(run()), "dnas")
        self.assertEqual(translate.row_name(run("f32")), "dnas")
        self.assertEqual(translate.row_name(run("bf16")), "dnas-bf16")
        # A float32 run from before --precision pools with one that names it; bfloat16 does not.
        self.assertEqual(translate.pooled_config(run()), translate.pooled_config(run("f32")))
        self.assertNotEqual(translate.pooled_config(run()), translate.pooled_config(run("bf16")))
        # Where the data lay is no part of the configuration; anything else is.
        self.assertEqual(translate.pooled_config(run(data_dir="a")), translate.pooled_config(run(data_dir="b")))
        self.assertNotEqual(translate.pooled_config(run(bpe_vocab=8000)), translate.pooled_config(run(bpe_vocab=10000)))

    def test_translation_flags(self):
        from probattn_tools.tables import translate
        args = translate.parse(["a", "b", "--paper"])
        self.assertEqual((args.roots, args.diff, args.paper), (["a", "b"], False, True))
        self.assertEqual(translate.parse([]).roots, ["results/translate"])
        with contextlib.redirect_stderr(io.StringIO()) as err, self.assertRaises(SystemExit):
            translate.parse(["results", "--typo"])
        self.assertIn("unrecognized arguments: --typo", err.getvalue())

    def test_paper_differences(self):
        from probattn_tools.tables import translate
        self.assertAlmostEqual(translate.paper_difference("lstm-bam-wc")[0], 1.04)
        self.assertAlmostEqual(translate.paper_difference("lstm-bam-wc-w0.1-anneal1000")[0], 1.04)
        self.assertAlmostEqual(translate.paper_difference("softmax-svgd")[0], 0.8)
        self.assertAlmostEqual(translate.paper_difference("softmax-svgd-cross")[0], 0.5)
        self.assertAlmostEqual(translate.paper_difference("softmax-svgd-bf16")[0], 0.8)
        # The BAM paper ran no Transformer, and the DNAS paper no translation.
        for name in ("bam-wc", "bam-wc-w0.1-anneal1000", "dnas", "hnas", "lstm-softmax", "lstm-dnas"):
            self.assertIsNone(translate.paper_difference(name), name)
        self.assertEqual(translate.reference("lstm-dnas"), "lstm-softmax")

    def test_row_order(self):
        from probattn_tools.tables import translate
        names = ["softmax-bf16", "lstm-dnas", "dnas-bf16", "dnas", "softmax", "lstm-softmax", "lstm-bam-wc-w0.1"]
        self.assertEqual(translate.ordered(names), ["softmax", "dnas", "lstm-softmax", "lstm-bam-wc-w0.1", "lstm-dnas",
                                                    "dnas-bf16", "softmax-bf16"])

    def test_precision_row(self):
        from probattn_tools.tables import translate

        def runs(*bleus):
            return [{"test_bleu_tok": b, "seed": s} for s, b in enumerate(bleus, start=1)]
        row = translate.precision_row("dnas-bf16", runs(38.0, 38.4), runs(37.9, 38.1, 38.5))
        self.assertEqual(row[0], "dnas-bf16 − dnas")
        # paired over seeds 1 and 2 only: +0.1 and +0.3, mean +0.2, s.e. stdev/sqrt(2) = 0.1
        self.assertEqual(row[2], "+0.20 ± 0.10 (above on 2 of 2 seeds)")
        self.assertEqual(row[4], "37.90 – 38.50 (n=3)")
        self.assertEqual(row[5], "yes")
        self.assertEqual(translate.precision_row("softmax-bf16", runs(38.45), runs(37.63, 37.94, 38.06))[5], "above")
        self.assertEqual(translate.precision_row("softmax-bf16", runs(37.0), runs(37.63, 38.06))[1], "–")
        self.assertEqual(translate.precision_row("softmax-bf16", runs(37.0), runs(37.63, 38.06))[2], "–")
        self.assertEqual(translate.precision_row("softmax-bf16", runs(37.0), runs(37.63, 38.06))[5], "below")

    def test_fisher_exact(self):
        # By hand: 3 events in 20 trials split 3/10 against 0/10; each split's probability is
        # C(10, x) C(10, 3 - x) / C(20, 3) = 120, 450, 450, 120 over 1140, and the two-sided p sums
        # the splits no likelier than 3/0: 240 / 1140.
        self.assertAlmostEqual(common.fisher_exact(3, 10, 0, 10), 240 / 1140, places=12)
        self.assertAlmostEqual(common.fisher_exact(0, 10, 3, 10), 240 / 1140, places=12)
        # Fisher's tea-tasting table, 3/4 against 1/4: (1 + 16 + 16 + 1) / 70.
        self.assertAlmostEqual(common.fisher_exact(3, 4, 1, 4), 34 / 70, places=12)
        self.assertAlmostEqual(common.fisher_exact(1, 10, 1, 10), 1.0, places=12)
        self.assertAlmostEqual(common.fisher_exact(0, 3, 0, 7), 1.0, places=12)
        with self.assertRaises(ValueError):
            common.fisher_exact(4, 3, 0, 3)

    def test_stall_row(self):
        from probattn_tools.tables import translate

        def runs(*valid):
            return [{"seed": s, "valid_bleu": v, "test_bleu_tok": v + 0.5} for s, v in enumerate(valid, start=1)]
        soft = runs(40.0, 39.0, 22.1, 25.0)
        bam = runs(40.0, 41.0, 39.0, 40.0)
        row = translate.stall_row("lstm-bam-wc-w0.1", bam, soft, 30)
        self.assertEqual(row[:4], ["lstm-bam-wc-w0.1", "0 of 4", "–", "40.50 ± 0.82 (n=4)"])
        # 0/4 against 2/4: C(4, x) C(4, 2 - x) / C(8, 2) = 6, 16, 6 over 28, so p = 12 / 28 = 3/7.
        self.assertEqual(row[4], f"{3 / 7:.3f} (0/4 vs 2/4)")
        row = translate.stall_row("lstm-softmax", soft, soft, 30)
        self.assertEqual(row[1:], ["2 of 4", "3 (22.10), 4 (25.00)", "40.00 ± 0.71 (n=2)", "–"])
        self.assertEqual(translate.stall_row("lstm-dnas", runs(10.0), None, 30)[1:], ["1 of 1", "1 (10.00)", "–", "–"])
        self.assertEqual(translate.parse(["a", "--stalled", "30"]).stalled, 30.0)
        self.assertIsNone(translate.parse(["a"]).stalled)

    def test_markdown(self):
        self.assertEqual(common.markdown(["a", "b"], [[1, "x"]]), "| a | b |\n|---|---|\n| 1 | x |")


class AtomicFiles(unittest.TestCase):
    def setUp(self):
        import tempfile
        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "results.json")

    def tearDown(self):
        self.dir.cleanup()

    def test_writes_and_leaves_no_partial_file(self):
        files.atomic_write_json(self.path, {"bleu": 38.45})
        with open(self.path) as f:
            self.assertEqual(f.read(), '{\n "bleu": 38.45\n}\n')
        self.assertEqual(os.listdir(self.dir.name), ["results.json"])

    def test_a_failed_write_keeps_the_previous_file(self):
        files.atomic_write_json(self.path, {"bleu": 38.45})
        with self.assertRaises(TypeError):
            files.atomic_write_json(self.path, {"bleu": object()})
        with self.assertRaises(TypeError):
            files.atomic_write_text(self.path, b"bytes, not text")
        with open(self.path) as f:
            self.assertEqual(f.read(), '{\n "bleu": 38.45\n}\n')
        self.assertEqual(os.listdir(self.dir.name), ["results.json"])


class NcclPairs(unittest.TestCase):
    def write(self, root, name, tokens, recorded, backend=None):
        os.makedirs(os.path.join(root, name))
        results = {"tokens_per_second_mean": tokens, "provenance": {"unix_time": recorded}}
        if backend:
            results["distributed"] = {"world_size": 1, "backend": backend}
        files.atomic_write_json(os.path.join(root, name, "results.json"), results)

    def test_alternating_orders_cancel_a_steady_drift(self):
        import tempfile
        from probattn_tools.tables import nccl
        with tempfile.TemporaryDirectory() as root:
            # Every run 5% faster than the one before, NCCL costing nothing: a warm-up, then pairs
            # single first, NCCL first, single first, NCCL first.
            order = ["warmup", "single-1", "ranks1-1", "ranks1-2", "single-2", "single-3", "ranks1-3", "ranks1-4", "single-4"]
            for t, name in enumerate(order):
                self.write(root, name, 100 * 1.05 ** t, 1000 + t, "nccl" if name.startswith("ranks") else None)
            found = nccl.pairs(nccl.load(root))
            self.assertEqual([p[1] for p in found], ["single first", "NCCL first"] * 2)
            self.assertAlmostEqual(found[0][4], 1.05)
            self.assertAlmostEqual(found[1][4], 1 / 1.05)
            self.assertAlmostEqual(nccl.geometric_mean([p[4] for p in found]), 1.0)
            text = nccl.table(root)
            self.assertIn("geometric mean of the pairs' ratios: 1.000 (4 pairs, 2 single first and 2 NCCL first", text)
            self.assertNotIn("unbalanced", text)
            # Orders come from the recorded times, not the names; a pair without its NCCL run is left out.
            os.remove(os.path.join(root, "ranks1-4", "results.json"))
            self.assertIn("(3 pairs, 2 single first and 1 NCCL first", nccl.table(root))
            self.assertIn("unbalanced", nccl.table(root))


class CpuDescription(unittest.TestCase):
    def test_names_the_processor_and_its_bfloat16_instructions(self):
        from probattn_tools.baselines.cpu_kernels import cpu_description
        amx = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx512f avx512_bf16 amx_tile amx_bf16\n"
        self.assertEqual(cpu_description(amx), "Intel(R) Xeon(R) Processor; bfloat16 instructions: avx512_bf16 amx_bf16")
        old = "model name\t: Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz\nflags\t\t: fpu avx512f avx512_vnni\n"
        self.assertEqual(cpu_description(old), "Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz; bfloat16 instructions: none")
        self.assertIsNone(cpu_description("processor\t: 0\n"))


class ReferenceFormulas(unittest.TestCase):
    def setUp(self):
        g = torch.Generator().manual_seed(0)
        self.z = torch.randn(2, 3, 5, 7, generator=g, dtype=torch.float64) * 3
        self.allowed = torch.rand(2, 3, 5, 7, generator=g) > 0.3
        self.allowed[..., 0] = True  # every query keeps a key
        self.allowed[..., 0, :] = True  # every key keeps a query

    def test_rows_are_distributions_over_allowed_keys(self):
        for variant in ("softmax", "dnas", "sinkhorn-3"):
            with self.subTest(variant=variant):
                w = formulas.normalize(variant, self.z, self.allowed)
                self.assertTrue(torch.all(w[~self.allowed] == 0))
                torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 5, dtype=torch.float64), rtol=0, atol=1e-12)

    def test_dnas_is_the_row_softmax_of_column_normalized_scores(self):
        # Written out with dense softmaxes on a full mask, independently of masked_logsumexp.
        full = torch.ones_like(self.allowed)
        xi = torch.softmax(self.z, dim=-2)
        torch.testing.assert_close(formulas.dnas_weights(self.z, full), xi / xi.sum(-1, keepdim=True), rtol=0, atol=1e-12)

    def test_sinkhorn_on_a_square_full_mask_becomes_doubly_stochastic(self):
        z = self.z[..., :5] / 3
        w = formulas.sinkhorn_weights(z, torch.ones_like(z, dtype=torch.bool), 200)
        torch.testing.assert_close(w.sum(-2), torch.ones(2, 3, 5, dtype=torch.float64), rtol=0, atol=1e-9)

    def test_unknown_variant_is_named(self):
        with self.assertRaisesRegex(ValueError, "unknown variant 'nope'"):
            formulas.normalize("nope", self.z, self.allowed)


class FlexDnas(unittest.TestCase):
    """The FlexAttention composition of `probattn bench`'s CUDA rows is DNAS, against the reference
    formulas in float64: on the CPU the eager FlexAttention forward in float64 (there is no CPU
    backward); on CUDA the compiled one in float32 (the dtype the benchmark runs), forward and
    backward."""

    def setUp(self):
        try:
            from torch.nn.attention.flex_attention import flex_attention
        except ImportError as e:
            self.skipTest(f"no FlexAttention in this torch: {e}")
        self.flex = flex_attention
        g = torch.Generator().manual_seed(3)
        self.qkv = [torch.randn(2, 3, n, 16, generator=g, dtype=torch.float64) * s for n, s in ((24, 1.0), (40, 1.5), (40, 1.0))]

    def reference(self, q, k, v):
        z = q @ k.transpose(-2, -1) / 4.0
        return formulas.normalize("dnas", z, torch.ones_like(z, dtype=torch.bool)) @ v

    def test_forward_on_the_cpu(self):
        import warnings
        from probattn_tools.baselines.bench import dnas_flex
        q, k, v = self.qkv
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the eager FlexAttention warns that it is not compiled
            got = dnas_flex(q, k, v, self.flex)
        torch.testing.assert_close(got, self.reference(q, k, v), rtol=0, atol=1e-12)
        # Not softmax: the composition must differ from one plain call.
        self.assertGreater((got - torch.softmax(q @ k.transpose(-2, -1) / 4.0, -1) @ v).abs().max().item(), 1e-3)

    @unittest.skipIf(torch.cuda.is_available(), "needs a CUDA warm-up that fails: a machine without CUDA")
    def test_a_failed_warm_up_is_recorded_and_not_fatal(self):
        from probattn_tools.baselines import bench
        saved = dict(bench.FLEX)
        bench.FLEX.clear()
        try:
            with contextlib.redirect_stderr(io.StringIO()) as err:
                fn = bench.compiled_flex("cuda")
            self.assertTrue(callable(fn))
            self.assertIn("RuntimeError", bench.FLEX["warmup_error"])
            self.assertIn("FlexAttention's warm-up call failed", err.getvalue())
            self.assertIs(bench.compiled_flex("cuda"), fn)  # once per process
        finally:
            bench.FLEX.clear()
            bench.FLEX.update(saved)

    @unittest.skipUnless(torch.cuda.is_available(), "compiled FlexAttention's backward needs CUDA")
    def test_forward_and_backward_on_cuda(self):
        from probattn_tools.baselines.bench import compiled_flex, dnas_flex
        leaves = [t.float().cuda().requires_grad_() for t in self.qkv]
        expected = [t.detach().clone().requires_grad_() for t in self.qkv]
        g = torch.randn_like(leaves[0])
        got = dnas_flex(*leaves, compiled_flex(leaves[0].device))
        (got * g).sum().backward()
        want = self.reference(*expected)
        (want * g.cpu()).sum().backward()
        torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=1e-4)
        for name, a, b in zip("qkv", leaves, expected):
            torch.testing.assert_close(a.grad.double().cpu(), b.grad, rtol=0, atol=1e-4, msg=lambda m, n=name: f"d{n}: {m}")


class SdpaEmptyRows(unittest.TestCase):
    def test_the_cpu_kernels_give_an_empty_row_zeros(self):
        # The CPU's SDPA backends (math and its flash kernel) give the row no key may attend a
        # zero output and zero gradients under each mask, as probattn's softmax does; the others
        # are recorded with their refusal.
        from probattn_tools.baselines import sdpa_empty_rows

        with contextlib.redirect_stdout(io.StringIO()):
            rows = sdpa_empty_rows.check(torch.device("cpu"), ["float64"])
        ran = [r for r in rows if "refused" not in r]
        self.assertEqual({r["backend"] for r in ran}, {"math", "flash"})
        self.assertEqual(len(ran), 6)
        for r in ran:
            self.assertEqual((r["empty_output"], r["empty_dq"], r["any_grad_nan"]), ("zero", "zero", False), r)
            self.assertLess(r["other_rows_max_diff"], 1e-12, r)
        self.assertTrue(all(r["refused"] for r in rows if "refused" in r))


class Registry(unittest.TestCase):
    def test_the_deterministic_examples_have_a_reference(self):
        logit = torch.zeros(3, dtype=torch.float64)
        found = 0
        for entry in variants.registry():
            if entry["stochastic"]:
                continue
            found += 1
            w = formulas.normalize(entry["example"], torch.zeros(1, 3, 4, 4, dtype=torch.float64),
                                   torch.ones(1, 3, 4, 4, dtype=torch.bool), hybrid_logit=logit)
            torch.testing.assert_close(w, torch.full_like(w, 0.25), rtol=0, atol=1e-12)
        self.assertEqual(found, len(variants.examples()) - len(variants.examples(family="bayesian")))


if __name__ == "__main__":
    unittest.main()

"""The Triton kernels of the plans compiled ahead of time for sm_80 and sm_90 (`python -m
probattn_tools.kernels.aot --smoke`), their loops' instructions read from the SASS, and the tuning
table, each compile in a process of its own. Their check against the reference formulas under
Triton's interpreter is in test_kernel_check.py and test_kernel_key_tiles.py (modules of their
own, which the test suite runs side by side)."""

import json
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path


class TritonKernels(unittest.TestCase):
    def test_every_kernel_compiles_ahead_of_time_for_sm80_and_sm90(self):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        with tempfile.TemporaryDirectory() as out:
            done = subprocess.run([sys.executable, "-m", "probattn_tools.kernels.aot", "--out", out, "--smoke",
                                   "--dtypes", "bfloat16", "--head-dims", "64"], capture_output=True, text=True, env=env,
                                  timeout=900)
            self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
            entries = json.loads((Path(out) / "manifest.json").read_text())["entries"]
            self.assertEqual(sorted({(e["kernel"], e["arch"]) for e in entries}),
                             sorted((k, a) for k in ("_column_pass", "_row_pass", "_key_pass", "_query_pass",
                                                     "_sink_reduce", "_sink_key_grads", "_sink_query_grads")
                                    for a in ("sm_80", "sm_90")))
            for e in entries:
                self.assertGreater((Path(out) / e["file"]).stat().st_size, 10_000, e["file"])
                self.assertTrue(e["params"] and all(p["type"] in ("i32", "*bf16", "*fp32", "*u8", "*i64") for p in e["params"]), e)
                divisible = {p["name"]: p["divisible"] for p in e["params"]}
                self.assertEqual((divisible["Q"], divisible["D"], divisible["S_Q"]), (16, 16, 1), e)


    def test_the_cubins_are_compiled_for_aligned_inputs_and_load_16_byte_pieces(self):
        # DNAS's row pass for sm_90 as the build compiles it, against the same without the
        # alignment facts: 2-byte loads of its q, k and v blocks become 16-byte ones.
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        done = subprocess.run([sys.executable, "-m", "probattn_tools.kernels.ptx_loads"], capture_output=True, text=True,
                              env=env, timeout=600)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        plain, built = done.stdout.split("as the build compiles it")
        self.assertIn("ld.global.b16", plain)
        self.assertNotIn("ld.global.b16", built)
        self.assertIn("× 16 bytes", built.split("async copies")[1].split("\n")[0])

    def test_the_bam_draws_take_no_float64_and_stay_within_their_instruction_budgets(self):
        # BAM's row passes for sm_90, read from their SASS. The Lognormal draws took about 67
        # float64 instructions a score entry while their float32 ε was at::erfinv's rounding (one
        # Halley step in float64; 225 with calc_erfinv's two Newton steps); as a fixed sequence of
        # float32 operations (normal32.py) they take none, as Weibull's never did. The loops of
        # BAM over softmax's row pass, padded (bfloat16, d 64, 64 x 64 blocks): forming the draws'
        # positions per row, Weibull's term from two approximate log2s, and Lognormal's guess and
        # Halley step from approximate quotients, log and reciprocal took them from 101.5
        # instructions an entry to 51.6 (Weibull; 125.1 to 72.0 with the KL term) and from 275.8
        # to 220.8 (Lognormal; 305.2 to 255.8); Lognormal's float32 ε then took them to 98.9
        # (131.6 with the KL term). Leaving the Weibull KL term's sums that are linear in the
        # logits to the caller (bam.linear_kl) took its row pass from 72.0 to 58.2, and its key
        # pass that adds dQ by atomics from 92.3 to 67.8; the Lognormal KL term's sums, quadratic
        # in them, took its row pass from 131.6 to 106.0 (the key pass's from 144.9 to 117.3). A
        # budget 15% above each holds them there.
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        with tempfile.TemporaryDirectory() as tmp:
            rows = {}
            for noise, kernel in (("1", "_row_pass"), ("2", "_row_pass"), ("1", "_key_pass")):
                out = Path(tmp) / f"noise{noise}{kernel}.json"
                done = subprocess.run([sys.executable, "-m", "probattn_tools.kernels.resources", "--kernel", kernel,
                                       "--noise", noise, "--json", str(out)], capture_output=True, text=True, env=env,
                                      timeout=900)
                self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
                rows.setdefault(noise, []).extend(json.loads(out.read_text())["rows"])
        self.assertTrue(rows["1"] and rows["2"])
        for r in rows["1"]:
            self.assertEqual(r["float64_per_entry"], 0, r)
            self.assertGreater(r["HGMMA"], 0, r)
        for r in rows["2"]:
            self.assertEqual(r["float64_per_entry"], 0, r)
        budget = {("1", ""): 59.3, ("1", "KL=1"): 66.9, ("2", ""): 113.7, ("2", "KL=2"): 121.9,
                  ("1", "KL=1 GRADS=True ATOMIC_DQ=True"): 78.0}
        seen = set()
        for noise, found in rows.items():
            for r in found:
                c = {k: v for k, v in r["constexprs"].items() if k not in ("HAS_QPAD", "HAS_KPAD", "NOISE")}
                spec = " ".join(f"{k}={v}" for k, v in c.items())
                if (noise, spec) in budget:
                    seen.add((noise, spec))
                    self.assertLessEqual(r["loop_per_entry"], budget[noise, spec], r)
        self.assertEqual(seen, set(budget))

    def test_the_deterministic_loops_stay_within_their_instruction_budgets(self):
        # The loops over tiles of softmax's and DNAS's passes for sm_90 (bfloat16, d 64, 64 x 64
        # blocks), read from their SASS. Forming exp as one approximate exp2, leaving out the
        # bound a pass need not apply, summing the column pass's tiles along rows and taking
        # DNAS's column weights from the row weights took them from 18.7-45.2 instructions a
        # score entry to 11.3-24.7. DNAS's key pass then took its correction to dK from the
        # column pass's mean of the queries and summed g_j across the warps once per head: 24.7
        # to 16.2, the column pass that forms that mean 13.2. Reading r_i = +inf past the last
        # query took the key pass's bound on queries away: 12.2 (softmax) and 15.2 (DNAS); formed
        # transposed (settings.TRANSPOSE_KEYS), 17.3 and 20.9. Reading c_j = +inf past the last
        # key did the same for DNAS's row pass: 19.3 to 17.9. Forming exp(x - m) as one fused
        # multiply-add before the exp2 (m·log2 e once per row or key) took a step more from each
        # loop that exponentiates against a statistic: column pass 10.4 (12.2 with its mean of
        # the queries), row pass 13.5, DNAS's 17.0, its key pass 14.2 (20.2 transposed, softmax's
        # 17.5) and its query pass 18.4. Softmax's key and query passes then formed their scores
        # in the exps' base, the scale times log2 e as the one multiply they take, so that each
        # weight is one multiply-add and an exp2: 11.3 (16.5 transposed) and 11.0. Reading the
        # per-key statistics a whole key block at a time, without a bound (their rows padded to
        # whole blocks), took DNAS's row pass to 12.1 and its query pass to 15.4, then 13.6.
        # Padded, the passes that carry the paddings in their statistics (c_j and r_i = +inf, and
        # Sinkhorn-N's potentials) issue what their unpadded forms do; the others take 2.0-4.6
        # more. Sinkhorn-N's column reductions, formed transposed as the column pass is, 21.3-21.4
        # and 16.5 to 10.3-12.0 and 12.7. Its dK/dV stage, adding dQ by atomics (which leaves
        # the stage of dQ's own, 43.3, to deterministic algorithms), 56.4 and 56.9 padded against
        # 46.9 and 47.5 without them. Softmax's key pass that adds dQ by atomics, in place of its
        # query pass: 19.0 and 20.6 (transposed 24.8 and 24.9). A budget 15% above each count holds them there,
        # unpadded and padded:
        # (unpadded, padded) per kernel and the constexprs it sets beside the paddings.
        from probattn_tools.kernels import settings

        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        keys = (19.0, 23.2, 28.5, 28.6) if settings.TRANSPOSE_KEYS else (13.0, 16.3, 21.9, 23.7)
        budget = {
            ("_column_pass", ""): (11.9, 15.5), ("_column_pass", "CONTEXT"): (14.1, 16.4),
            ("_row_pass", ""): (15.5, 18.2), ("_row_pass", "SWEEPS=1"): (14.0, 14.0),
            ("_key_pass", "GRADS"): (keys[0], keys[0]), ("_key_pass", "SWEEPS=1 GRADS"): (keys[1], keys[1]),
            ("_key_pass", "GRADS ATOMIC_DQ"): (keys[2], keys[3]),
            ("_query_pass", ""): (12.7, 15.1), ("_query_pass", "SWEEPS=1"): (15.7, 15.7),
            ("_sink_reduce", "COLUMNS LSE"): (11.9, 15.5), ("_sink_reduce", "COLUMNS LSE HAS_RPOT"): (13.8, 13.8),
            ("_sink_reduce", "LSE"): (14.9, 14.9), ("_sink_reduce", "HAS_RPOT"): (15.1, 15.1),
            ("_sink_reduce", "COLUMNS HAS_RPOT"): (14.7, 14.7), ("_sink_key_grads", ""): (21.0, 21.0),
            ("_sink_key_grads", "STAGE=1"): (54.0, 54.7), ("_sink_key_grads", "STAGE=1 ATOMIC_DQ"): (64.9, 65.4),
            ("_sink_query_grads", ""): (49.8, 49.8)}
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "det.json"
            done = subprocess.run([sys.executable, "-m", "probattn_tools.kernels.resources", "--noise", "0", "--masks",
                                   "padding", "--json", str(out)], capture_output=True, text=True, env=env,
                                  timeout=900)
            self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
            rows = json.loads(out.read_text())["rows"]
        seen = set()
        for r in rows:
            c = dict(r["constexprs"])
            padded = bool(c.pop("HAS_QPAD", False)) & bool(c.pop("HAS_KPAD", False))
            spec = " ".join(k if v is True else f"{k}={v}" for k, v in c.items())
            if (r["kernel"], spec) in budget:
                seen.add((r["kernel"], spec, padded))
                self.assertLessEqual(r["loop_per_entry"], budget[r["kernel"], spec][padded], r)
        self.assertEqual(seen, {(*key, padded) for key in budget for padded in (False, True)})

    def test_a_cubin_past_its_architectures_shared_memory_is_refused_by_name(self):
        # float32 at head dimension 128 with 64 x 64 blocks: the key pass needs 176 KiB, sm_80
        # allows 163 KiB per block.
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        code = ("import triton; from probattn_tools.kernels import aot, plans; "
                "name, c = next(s for s in aot.route_specializations('float32') if s[0] == '_key_pass'); "
                "aot.compile_one(triton, plans, name, c, 'float32', 128, 80, 64, 64, 4, 2)")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
        self.assertNotEqual(done.returncode, 0)
        self.assertRegex(done.stderr, r"ValueError: _key_pass for sm_80, float32, head dimension 128, 64 x 64 blocks "
                                      r"and 2 stages needs \d+ bytes of shared memory; sm_80 allows 166912")


class SassCounts(unittest.TestCase):
    """How `kernels.resources` reads a loop's instructions from SASS and turns them into a floor."""

    def test_a_loop_inside_the_tile_loop_is_counted_apart_and_repeated_in_the_floor(self):
        from unittest import mock

        from probattn_tools.kernels import resources

        # A tile loop (0x10-0x60, with a product) around a loop without one (0x20-0x40).
        code = [(0x00, "MOV", " R1, R2"), (0x10, "HGMMA", " R4"), (0x20, "FADD", " R5"), (0x30, "MUFU", ".EX2 R6"),
                (0x40, "BRA", " 0x20"), (0x50, "FMUL", " R7"), (0x60, "BRA", " 0x10"), (0x70, "EXIT", "")]
        counts = resources.loop_counts(code)
        self.assertEqual((counts["loop_instructions"], counts["inner_loop_instructions"]), (6, 3))
        self.assertEqual((counts["loop_HGMMA"], counts["loop_MUFU"]), (1, 1))
        self.assertNotIn("inner_loop_instructions", resources.loop_counts(code[:4] + code[5:]))
        row = {"kernel": "k", "constexprs": {}, "loop_per_entry": 6.0, **counts}
        # Launched twice, its inner loop run three times a tile: 2 · (6 + 2 · 3) per entry.
        with mock.patch.dict(resources.PLAN_PASSES, {"p": [("k", {}, 2, 3)]}, clear=True):
            floor = resources.floors([row], seq=1024, heads=1)
        self.assertEqual(floor["p"]["per_entry"], 24.0)


class TuningTable(unittest.TestCase):
    """The table `kernels.sweep` writes and `kernels.aot` reads (`kernels.settings`)."""

    def test_the_committed_table_reads_and_each_entry_is_a_launch_setting(self):
        from probattn_tools.kernels import settings

        table = settings.read_table()
        for arch, dtypes in table["configs"].items():
            for dtype, dims in dtypes.items():
                for head_dim in dims:
                    block_m, block_n, warps, stages = settings.lookup(table, int(arch.removeprefix("sm_")), dtype, head_dim)
                    for block in (block_m, block_n):
                        self.assertTrue(block >= 16 and block & (block - 1) == 0, (arch, dtype, head_dim))
                    self.assertIn(warps, (1, 2, 4, 8, 16))
                    self.assertGreaterEqual(stages, 1)

    def test_flags_then_the_table_then_the_defaults_choose_a_cubins_setting(self):
        from types import SimpleNamespace

        from probattn_tools.kernels import aot, settings, sweep

        table = sweep.merge({"configs": {}}, {"configs": {"sm_90": {"bfloat16": {"64": {
            "block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3, "score_ms": 1.0}}}}})
        none = SimpleNamespace(block_m=None, block_n=None, num_warps=None, num_stages=None)
        self.assertEqual(aot.launch_setting(table, 90, "bfloat16", 64, none), (128, 64, 8, 3))
        self.assertEqual(aot.launch_setting(table, 90, "bfloat16", 128, none), settings.DEFAULT)
        # float16 takes bfloat16's entry where it has none of its own.
        self.assertEqual(aot.launch_setting(table, 90, "float16", 64, none), (128, 64, 8, 3))
        self.assertEqual(aot.launch_setting(table, 80, "bfloat16", 64, none), settings.DEFAULT)
        # float32 takes no 16-bit entry (its tiles take twice the shared memory), and above head
        # dimension 64 32-query blocks; above head dimension 128 every dtype takes 8 warps.
        self.assertEqual(aot.launch_setting(table, 90, "float32", 64, none), settings.DEFAULT)
        self.assertEqual(aot.launch_setting(table, 90, "float32", 128, none), (32, 64, 4, 2))
        self.assertEqual(aot.launch_setting(table, 90, "float16", 256, none), (64, 64, 8, 2))
        self.assertEqual(aot.launch_setting(table, 80, "float32", 256, none), (32, 64, 8, 2))
        self.assertEqual(aot.launch_setting(table, 90, "bfloat16", 64, SimpleNamespace(block_m=32, block_n=None,
                                                                                        num_warps=None, num_stages=2)),
                         (32, 64, 8, 2))
        # A later sweep replaces an entry and keeps the others.
        later = sweep.merge(table, {"configs": {"sm_90": {"bfloat16": {"128": dict(
            block_m=64, block_n=32, num_warps=4, num_stages=2)}}}})
        self.assertEqual(settings.lookup(later, 90, "bfloat16", 64), (128, 64, 8, 3))
        self.assertEqual(settings.lookup(later, 90, "bfloat16", 128), (64, 32, 4, 2))
        with self.assertRaisesRegex(ValueError, "sm_90, bfloat16, head dimension 64"):
            settings.lookup({"configs": {"sm_90": {"bfloat16": {"64": {"block_m": 64}}}}}, 90, "bfloat16", 64)

    def test_a_kernel_takes_its_own_setting_where_the_entry_names_it_and_a_block_map_reader_never_does(self):
        from types import SimpleNamespace

        from probattn_tools.kernels import aot, plans, settings

        table = {"configs": {"sm_90": {"bfloat16": {"64": {
            "block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2,
            "kernels": {"_key_pass": {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
                        "_row_pass:noise": {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}}}}}}}
        none = SimpleNamespace(block_m=None, block_n=None, num_warps=None, num_stages=None)
        at = lambda name, **c: aot.launch_setting(table, 90, "bfloat16", 64, none, name, c)  # noqa: E731
        self.assertEqual(at("_key_pass", SWEEPS=1, GRADS=True), (128, 64, 8, 3))
        self.assertEqual(at("_key_pass", NOISE=1, GRADS=True), (64, 64, 4, 2))  # BAM's key pass: the common one
        self.assertEqual(at("_row_pass", NOISE=2), (64, 32, 4, 2))
        self.assertEqual(at("_row_pass"), (64, 64, 4, 2))
        # A specialization that reads a block map takes the common setting: one map serves a call.
        self.assertEqual(at("_key_pass", SWEEPS=1, GRADS=True, HAS_MASK=True), (64, 64, 4, 2))
        # float16 takes bfloat16's kernels' settings too.
        self.assertEqual(aot.launch_setting(table, 90, "float16", 64, none, "_key_pass", {}), (128, 64, 8, 3))
        self.assertEqual(settings.lookup(table, 90, "bfloat16", 64), (64, 64, 4, 2))
        with self.assertRaisesRegex(ValueError, "kernel _key_pass"):
            settings.lookup({"configs": {"sm_90": {"bfloat16": {"64": dict(
                block_m=64, block_n=64, num_warps=4, num_stages=2, kernels={"_key_pass": {"block_m": 64}})}}}},
                90, "bfloat16", 64, "_key_pass")
        # The sweep's entry for a winner with kernels of their own reads back as the build reads it.
        from probattn_tools.kernels import sweep

        best = dict(block_m=64, block_n=64, num_warps=4, num_stages=2, score_ms=3.0, vs_default=1.0,
                    own={"_key_pass": (128, 64, 4, 2)}, own_score_ms=2.8, own_vs_default=0.93)
        entry = sweep.table_entry(best, SimpleNamespace(shape="1x16384", heads=8, plans="softmax,dnas"), "GPU")
        self.assertEqual((entry["score_ms"], entry["vs_default"]), (2.8, 0.93))
        written = {"configs": {"sm_90": {"bfloat16": {"64": entry}}}}
        self.assertEqual(settings.lookup(written, 90, "bfloat16", 64, "_key_pass"), (128, 64, 4, 2))
        self.assertEqual(settings.lookup(written, 90, "bfloat16", 64, "_row_pass"), (64, 64, 4, 2))
        # The Python orchestration launches the same way.
        config = plans.Config(64, 64, 4, 2, kernels={"_key_pass": (128, 64, 8, 3)})
        self.assertEqual(config.of("_key_pass", {"SWEEPS": 1}), (128, 64, 8, 3))
        self.assertEqual(config.of("_key_pass", {"SWEEPS": 1, "HAS_MASK": True}), (64, 64, 4, 2))
        self.assertEqual(config.of("_key_pass", {"NOISE": 1}), (64, 64, 4, 2))


    def test_the_sweep_runs_under_the_interpreter_and_writes_its_records(self):
        env = dict(os.environ, TRITON_INTERPRET="1")
        with tempfile.TemporaryDirectory() as out:
            done = subprocess.run([sys.executable, "-m", "probattn_tools.kernels.sweep", "--device", "cpu", "--dtypes",
                                   "float16", "--head-dims", "16", "--shape", "1x40", "--heads", "2", "--settings", "3",
                                   "--plans", "softmax,dnas", "--repeats", "1", "--out", out], capture_output=True, text=True, env=env, timeout=600)
            self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
            record = json.loads((Path(out) / "sweep.json").read_text())
            for row in record["rows"]:
                self.assertNotIn("refused", row)
                self.assertEqual(sorted(row["ms"]), ["dnas", "softmax"])
                self.assertLess(max(row["max_error_vs_default"].values()), 4e-3)
            self.assertEqual(record["rows"][0]["vs_default"], 1.0)
            timed = [row for row in record["rows"] if "kernels" not in row]
            self.assertEqual(len(timed), 3)
            for row in timed:
                self.assertEqual(sorted(row["kernel_ms"]), ["_column_pass", "_key_pass", "_query_pass", "_row_pass"])
                self.assertTrue(all(ms > 0 for ms in row["kernel_ms"].values()), row)
            # A combination of the kernels' own settings was checked and timed against the common
            # setting exactly where some kernel's fastest setting beat the common one for it.
            from probattn_tools.kernels import sweep

            common = min(timed, key=lambda r: r["score_ms"])
            own = sweep.own_settings(timed, common)
            combined = [row for row in record["rows"] if "kernels" in row]
            self.assertEqual(len(combined), 1 if own else 0, (own, combined))
            for row in combined:
                self.assertEqual(row["kernels"], {key: list(sweep.setting_of(r)) for key, r in own.items()})
                self.assertLess(max(row["max_error_vs_default"].values()), 4e-3)
                self.assertIn("common_score_ms", row)
            # The interpreter's times choose nothing.
            self.assertEqual(json.loads((Path(out) / "table.json").read_text()), {"configs": {}})
            self.assertIn("| 128 | 64 | 4 | 2 |", (Path(out) / "sweep.md").read_text())


if __name__ == "__main__":
    unittest.main()

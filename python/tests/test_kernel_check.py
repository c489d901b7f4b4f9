"""The Triton kernels of the plans against the reference formulas under Triton's interpreter on the
CPU (`python -m probattn_tools.kernels.check --quick`), in a process of its own (the interpreter
is chosen when Triton is imported), with the specializations the cases launched."""

import json
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path


class QuickCheck(unittest.TestCase):
    def test_every_quick_case_is_within_tolerance_and_bad_input_is_named(self):
        env = dict(os.environ, TRITON_INTERPRET="1")
        with tempfile.TemporaryDirectory() as tmp:
            record = Path(tmp) / "launched.json"
            done = subprocess.run([sys.executable, "-m", "probattn_tools.kernels.check", "--quick", "--record",
                                   str(record), "--dtypes", "float64,float32,float16"], capture_output=True, text=True,
                                  env=env, timeout=900)
            out = done.stdout + done.stderr
            self.assertEqual(done.returncode, 0, out)
            self.assertIn("all 36 cases within tolerance; draws as recorded; bad input named", out)
            self.assertNotIn("FAIL", out)
            # The launches recorded are what `kernels.aot --set` would compile, key for key: every
            # constexpr of each kernel named, none the ahead-of-time build sets itself.
            self.assertIn("specializations (in", out)
            launched = json.loads(record.read_text())["launched"]
            kernels = {e["kernel"] for e in launched}
            self.assertEqual(kernels, {"_column_pass", "_row_pass", "_key_pass", "_query_pass", "_sink_reduce",
                                       "_sink_key_grads", "_sink_query_grads"})
            self.assertTrue(any(e["kernel"] == "_row_pass" and e["constexprs"]["NOISE"] == 3 for e in launched))
            check = ("import json, sys; from probattn_tools.kernels import aot, plans; "
                     "bad = [e for e in json.load(open(sys.argv[1]))['launched'] if aot.key(plans, e['kernel'], "
                     "e['constexprs']) != (e['kernel'], tuple(sorted(e['constexprs'].items())))]; print(bad)")
            keyed = subprocess.run([sys.executable, "-c", check, str(record)], capture_output=True, text=True, env=env,
                                   timeout=300)
            self.assertEqual((keyed.returncode, keyed.stdout.strip()), (0, "[]"), keyed.stderr)


if __name__ == "__main__":
    unittest.main()

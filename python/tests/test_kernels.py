"""The Triton kernels of the plans against the reference formulas, under Triton's interpreter on
the CPU: `python -m probattn_tools.kernels.check --quick` in a process of its own (the interpreter
is chosen when Triton is imported, which other tests of this folder do first)."""

import os
import subprocess
import sys
import unittest


class TritonKernels(unittest.TestCase):
    def test_every_quick_case_is_within_tolerance_and_bad_input_is_named(self):
        env = dict(os.environ, TRITON_INTERPRET="1")
        done = subprocess.run([sys.executable, "-m", "probattn_tools.kernels.check", "--quick",
                               "--dtypes", "float64,float32,float16"], capture_output=True, text=True, env=env, timeout=900)
        out = done.stdout + done.stderr
        self.assertEqual(done.returncode, 0, out)
        self.assertIn("all 20 cases within tolerance; bad input named", out)
        self.assertNotIn("FAIL", out)


if __name__ == "__main__":
    unittest.main()

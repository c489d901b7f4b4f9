"""The key pass in the form of its tiles the build leaves out, against the reference formulas under
Triton's interpreter (`python -m probattn_tools.kernels.check --quick --key-tiles ...`)."""

import os
import subprocess
import sys
import unittest


class OtherKeyTiles(unittest.TestCase):
    def test_the_key_pass_in_the_form_the_build_leaves_out_is_within_tolerance_too(self):
        # The key pass forms its tiles (queries x keys) or (keys x queries) (`settings.TRANSPOSE_KEYS`,
        # the build's choice); `kernels.bench --key-tiles both` times the two on a GPU, so the
        # other form is held to the formulas as well, in float64.
        env = dict(os.environ, TRITON_INTERPRET="1")
        from probattn_tools.kernels import settings

        other = "rows" if settings.TRANSPOSE_KEYS else "transposed"
        done = subprocess.run([sys.executable, "-m", "probattn_tools.kernels.check", "--quick", "--key-tiles", other,
                               "--dtypes", "float64", "--cases-only"], capture_output=True, text=True, env=env, timeout=900)
        out = done.stdout + done.stderr
        self.assertEqual(done.returncode, 0, out)
        self.assertIn("all 20 cases within tolerance", out)
        # the draws and the bad input, which the key pass's form does not change, are test_kernel_check.py's
        self.assertNotRegex(out, r"(?m)^draws ")


if __name__ == "__main__":
    unittest.main()

"""Lognormal's ε of float32 draws as its definition reads (`probattn_tools.kernels.normal32`, the
numpy form the kernels and noise.cpp are held to bit for bit): its fused multiply-add rounds once,
as exact rational arithmetic says, and the ε it gives is the standard normal's quantile to within
its stated error, odd about u = 1/2."""

import random
import unittest
from fractions import Fraction

import numpy as np

from probattn_tools.kernels import normal32


def nearest32(exact):
    """The float32 nearest the rational `exact`, ties to the even significand."""
    guess = np.float32(float(exact))
    around = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    return min(around, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.array(v).view(np.int32)) & 1))


class Fma32(unittest.TestCase):
    def test_it_rounds_the_exact_sum_once(self):
        rng = random.Random(5)
        a, b, c = ([np.float32(rng.uniform(-1, 1) * 2.0 ** rng.randint(-30, 30)) for _ in range(3000)] for _ in range(3))
        ours = normal32.fma32(np.array(a), np.array(b), np.array(c))
        for x, y, z, got in zip(a, b, c, ours):
            want = nearest32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
            self.assertEqual(np.array(got).view(np.int32), np.array(want).view(np.int32), (x, y, z))

    def test_a_sum_on_a_midpoint_of_float32_goes_where_its_last_bits_say(self):
        # 0.75 · 5592407·2^-22 = 1 + 2^-22 + 2^-24, halfway between two float32 values; a c of
        # ±2^-70 decides the rounding, which float64's sum alone loses (it rounds back onto the
        # midpoint, and the tie then goes to the even neighbour).
        a, b = np.float32(0.75), np.float32(5592407 * 2.0 ** -22)
        for c, want in ((2.0 ** -70, 1 + 2.0 ** -22 + 2.0 ** -23), (-(2.0 ** -70), 1 + 2.0 ** -22)):
            self.assertEqual(normal32.fma32(a, b, np.float32(c)), np.float32(want))
        # float64's sum rounded to float32 takes the upward case to the even neighbour below.
        self.assertEqual(np.float32(float(a) * float(b) + 2.0 ** -70), np.float32(1 + 2.0 ** -22))


class Normal32(unittest.TestCase):
    def test_every_draw_is_the_normal_quantile_within_its_stated_error(self):
        relative, ulps = normal32.error()
        self.assertLess(relative, 3.5e-7)
        self.assertLess(ulps, 6.0)

    def test_the_draws_are_odd_about_one_half(self):
        m = np.arange(1 << 23)
        eps = normal32.normal32(m)
        self.assertTrue(np.array_equal(eps, -eps[::-1]))
        self.assertTrue(np.all(np.diff(eps) > 0))  # increasing in u: one draw, one value


if __name__ == "__main__":
    unittest.main()

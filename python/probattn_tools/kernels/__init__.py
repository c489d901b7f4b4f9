"""Triton kernels of the deterministic plans (`plans`) and their conformance check against the
reference formulas (`check`), run on the CPU under Triton's interpreter and on a GPU compiled."""

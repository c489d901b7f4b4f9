"""Triton's interpreter (`TRITON_INTERPRET=1`), which runs the kernels on the CPU for the tests, made
cheaper for kernels built from many small `@triton.jit` helpers.

Triton 3.6's interpreter patches `triton.language` on every call of a `@triton.jit` helper from a
kernel (`InterpretedFunction.__call__` calls `_patch_lang`: an `inspect.getmembers` over the
language's modules), although the launch has patched them already (`GridExecutor.__call__`).
After a helper's first call in a launch the patch changes nothing: the builtins are wrapped
already, and the rest is set again to the same functions. The kernels here call helpers on
every tile, so the repeats took about 40 % of the interpreter's time: Sinkhorn-3's padded case
of `kernels.check` took 8.4 s with them and 4.9 s without, with the same errors to the last
digit. `patch_once_per_launch` keeps each helper's first call in a launch as Triton makes it and
leaves out the repeats.

Nothing changes on a GPU, outside the interpreter, or under a Triton whose interpreter this was
not written against (then the repeats stay)."""

import os

# The Triton releases whose interpreter's `GridExecutor.__call__` and
# `InterpretedFunction.__call__` were read for this.
KNOWN = ("3.6.",)


def patch_once_per_launch():
    """Lets each `@triton.jit` helper patch the language on its first call within a launch only.
    Returns whether it did (False outside the interpreter or under another Triton)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import triton
    from triton.runtime import interpreter

    grid_call = getattr(interpreter.GridExecutor, "__call__", None)
    helper_call = getattr(interpreter.InterpretedFunction, "__call__", None)
    if not triton.__version__.startswith(KNOWN) or grid_call is None or helper_call is None:
        return False
    if getattr(helper_call, "_once_per_launch", False):
        return True
    launch = {"helpers": None}  # the helpers that have patched within the launch under way

    def run_grid(self, *args, **kwargs):
        outer, launch["helpers"] = launch["helpers"], set()
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launch["helpers"] = outer

    def call_helper(self, *args, **kwargs):
        helpers = launch["helpers"]
        if helpers is None or self.fn not in helpers:
            if helpers is not None:
                helpers.add(self.fn)
            return helper_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as Triton's own call reports it
            raise interpreter.InterpreterError(repr(e)) from e

    call_helper._once_per_launch = True
    interpreter.GridExecutor.__call__ = run_grid
    interpreter.InterpretedFunction.__call__ = call_helper
    return True

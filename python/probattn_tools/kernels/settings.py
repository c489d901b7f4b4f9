"""The launch settings the ahead-of-time build compiles each kernel with: the defaults, and the
tuning table (`tuning.json` beside this file) that `kernels.sweep` fills on a GPU. What the cubins
are compiled from, so the kernels' build keys its cache on this file and the table, not on the
sweep that times them."""

import json
from pathlib import Path

# (block_m, block_n, num_warps, num_stages)
DEFAULT = (64, 64, 4, 2)
TABLE = Path(__file__).with_name("tuning.json")
# Whether the key pass forms its tiles (keys × queries), as FlashAttention-2's backward does, or
# (queries × keys) (`_key_pass`'s TRANSPOSE, docs/kernels.md): what the build compiles, and
# `plans.Config`'s default. `kernels.bench --key-tiles` times both forms in one run.
TRANSPOSE_KEYS = False
# The widest head dimension (of q and k, and of v) at which softmax's base adds dQ by atomics from
# its key pass (`_key_pass`'s ATOMIC_DQ, `atomic_dq`).
ATOMIC_DQ_WIDEST = 128


def atomic_dq(dtype, head_dim):
    """Whether softmax's base adds dQ by atomics from its key pass for inputs of `dtype` (a name:
    "bfloat16", ...) at `head_dim` (the widest of q's and v's), where deterministic algorithms are
    not asked for; elsewhere the key and query passes serve. Up to ATOMIC_DQ_WIDEST: at 256 that
    key pass's 64 × 64 tiles need 176 KiB of shared memory in bfloat16 (168 KiB with one stage),
    past sm_80's 163 KiB a block. Not in float32: there they need 113 KiB at head dimension 64,
    past the 99 KiB of sm_86 and sm_89, which float32's set otherwise fits."""
    return dtype != "float32" and head_dim <= ATOMIC_DQ_WIDEST


def default(dtype, head_dim):
    """The setting a set without a tuning table entry is compiled with: DEFAULT, but 32-query
    blocks for float32 above head dimension 64 (the key pass's 64 × 64 float32 tiles need 176 KiB
    of shared memory at head dimension 128, past sm_80's 163 KiB per block; 32-query blocks need
    up to 120 KiB), and 8 warps above head dimension 128 (a 64 × 256 float32 accumulator is 128
    registers a thread over 4 warps, before anything else)."""
    block_m = 32 if dtype == "float32" and head_dim > 64 else DEFAULT[0]
    return (block_m, DEFAULT[1], 8 if head_dim > 128 else DEFAULT[2], DEFAULT[3])


def kernel_key(name, constexprs):
    """The name a kernel's own setting has in a table entry's `kernels`: the kernel's, with
    ":noise" for BAM's specializations (NOISE > 0), whose draws in the loop over tiles make them
    another kind of work than the deterministic plans' passes of the same kernel."""
    return f"{name}:noise" if constexprs.get("NOISE", 0) else name


def read_table(path=TABLE):
    """The table: {"configs": {arch: {dtype: {head_dim: {block_m, block_n, num_warps, num_stages, ...,
    "kernels": {kernel_key: {block_m, block_n, num_warps, num_stages}}}}}}}: an entry's setting
    serves every kernel but those `kernels` names (`kernel_key`), and every specialization that
    reads a block map (HAS_MASK: the map has one block shape per call)."""
    if not Path(path).exists():
        return {"configs": {}}
    table = json.loads(Path(path).read_text())
    if not isinstance(table.get("configs"), dict):
        raise ValueError(f"{path}: a tuning table holds a 'configs' object")
    return table


def _setting(entry, where):
    try:
        return tuple(int(entry[k]) for k in ("block_m", "block_n", "num_warps", "num_stages"))
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"tuning table: {where} needs integer block_m, block_n, num_warps and num_stages, "
                         f"got {entry}") from None


def lookup(table, arch, dtype, head_dim, kernel=None):
    """(block_m, block_n, num_warps, num_stages) for sm_`arch`, or None where the table has none:
    the entry's own, or with `kernel` (a `kernel_key`) that kernel's where the entry names it."""
    entry = table["configs"].get(f"sm_{arch}", {}).get(dtype, {}).get(str(head_dim))
    if entry is None:
        return None
    where = f"the entry for sm_{arch}, {dtype}, head dimension {head_dim}"
    own = _setting(entry, where)
    kernels = entry.get("kernels", {})
    if not isinstance(kernels, dict):
        raise ValueError(f"tuning table: {where}: 'kernels' maps kernel names to settings, got {kernels!r}")
    if kernel is None or kernel not in kernels:
        return own
    return _setting(kernels[kernel], f"{where}, kernel {kernel}")

"""What the compiler makes of the kernels' memory traffic, read from the PTX on a machine without a
GPU: one specialization of the fused CUDA route compiled twice for an architecture, as the
ahead-of-time build compiles it (aot.ALIGNED's facts: aligned pointers, strides and head
dimensions that are multiples of 16) and without those facts, with the global loads and the
asynchronous copies of each counted by width, the tensor-core instructions, the copy groups the
software pipeline commits and the shared memory.

    python -m probattn_tools.kernels.ptx_loads                       # DNAS's row pass, bfloat16, d 64, sm_90
    python -m probattn_tools.kernels.ptx_loads --kernel _key_pass --arch 80 --head-dim 128

The counts are static (instructions in the PTX, not executions): a 2-byte `ld.global.b16` where a
16-byte `ld.global.v4.b32` or `cp.async.cg ... 16` could stand is eight times the load
instructions for the same bytes.
"""

import argparse
import collections
import re
import sys

KINDS = [
    ("global loads", r"\bld\.global(?:\.[a-z0-9]+)*\b"),
    ("async copies to shared memory", r"\bcp\.async\.c[ag]\.shared\.global(?:\.[a-z0-9]+)*\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-f]+|\d+)"),
    ("bulk (TMA) copies", r"\bcp\.async\.bulk[\w.]*"),
]


def count(ptx):
    """{kind: Counter of instruction (or copy size in bytes)}, tensor-core instructions, commit groups."""
    out = {}
    for kind, pattern in KINDS:
        found = re.findall(pattern, ptx)
        out[kind] = collections.Counter(f"{int(f, 0)} bytes" if f[:1].isdigit() else f for f in found)
    mma = len(re.findall(r"\bwgmma\.mma_async\b|\bmma\.sync\b", ptx))
    groups = len(re.findall(r"\bcp\.async\.commit_group\b|\bcp\.async\.bulk\.commit_group\b", ptx))
    return out, mma, groups


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", default="_row_pass", help="a kernel of the route (default _row_pass)")
    parser.add_argument("--sweeps", type=int, default=1, help="SWEEPS of the specialization: 0 softmax, 1 DNAS (default 1)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--head-dim", type=int, default=64, choices=[64, 128, 256])
    parser.add_argument("--arch", type=int, default=90, choices=[80, 90])
    parser.add_argument("--block-m", type=int, default=64)
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--num-stages", type=int, default=2)
    args = parser.parse_args(argv)
    import triton

    from probattn_tools.kernels import aot, plans

    wanted = [c for n, c in aot.route_specializations(args.dtype, args.head_dim)
              if n == args.kernel and c.get("SWEEPS", 0) == args.sweeps and not c.get("HAS_QPAD") and not c.get("NOISE")]
    if not wanted:
        sys.exit(f"ptx_loads: the route launches no unpadded {args.kernel} with SWEEPS={args.sweeps} "
                 f"in {args.dtype} at head dimension {args.head_dim}")
    constexprs = wanted[0]
    print(f"{args.kernel} {constexprs}, {args.dtype}, head dimension {args.head_dim}, sm_{args.arch}, "
          f"{args.block_m} x {args.block_n} blocks, {args.num_warps} warps, {args.num_stages} stages")
    for label, aligned in (("without the alignment facts", False), ("as the build compiles it", True)):
        compiled, entry = aot.compiled_one(triton, plans, args.kernel, constexprs, args.dtype, args.head_dim, args.arch,
                                           args.block_m, args.block_n, args.num_warps, args.num_stages, aligned=aligned)
        kinds, mma, groups = count(compiled.asm["ptx"])
        print(f"\n{label}: shared memory {entry['shared_bytes']} bytes, {mma} tensor-core instructions, "
              f"{groups} copy groups committed")
        for kind, counter in kinds.items():
            shown = ", ".join(f"{n} × {k}" for k, n in sorted(counter.items())) or "none"
            print(f"  {kind}: {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

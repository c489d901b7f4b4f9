"""Compiles the Triton kernels of the plans ahead of time for NVIDIA GPUs, on a machine without
one: each kernel specialized for a dtype, a head dimension and its flags, to a cubin per
architecture, with a manifest of what each cubin is and how to launch it.

    python -m probattn_tools.kernels.aot --out DIR                  # sm_80 and sm_90, the default set
    python -m probattn_tools.kernels.aot --out DIR --arch 90 --dtypes bfloat16 --head-dims 64
    python -m probattn_tools.kernels.aot --out DIR --route --jobs 2   # what the library embeds

`DIR/manifest.json` lists, per cubin: the kernel, the architecture, the dtype, the constexpr
values it was specialized for, the run-time parameters in launch order (pointers and 32-bit
integers; Triton 3.6 appends two scratch pointers after them), `num_warps` (a block of
32 × num_warps threads), and the dynamic shared memory it needs (above 48 KiB a launcher must
raise the function's limit first, as Triton's own launcher does).

`--route` compiles the set the library's fused CUDA route launches (`route_specializations`);
the build of the `probattn-kernels` crate runs it and embeds the cubins, and the C++ layer
(probattn-sys/csrc/fused_cuda.cpp) launches them. The test suite also compiles every kernel once
for sm_80 and sm_90 (`--smoke`), which catches what Triton's interpreter lets through and a GPU
compile refuses.

float32 cubins take their products in TF32 (`tl.dot(..., input_precision="tf32")`): the route serves
float32 only where libtorch's TF32 switch for matrix products is on, as cuBLAS then computes; with
it off, float32 runs on the tiles. Every cubin's shared memory is checked against its
architecture's per-block limit here, so that a set that could not launch fails its build instead.

Each cubin is compiled knowing what Triton's just-in-time launcher would tell it for aligned
tensors (`tt.divisibility` 16): the q, k, v, output and gradient pointers are 16-byte aligned,
and their batch, head and row strides and the head dimensions `D` and `DV` are multiples of 16
(`ALIGNED`; the manifest's `divisible` per parameter). Without those facts every load of a q, k
or v block is a 2-byte load and nothing is pipelined (`python -m probattn_tools.kernels.ptx_loads`
counts them); with them the blocks come in 16-byte copies. A launcher must keep them: the
library's pads d and d_v to multiples of 16 with zero columns and checks each value before a
launch (csrc/fused_cuda.cpp, csrc/fused_launch.cpp), as `plans._Call` does.
"""

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

INPUTS = {"Q", "K", "V", "O", "O2", "DO", "DQ", "DK", "DV_OUT", "QBAR"}
# The parameters each cubin takes as multiples of 16 (the pointers: 16-byte aligned): INPUTS, their
# batch, head and row strides, and the head dimensions.
ALIGNED = INPUTS | {"D", "DV"} | {f"stride_{t}{axis}" for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv", "qbar")
                                      for axis in "bhs"}
STATISTICS = {"C", "R", "R2", "G", "MASS", "DELTA", "CS", "RS", "GC", "GR", "RPOT", "CPOT", "COEF", "OUT", "SCALE", "BIAS",
              "PRIOR", "RB", "KS", "TROW", "DKL", "DA", "RD", "RS", "LOGU", "RHO_D", "RHO_S", "GU", "SHARES"}
MASKS = {"QPAD", "KPAD", "MASK", "BLOCKS"}
WORDS = {"DRAWS"}  # int64 tensors: the seed's words (draws given as a tensor are not compiled here)
# Constexprs with a value that leaves their feature off, where a specialization does not name them.
OFF = dict(NOISE=0, KL=0, DRAW64=False, MIX=False, ROWS=False, SHARE=False, ADD=False, CONTEXT=False, ATOMIC_DQ=False)
TRITON_TYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
# The products' input precision per dtype: TF32 for float32 (see above); for 16-bit inputs the
# precision changes nothing.
DOT = {"bfloat16": "tf32", "float16": "tf32", "float32": "tf32", "float64": "ieee"}
# The dynamic shared memory one block may opt into, per compute capability (the CUDA programming
# guide's table): a cubin for sm_80 runs on sm_86 and sm_89 too, which allow less.
SHARED_LIMIT = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}


def specializations(plans, smoke):
    """(kernel name, constexpr values without ACC/DOT/BLOCK_D/BLOCK_DV) to compile. `smoke`: one
    per kernel with every feature on (what the test suite compiles)."""
    flags = dict(HAS_QPAD=True, HAS_KPAD=True, HAS_MASK=True, HAS_BIAS=True)
    # Lognormal draws and its KL over HNAS (MIX): the widest code.
    bam = dict(NOISE=2, KL=2)
    if smoke:
        return [("_column_pass", dict(flags, CONTEXT=True)), ("_row_pass", dict(flags, SWEEPS=1, HYBRID=True, CAUSAL=False)),
                ("_row_pass", dict(flags, **bam, SWEEPS=1, HYBRID=False, CAUSAL=False, MIX=True)),
                ("_key_pass", dict(flags, **bam, SWEEPS=1, CAUSAL=False, GRADS=True, MIX=True)),
                ("_key_pass", dict(flags, SWEEPS=1, CAUSAL=False, GRADS=True, SHARE=True, ADD=True)),
                ("_key_pass", dict(flags, **bam, SWEEPS=0, CAUSAL=True, GRADS=True, ATOMIC_DQ=True)),
                ("_query_pass", dict(flags, SWEEPS=1, CAUSAL=False, SHARE=True, ADD=True)),
                ("_query_pass", dict(flags, **bam, SWEEPS=1, CAUSAL=False, MIX=True, ROWS=True)),
                ("_query_pass", dict(flags, **bam, SWEEPS=1, CAUSAL=False, MIX=True, ROWS=False)),
                ("_sink_reduce", dict(flags, COLUMNS=True, LSE=False, HAS_RPOT=True)),
                ("_sink_key_grads", dict(flags, **bam, STAGE=0)),
                ("_sink_key_grads", dict(flags, **bam, STAGE=1, ATOMIC_DQ=True)), ("_sink_query_grads", dict(flags, **bam))]
    out = []
    for qpad, kpad, mask in itertools.product((False, True), repeat=3):
        f = dict(HAS_QPAD=qpad, HAS_KPAD=kpad, HAS_MASK=mask, HAS_BIAS=False)
        out += [("_column_pass", dict(f, CONTEXT=context)) for context in (False, True)]
        for sweeps, hybrid, causal in ((0, False, False), (0, False, True), (1, False, False), (1, True, False)):
            out.append(("_row_pass", dict(f, SWEEPS=sweeps, HYBRID=hybrid, CAUSAL=causal)))
        for sweeps, causal in ((0, False), (0, True), (1, False)):
            for grads in (False, True):
                out.append(("_key_pass", dict(f, SWEEPS=sweeps, CAUSAL=causal, GRADS=grads)))
            out.append(("_query_pass", dict(f, SWEEPS=sweeps, CAUSAL=causal)))
            if sweeps == 0:  # softmax's dQ added by atomics from the key pass
                out.append(("_key_pass", dict(f, SWEEPS=0, CAUSAL=causal, GRADS=True, ATOMIC_DQ=True)))
    # BAM over softmax and DNAS with key padding: Weibull with its KL (BAM-WC), Lognormal with its
    # KL (BAM-LC).
    f = dict(HAS_QPAD=False, HAS_KPAD=True, HAS_MASK=False, HAS_BIAS=False)
    for sweeps, noise in itertools.product((0, 1), (1, 2)):
        bam = dict(f, NOISE=noise, KL=noise, SWEEPS=sweeps, CAUSAL=False)
        out += [("_row_pass", dict(bam, HYBRID=False)), ("_key_pass", dict(bam, GRADS=True)), ("_query_pass", bam)]
        if sweeps == 0:
            out.append(("_key_pass", dict(bam, GRADS=True, ATOMIC_DQ=True)))
    return out


# float32 has no set above this head dimension: at 256 its key pass needs more than sm_80's
# 163 KiB of shared memory a block with every block shape tried down to 32 × 32 (164 KiB).
FLOAT32_WIDEST = 128


def route_specializations(dtype="bfloat16", head_dim=64):
    """What the library's fused CUDA route launches (probattn-sys/csrc/fused_cuda.cpp) in `dtype`
    at `head_dim`.

    Unpadded, padded (key and query padding read together: a call with one passes no padding for
    the other) and masked (the paddings, a boolean pattern and an additive mask read together, each
    absent one passed as a stride-0 view of one neutral value): softmax (plain and causal), DNAS
    and HNAS (DNAS's row pass with softmax's accumulator beside it; its backward's passes take
    each branch's share of dO, the second adding to the first's gradients), forward and backward, with
    the key pass that gives the received mass alone, and Sinkhorn-N's passes (N a run-time
    argument: one set for every N ≥ 2).

    Padded only (a call without padding passes none; BAM's draws dwarf reading it): BAM's
    sampling, Weibull and Lognormal, each with its KL term and without one, over softmax (plain and
    causal), DNAS, HNAS and Sinkhorn-N, with the key pass that gives the sampled weights' received
    mass, on both sides of 2^32 score entries. Not
    in float32, whose set holds the deterministic plans alone (BAM in float32 runs on the tiles),
    up to FLOAT32_WIDEST.

    A test keeps this list and the launches of `plans.attention`, `plans.hybrid_attention` and
    `plans.bam_attention` for those calls the same (tests/fused_cuda.rs)."""
    out = []
    if dtype == "float32" and head_dim > FLOAT32_WIDEST:
        return out
    for padded, masked in ((False, False), (True, False), (True, True)):
        f = dict(HAS_QPAD=padded, HAS_KPAD=padded, HAS_MASK=masked, HAS_BIAS=masked)
        # with the queries' column mean for the key pass when a backward follows, without it when none does
        out += [("_column_pass", dict(f, CONTEXT=context)) for context in (False, True)]
        for sweeps, causal in ((0, False), (0, True), (1, False)):
            out.append(("_row_pass", dict(f, SWEEPS=sweeps, HYBRID=False, CAUSAL=causal)))
            for grads in (True, False):  # without gradients: the received mass, when a call asks for it
                out.append(("_key_pass", dict(f, SWEEPS=sweeps, CAUSAL=causal, GRADS=grads)))
            out.append(("_query_pass", dict(f, SWEEPS=sweeps, CAUSAL=causal)))
            out += _softmax_dq(dict(f, SWEEPS=sweeps, CAUSAL=causal), dtype, head_dim)
        out.append(("_row_pass", dict(f, SWEEPS=1, HYBRID=True, CAUSAL=False)))
        # HNAS's backward: each branch's key and query passes on its share of dO, softmax's adding
        # its gradients to DNAS's.
        for sweeps, add in ((1, False), (0, True)):
            out += [("_key_pass", dict(f, SWEEPS=sweeps, CAUSAL=False, GRADS=True, SHARE=True, ADD=add)),
                    ("_query_pass", dict(f, SWEEPS=sweeps, CAUSAL=False, SHARE=True, ADD=add))]
        # Sinkhorn-N: the forward's column (first, then after a row potential) and row reductions,
        # the backward's two reductions of the potentials' gradients, and its gradient stages (dQ
        # added by atomics from the dK/dV stage, or in a stage of its own where deterministic
        # algorithms are asked for).
        for columns, lse, rpot in ((True, True, False), (True, True, True), (False, True, False), (False, False, True),
                                   (True, False, True)):
            out.append(("_sink_reduce", dict(f, COLUMNS=columns, LSE=lse, HAS_RPOT=rpot)))
        out += _sink_stages(dict(f, NOISE=0, KL=0))
    if dtype == "float32":
        return out
    f = dict(HAS_QPAD=True, HAS_KPAD=True, HAS_MASK=False, HAS_BIAS=False)
    # Each noise with its own KL form (kl = noise) and without a KL term (kl = 0).
    draws = ((1, 1), (2, 2), (1, 0), (2, 0))
    for (sweeps, causal), (noise, kl) in itertools.product(((0, False), (0, True), (1, False)), draws):
        bam = dict(f, NOISE=noise, KL=kl, SWEEPS=sweeps, CAUSAL=causal)
        out += [("_row_pass", dict(bam, HYBRID=False)), ("_key_pass", dict(bam, GRADS=True)), ("_query_pass", bam)]
        out += _softmax_dq(bam, dtype, head_dim)
        if kl == noise:  # the sampled weights' received mass: the draws again, no KL term (it moves no weight)
            out.append(("_key_pass", dict(bam, KL=0, GRADS=False)))
    for noise, kl in draws:
        # Over HNAS: the mixture's row pass, the gate's per-row gradient, then the key and query passes.
        mix = dict(f, NOISE=noise, KL=kl, SWEEPS=1, CAUSAL=False, MIX=True)
        out += [("_row_pass", dict(mix, HYBRID=False)), ("_query_pass", dict(mix, ROWS=True)),
                ("_key_pass", dict(mix, GRADS=True)), ("_query_pass", mix)]
        if kl == noise:
            out.append(("_key_pass", dict(mix, KL=0, GRADS=False)))
        # Over Sinkhorn-N: the potentials as without noise, DNAS's row pass with the noise, and the
        # gradient stages with it.
        out += _sink_stages(dict(f, NOISE=noise, KL=kl))
    return out


def _softmax_dq(flags, dtype, head_dim):
    """Over softmax's base (no sweeps), where `settings.atomic_dq` says so: the key pass that adds dQ
    by atomics, which the route launches instead of the key and query passes unless deterministic
    algorithms are asked for."""
    from probattn_tools.kernels import settings

    atomic = flags["SWEEPS"] == 0 and settings.atomic_dq(dtype, head_dim)
    return [("_key_pass", dict(flags, GRADS=True, ATOMIC_DQ=True))] if atomic else []


def _sink_stages(flags):
    """Sinkhorn-N's gradient stages with `flags`: g's, dK/dV's with dQ by atomics and without,
    and dQ's own."""
    return ([("_sink_key_grads", dict(flags, STAGE=0, ATOMIC_DQ=False))]
            + [("_sink_key_grads", dict(flags, STAGE=1, ATOMIC_DQ=atomic)) for atomic in (True, False)]
            + [("_sink_query_grads", flags)])


def key(plans, name, constexprs):
    """The key `plans.specialization` gives a launch of `name` with `constexprs` (the features a
    specialization leaves unnamed are off, as `compile_one` compiles them)."""
    return plans.specialization(getattr(plans, name), dict(OFF, **constexprs))


def recorded(path):
    """The specializations of a `kernels.check --record` file, as (kernel name, constexprs)."""
    return [(e["kernel"], e["constexprs"]) for e in json.loads(Path(path).read_text())["launched"]]


def compile_one(triton, plans, name, constexprs, dtype, head_dim, arch, block_m, block_n, num_warps, num_stages):
    """One cubin and its manifest entry."""
    compiled, entry = compiled_one(triton, plans, name, constexprs, dtype, head_dim, arch, block_m, block_n, num_warps,
                                   num_stages)
    return compiled.asm["cubin"], entry


def compiled_one(triton, plans, name, constexprs, dtype, head_dim, arch, block_m, block_n, num_warps, num_stages,
                 aligned=True):
    """Triton's compiled kernel and its manifest entry; `aligned=False` leaves out the ALIGNED facts
    (what the manifest then says is not what was compiled: for `ptx_loads`'s comparison only)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from probattn_tools.kernels import settings

    kernel = getattr(plans, name)
    tl = triton.language
    acc = tl.float64 if dtype == "float64" else tl.float32
    values = dict(OFF, **constexprs, ACC=acc, DOT=DOT[dtype],
                  DRAW64=dtype == "float64", TRANSPOSE=settings.TRANSPOSE_KEYS,
                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=plans._block_dim(head_dim), BLOCK_DV=plans._block_dim(head_dim))
    signature, params, attrs = {}, [], {}
    stats = "fp64" if dtype == "float64" else "fp32"
    for i, p in enumerate(kernel.params):
        n = p.name
        if p.is_constexpr:
            signature[n] = "constexpr"
            values.setdefault(n, None)
            if values[n] is None:
                raise ValueError(f"{name}: no value for its constexpr {n}")
        elif n == "DQ" and values.get("ATOMIC_DQ"):  # dQ added by atomics, in the statistics' dtype
            signature[n] = f"*{stats}"
        elif n in INPUTS:
            signature[n] = f"*{TRITON_TYPE[dtype]}"
        elif n in STATISTICS:
            signature[n] = f"*{stats}"
        elif n in MASKS:
            signature[n] = "*u8"
        elif n in WORDS:
            signature[n] = "*i64"
        else:
            signature[n] = "i32"
        if not p.is_constexpr:
            params.append({"name": n, "type": signature[n], "divisible": 16 if n in ALIGNED else 1})
            if n in ALIGNED and aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    given = {n: v for n, v in values.items() if n in signature and signature[n] == "constexpr"}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(kernel.arg_names.index(n),): v for n, v in given.items()},
                       attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps,
                                                                                   "num_stages": num_stages})
    shown = {n: (str(v) if not isinstance(v, (bool, int, float, str)) else v) for n, v in given.items()}
    meta = compiled.metadata
    limit = SHARED_LIMIT.get(arch)
    if limit is not None and meta.shared > limit:
        raise ValueError(f"{name} for sm_{arch}, {dtype}, head dimension {head_dim}, {block_m} x {block_n} blocks and "
                         f"{num_stages} stages needs {meta.shared} bytes of shared memory; sm_{arch} allows {limit} per "
                         "block: choose smaller blocks or fewer stages (the tuning table, or --block-n/--num-stages)")
    entry = {"kernel": name, "arch": f"sm_{arch}", "dtype": dtype, "dot": values["DOT"], "head_dim": head_dim,
             "constexprs": shown,
             # the constexprs a launch chooses (those the dtype, head dimension and blocks fix left out)
             "key": dict(plans.specialization(kernel, values)[1]),
             "params": params, "num_warps": num_warps, "num_stages": num_stages, "block_m": block_m,
             "block_n": block_n, "shared_bytes": meta.shared, "symbol": meta.name,
             "global_scratch_bytes": getattr(meta, "global_scratch_size", 0),
             "profile_scratch_bytes": getattr(meta, "profile_scratch_size", 0)}
    return compiled, entry


def launch_setting(table, arch, dtype, head_dim, args, name=None, constexprs=None):
    """(block_m, block_n, num_warps, num_stages) for one architecture, dtype and head dimension,
    and with `name` and `constexprs` for that kernel's specialization: each flag given on the
    command line, else the tuning table's entry (the kernel's own setting where the entry names
    one, `settings.kernel_key`; a specialization that reads a block map takes the entry's, so that
    one map serves a call), float16 taking bfloat16's where it has none of its own (the same
    element size, the same shared memory), else the defaults (`settings.default`)."""
    from probattn_tools.kernels import settings

    constexprs = constexprs or {}
    kernel = None if name is None or constexprs.get("HAS_MASK") else settings.kernel_key(name, constexprs)
    tuned = (settings.lookup(table, arch, dtype, head_dim, kernel)
             or (dtype == "float16" and settings.lookup(table, arch, "bfloat16", head_dim, kernel))
             or settings.default(dtype, head_dim))
    given = (args.block_m, args.block_n, args.num_warps, args.num_stages)
    return tuple(g if g is not None else t for g, t in zip(given, tuned))


def _compile_job(job):
    """One `compile_one` in a worker process (imports its own Triton)."""
    import triton

    from probattn_tools.kernels import plans

    return compile_one(triton, plans, *job)


def _checked(pairs):
    """`pairs` as they come, a `compile_one` refusal (a cubin over its architecture's shared memory)
    ending the run with its message."""
    try:
        yield from pairs
    except ValueError as e:
        sys.exit(f"kernels.aot: {e}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the cubins and manifest.json")
    parser.add_argument("--arch", default="80,90", help="compute capabilities, comma-separated (80: A100, 90: H100/H200)")
    parser.add_argument("--dtypes", default="bfloat16,float16", help="comma-separated")
    parser.add_argument("--head-dims", default="64,128", help="comma-separated")
    parser.add_argument("--block-m", type=int, help="the query block (default: the tuning table's entry, else 64)")
    parser.add_argument("--block-n", type=int, help="the key block (default: the tuning table's entry, else 64)")
    parser.add_argument("--num-warps", type=int, help="default: the tuning table's entry, else 4")
    parser.add_argument("--num-stages", type=int, help="default: the tuning table's entry, else 2")
    parser.add_argument("--tuning", default=str(Path(__file__).with_name("tuning.json")),
                        help="the tuning table (kernels.sweep writes its entries); 'none': the defaults everywhere")
    parser.add_argument("--smoke", action="store_true", help="one specialization per kernel, every feature on")
    parser.add_argument("--set", help="compile the specializations of this `kernels.check --record` file instead of "
                                      "the default set")
    parser.add_argument("--route", action="store_true",
                        help="compile the set the library's fused CUDA route launches instead of the default set")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    parser.add_argument("--line-info", action="store_true",
                        help="keep source line information in the cubins (for ncu and compute-sanitizer; about 3x "
                             "their size)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("kernels.aot: unset TRITON_INTERPRET: the interpreter compiles nothing")
    # Read by Triton when it compiles; set before its import.
    os.environ["TRITON_DISABLE_LINE_INFO"] = "0" if args.line_info else "1"
    import triton

    from probattn_tools.kernels import plans

    if sum(map(bool, (args.set, args.route, args.smoke))) > 1:
        sys.exit("kernels.aot: --set, --route and --smoke each name a set; give one")
    if args.jobs < 1:
        sys.exit(f"kernels.aot: --jobs must be at least 1, got {args.jobs}")
    from probattn_tools.kernels import settings

    try:
        table = {"configs": {}} if args.tuning == "none" else settings.read_table(args.tuning)
    except (OSError, ValueError) as e:
        sys.exit(f"kernels.aot: the tuning table {args.tuning}: {e}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = []
    for arch, dtype, head_dim in itertools.product([int(a) for a in args.arch.split(",")], args.dtypes.split(","),
                                                   [int(d) for d in args.head_dims.split(",")]):
        if dtype not in TRITON_TYPE:
            sys.exit(f"kernels.aot: unknown dtype {dtype!r} (known: {', '.join(TRITON_TYPE)})")
        chosen = (recorded(args.set) if args.set else route_specializations(dtype, head_dim) if args.route
                  else specializations(plans, args.smoke))
        # softmax's key pass that adds dQ serves where settings.atomic_dq says so
        chosen = [(n, c) for n, c in chosen if not (c.get("ATOMIC_DQ") and n == "_key_pass"
                                                     and not settings.atomic_dq(dtype, head_dim))]
        jobs += [(name, constexprs, dtype, head_dim, arch, *launch_setting(table, arch, dtype, head_dim, args, name,
                                                                            constexprs))
                 for name, constexprs in chosen]
    entries, start = [], time.time()
    if args.jobs == 1:
        done = (compile_one(triton, plans, *job) for job in jobs)
    else:
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(args.jobs)
        done = pool.map(_compile_job, jobs)
    for (name, *_, arch, _bm, _bn, _w, _s), (cubin, entry) in _checked(zip(jobs, done)):
        entry["file"] = f"{name.strip('_')}-{len(entries):04d}-sm{arch}.cubin"
        (out / entry["file"]).write_bytes(cubin)
        entries.append(entry)
        print(f"[{len(entries)}/{len(jobs)}] sm_{arch} {entry['dtype']:8} d {entry['head_dim']:3} {name:13} "
              f"{entry['shared_bytes']:6} B shared  {len(cubin):7} B  {entry['key']}", flush=True)
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps({"triton": triton.__version__, "line_info": args.line_info, "entries": entries},
                              indent=1) + "\n")
    tmp.replace(out / "manifest.json")
    print(f"{len(entries)} cubins in {time.time() - start:.0f} s; manifest in {out / 'manifest.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What each kernel of the fused CUDA route costs a GPU, read from its cubin on a machine without
one: the kernels compiled as the ahead-of-time build compiles them (`aot.compiled_one`), then
`cuobjdump` (which Triton ships) for the registers a thread takes, the stack that holds what did
not fit in them (spills), and the SASS instructions that matter for speed, counted statically.

    python -m probattn_tools.kernels.resources                             # every kernel, bfloat16, d 64, sm_90
    python -m probattn_tools.kernels.resources --noise 2 --setting 64,32,4,2
    python -m probattn_tools.kernels.resources --kernel _row_pass --json out.json --markdown out.md
    python -m probattn_tools.kernels.resources --noise 0 --floor 32768   # and each plan's instruction floor
    python -m probattn_tools.kernels.resources --noise 0 --masks padding  # unpadded and padded forms

The counts are of instructions in the code, not of executions: the loop over key (or query)
blocks is compiled once, so a count in the loop's body is what one thread issues per tile.
`per entry` divides a count by the score entries a thread holds in a tile (BLOCK_M · BLOCK_N /
32 / num_warps): the whole kernel's instructions and float64 ones (what runs once per program
included), and those of the loop over tiles alone (`loop`: from its backward branch's target to
the branch), which is what a long sequence costs per score entry. Instruction kinds: HGMMA (Hopper's tensor-core products), HMMA (Ampere's), float64
(DFMA, DADD, DMUL), MUFU (the special-function unit: exp2, log2, reciprocal, square root),
LDGSTS (asynchronous copies to shared memory), LDL and STL (local memory, which spills use), and
what a reduction across warps or a change of a tile's layout costs: SHFL (shuffles between the
threads of a warp), STS (stores to shared memory), BAR (barriers) and WARPGROUP (the waits and
fences around Hopper's products).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

KINDS = ["HGMMA", "HMMA", "DFMA", "DADD", "DMUL", "MUFU", "LDGSTS", "LDL", "STL", "SHFL", "STS", "BAR", "WARPGROUP"]


def tools():
    """The path of Triton's cuobjdump, or SystemExit naming what is missing."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.access(path, os.X_OK):
        sys.exit(f"kernels.resources: no cuobjdump at {path} (Triton's NVIDIA backend ships it)")
    return path


def read_cubin(cuobjdump, cubin):
    """{registers, stack_bytes, KIND: count} of one cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+)\s+STACK:(\d+)", usage)
    if not found:
        raise RuntimeError(f"cuobjdump -res-usage gave no REG/STACK line:\n{usage}")
    out = {"registers": int(found.group(1)), "stack_bytes": int(found.group(2))}
    # An opcode is the first word of an instruction after its address and optional predicate
    # (`@P0`, `@!PT`); a branch's target is the first address among its operands.
    code = [(int(a, 16), op, rest) for a, op, rest in
            re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([^;]*);", sass)]
    opcodes = [op for _, op, _ in code]
    out["instructions"] = len(opcodes)
    for kind in KINDS:
        out[kind] = sum(1 for op in opcodes if op == kind)
    out.update(loop_counts(code))
    return out


def loop_counts(code):
    """{loop_instructions, loop_KIND: count} of the loop over tiles in the code, [(address,
    opcode, operands)]: of the loops (a backward branch's target to the branch) that hold a
    tensor-core product, the innermost, the largest if there are several. That is what a thread
    issues per tile. (The key pass's loop over a group's query heads holds it.) Where loops
    without a product lie inside it, as Sinkhorn-N's loop over the sweeps inside its gradient
    stages, also `inner_loop_instructions`: their bodies, which the tile's count holds once and a
    run repeats (`floors`). Empty without one."""
    every, loops = [], []
    for addr, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            every.append((lo, addr))
            if any(lo <= a <= addr and o in ("HGMMA", "HMMA") for a, o, _ in code):
                loops.append((lo, addr))
    innermost = [(lo, hi) for lo, hi in loops
                 if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in loops)]
    if not innermost:
        return {}
    lo, hi = max(innermost, key=lambda r: sum(1 for a, _, _ in code if r[0] <= a <= r[1]))
    best = [o for a, o, _ in code if lo <= a <= hi]
    out = {"loop_instructions": len(best), **{f"loop_{kind}": sum(1 for op in best if op == kind) for kind in KINDS}}
    inside = {(a, b) for a, b in every if lo <= a and b <= hi and (a, b) != (lo, hi)}
    outermost = [(a, b) for a, b in inside if not any(c <= a and b <= d and (c, d) != (a, b) for c, d in inside)]
    if outermost:
        out["inner_loop_instructions"] = sum(sum(1 for x, _, _ in code if a <= x <= b) for a, b in outermost)
    return out


# The passes of a forward and backward per plan, as the route launches them (fused_cuda.cpp; DNAS's
# and HNAS's column pass with CONTEXT, as a forward with a backward to follow runs it):
# (kernel, its specialization's constexprs that are set, as the rows show them), or with (launches,
# runs of the loops inside its tile loop) where those are not 1. The deterministic plans
# unpadded; BAM (over softmax, with its KL term) padded, as the route always runs it. Softmax and BAM
# over it: the key pass that adds dQ by atomics, and no query pass (the query pass, where
# deterministic algorithms are asked for, is left out).
# Sinkhorn-3: three column and two row reductions of the potentials, the last row pass (DNAS's),
# then stage 0 (g_j), two row and two column reductions of the potentials' gradients, and the dK/dV
# stage that adds dQ by atomics, whose loop over the earlier sweeps runs N − 1 = 2 times a tile
# (plans._forward, plans._backward; the stage of dQ's own, where deterministic algorithms are asked
# for, is left out).
_BAM = {"HAS_QPAD": True, "HAS_KPAD": True}
_N = 3
PLAN_PASSES = {
    "softmax": [("_row_pass", {}), ("_key_pass", {"GRADS": True, "ATOMIC_DQ": True})],
    "dnas": [("_column_pass", {"CONTEXT": True}), ("_row_pass", {"SWEEPS": 1}), ("_key_pass", {"SWEEPS": 1, "GRADS": True}),
             ("_query_pass", {"SWEEPS": 1})],
    "hnas": [("_column_pass", {"CONTEXT": True}), ("_row_pass", {"SWEEPS": 1, "HYBRID": True}),
             ("_key_pass", {"SWEEPS": 1, "GRADS": True, "SHARE": True}), ("_query_pass", {"SWEEPS": 1, "SHARE": True}),
             ("_key_pass", {"GRADS": True, "SHARE": True, "ADD": True}), ("_query_pass", {"SHARE": True, "ADD": True})],
    **{name: [("_row_pass", dict(_BAM, NOISE=n, KL=n)),
              ("_key_pass", dict(_BAM, NOISE=n, KL=n, GRADS=True, ATOMIC_DQ=True))]
       for name, n in (("bam-wc", 1), ("bam-lc", 2))},
    f"sinkhorn-{_N}": [("_sink_reduce", {"COLUMNS": True, "LSE": True}),
                       ("_sink_reduce", {"COLUMNS": True, "LSE": True, "HAS_RPOT": True}, _N - 1, 1),
                       ("_sink_reduce", {"LSE": True}, _N - 1, 1), ("_row_pass", {"SWEEPS": 1}),
                       ("_sink_key_grads", {}), ("_sink_reduce", {"HAS_RPOT": True}, _N - 1, 1),
                       ("_sink_reduce", {"COLUMNS": True, "HAS_RPOT": True}, _N - 1, 1),
                       ("_sink_key_grads", {"STAGE": 1, "ATOMIC_DQ": True}, 1, _N - 1)],
}
# Hopper (H100 and H200 SXM): 132 SMs at up to 1.98 GHz, 4 warp instructions issued per SM per clock.
SMS, CLOCK, ISSUE = 132, 1.98e9, 4


def floors(rows, seq, heads, batch=1):
    """{plan: {ms, per_entry, passes}}: the time the loops' instructions alone take for a forward and
    backward at B × H × S × S score entries, every scheduler issuing each clock, for each plan of
    PLAN_PASSES whose passes are among the rows. A lower bound on time, not an estimate: it counts
    no wait, and the tensor cores' work overlapped. (Float64 instructions, which Lognormal's draws
    take, issue at half the rate on their own pipe; at 73-76 of 260-440 an entry they do not
    bind.)"""
    def find(kernel, picks, launches=1, runs=1):
        """The pass's instructions per entry over its launches, its inner loops run `runs` times."""
        row = next((r for r in rows if r["kernel"] == kernel and r["constexprs"] == picks and "loop_per_entry" in r),
                   None)
        if row is None:
            return None
        inner = row.get("inner_loop_instructions", 0) / row["loop_instructions"] * row["loop_per_entry"]
        return round(launches * (row["loop_per_entry"] + (runs - 1) * inner), 1)
    out = {}
    for plan, passes in PLAN_PASSES.items():
        counts = [find(*p) for p in passes]
        if None in counts:
            continue
        per_entry = round(sum(counts), 1)
        ms = batch * heads * seq * seq * per_entry / 32 / (SMS * ISSUE * CLOCK) * 1e3
        out[plan] = {"ms": round(ms, 1), "per_entry": per_entry, "passes": [[p[0], n] for p, n in zip(passes, counts)]}
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--head-dim", type=int, default=64, choices=[64, 128, 256])
    parser.add_argument("--arch", type=int, default=90, choices=[80, 90])
    parser.add_argument("--setting", help="BLOCK_M,BLOCK_N,num_warps,num_stages (default: the build's, from "
                                          "tuning.json or the defaults)")
    parser.add_argument("--kernel", help="only this kernel (e.g. _row_pass)")
    parser.add_argument("--noise", type=int, choices=[0, 1, 2], help="only this noise (0 none, 1 Weibull, 2 Lognormal)")
    parser.add_argument("--masks", choices=("none", "padding", "all"), default="none",
                        help="the deterministic specializations counted: unpadded alone (none, the default), "
                             "padded too (padding), or padded and under a pattern or an additive mask too "
                             "(all); BAM's are always padded")
    parser.add_argument("--padded", action="store_true", help="the same as --masks all")
    parser.add_argument("--floor", type=int, metavar="S", help="also the time the loops' instructions alone take "
                                                                 "for each plan's forward and backward at sequence "
                                                                 "length S on an H100 or H200, a lower bound (the "
                                                                 "deterministic plans with --noise 0, BAM-WC and "
                                                                 "BAM-LC with --noise 1 and 2)")
    parser.add_argument("--heads", type=int, default=8, help="heads for --floor (batch 1)")
    parser.add_argument("--key-tiles", choices=("rows", "transposed"), default=None,
                        help="the key pass's tiles (queries x keys) or (keys x queries) (default: the build's, "
                             "settings.TRANSPOSE_KEYS)")
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--markdown", help="write the table to this file")
    args = parser.parse_args(argv)
    import triton

    from probattn_tools.baselines.precision_profile import scripts_provenance
    from probattn_tools.files import atomic_write_text
    from probattn_tools.kernels import aot, plans, settings

    given = None
    if args.setting:
        try:
            given = tuple(int(x) for x in args.setting.split(","))
        except ValueError:
            given = ()
        if len(given) != 4:
            sys.exit(f"kernels.resources: --setting takes BLOCK_M,BLOCK_N,num_warps,num_stages, got {args.setting!r}")
    if args.key_tiles is not None:  # what `aot.compiled_one` compiles the key pass with
        settings.TRANSPOSE_KEYS = args.key_tiles == "transposed"
    table = settings.read_table()
    # The build's setting of each kernel where none is given (`aot.launch_setting`).
    flags = argparse.Namespace(block_m=None, block_n=None, num_warps=None, num_stages=None)
    block_m, block_n, num_warps, num_stages = given or aot.launch_setting(table, args.arch, args.dtype, args.head_dim,
                                                                          flags)
    cuobjdump = tools()
    rows, seen = [], set()
    for name, constexprs in aot.route_specializations(args.dtype, args.head_dim):
        noise = constexprs.get("NOISE", 0)
        if args.kernel and name != args.kernel or args.noise is not None and noise != args.noise:
            continue
        masks = "all" if args.padded else args.masks
        if noise == 0 and (masks == "none" and constexprs.get("HAS_QPAD") or masks != "all" and (
                constexprs.get("HAS_MASK") or constexprs.get("HAS_BIAS"))):
            continue
        shown = {k: v for k, v in constexprs.items() if v not in (False, 0)}
        key = (name, tuple(sorted(shown.items())))
        if key in seen:
            continue
        seen.add(key)
        setting = given or aot.launch_setting(table, args.arch, args.dtype, args.head_dim, flags, name, constexprs)
        held = setting[0] * setting[1] / (32 * setting[2])
        try:
            compiled, entry = aot.compiled_one(triton, plans, name, constexprs, args.dtype, args.head_dim, args.arch,
                                               *setting)
        except ValueError as e:  # a setting past the architecture's shared memory, named by aot
            sys.exit(f"kernels.resources: {e}")
        row = {"kernel": name, "constexprs": shown, "setting": list(setting), "shared_bytes": entry["shared_bytes"]}
        row.update(read_cubin(cuobjdump, compiled.asm["cubin"]))
        row["instructions_per_entry"] = round(row["instructions"] / held, 1)
        row["float64_per_entry"] = round((row["DFMA"] + row["DADD"] + row["DMUL"]) / held, 1)
        if "loop_instructions" in row:
            row["loop_per_entry"] = round(row["loop_instructions"] / held, 1)
            row["loop_float64_per_entry"] = round((row["loop_DFMA"] + row["loop_DADD"] + row["loop_DMUL"]) / held, 1)
        rows.append(row)
        print(f"{name:18} {' '.join(f'{k}={v}' for k, v in shown.items()):60} regs {row['registers']:3} "
              f"spill stack {row['stack_bytes']:5} B, LDL/STL {row['LDL']}/{row['STL']}, instructions "
              f"{row['instructions_per_entry']}/entry (loop {row.get('loop_per_entry', '–')}), float64 "
              f"{row['float64_per_entry']}/entry, MUFU {row['MUFU']}, HGMMA {row['HGMMA']}", flush=True)
    if not rows:
        sys.exit("kernels.resources: no kernel of the route matches the filters")
    floor = floors(rows, args.floor, args.heads) if args.floor else {}
    if args.floor and not floor:
        sys.exit("kernels.resources: --floor needs all of a plan's passes (--noise 0, 1 or 2, no --kernel)")
    for plan, f in floor.items():
        print(f"floor {plan:8} S {args.floor}, H {args.heads}: {f['ms']} ms from {f['per_entry']} instructions per "
              f"entry ({', '.join(f'{k} {n}' for k, n in f['passes'])}) on {SMS} SMs at {CLOCK / 1e9} GHz")
    about = {"dtype": args.dtype, "head_dim": args.head_dim, "arch": f"sm_{args.arch}", "block_m": block_m,
             "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages,
             "key_tiles": "transposed" if settings.TRANSPOSE_KEYS else "rows", "triton": triton.__version__,
             "entries_per_thread": block_m * block_n / (32 * num_warps),
             "kernels_with_own_setting": sorted({f"{r['kernel']} {r['setting']}" for r in rows
                                                 if tuple(r["setting"]) != (block_m, block_n, num_warps, num_stages)}),
             **scripts_provenance()}
    if args.json:
        record = {"about": about, "rows": rows}
        if floor:
            record["floors"] = {"seq": args.floor, "heads": args.heads, "batch": 1, "sms": SMS, "clock_hz": CLOCK,
                                "issue_per_clock": ISSUE, "plans": floor}
        atomic_write_text(args.json, json.dumps(record, indent=1) + "\n")
    if args.markdown:
        lines = [f"{args.dtype}, head dimension {args.head_dim}, sm_{args.arch}, {block_m} x {block_n} blocks, "
                 f"{num_warps} warps, {num_stages} stages, key tiles {about['key_tiles']} "
                 f"(Triton {triton.__version__}); static SASS counts; kernels of "
                 f"{about['git_sha']}{' with changes' if about['git_dirty'] else ''}"
                 + (f"; kernels with their own setting: {', '.join(about['kernels_with_own_setting'])}"
                    if about["kernels_with_own_setting"] else ""), "",
                 "| kernel | specialization | registers | spill stack (B) | LDL / STL | shared (B) | HGMMA | MUFU | "
                 "instr. / entry | float64 instr. | float64 / entry | loop instr. / entry | loop float64 / entry |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            spec = ", ".join(f"{k}={v}" for k, v in r["constexprs"].items()) or "–"
            lines.append(f"| {r['kernel']} | {spec} | {r['registers']} | {r['stack_bytes']} | {r['LDL']} / {r['STL']} "
                         f"| {r['shared_bytes']} | {r['HGMMA'] or r['HMMA']} | {r['MUFU']} | {r['instructions_per_entry']} | "
                         f"{r['DFMA'] + r['DADD'] + r['DMUL']} | {r['float64_per_entry']} | "
                         f"{r.get('loop_per_entry', '–')} | {r.get('loop_float64_per_entry', '–')} |")
        atomic_write_text(args.markdown, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

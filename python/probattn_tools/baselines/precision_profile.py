"""Where a training step's time goes in float32 and in bfloat16: the PyTorch baseline of a
`probattn translate` run, profiled in both precisions, grouped by kind of operator.

`probattn_tools.baselines.translate --profile` trains the run's model for a fixed number of updates
under `torch.profiler` (CPU) and writes each operator's self time; this script runs it in turns,
f32 then bf16, sums the self times into the groups below per update, and adds the bound the
profile sets on bfloat16's gain: the float32 step with only its matrix products made as fast as
bfloat16 made them, everything else as it was. `--tables-only` writes the tables (and the summary's
figures) again from OUT's records.

    python -m probattn_tools.baselines.precision_profile --run RUN --updates 40 --threads 2 \\
        --out results/translate/precision/profile

RUN is a softmax Transformer run folder (config.json, tokenizer.json), as for the baseline. Writes
OUT/profile-<precision>.json (the baseline's records) and OUT/profile.md (the tables); refuses an
OUT that has them already.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from probattn_tools.files import atomic_write_text

PRECISIONS = ("f32", "bf16")

# Operator groups, by the profiler's operator names; the first group whose test matches takes it.
GROUPS = [
    ("matrix products (mm, addmm, bmm)", lambda op: op in {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}),
    ("attention kernels (flash, forward and backward)", lambda op: op.startswith("aten::_scaled_dot_product")),
    ("casts (copy_, _to_copy)", lambda op: op in {"aten::copy_", "aten::_to_copy", "aten::to"}),
    ("dropout masks (bernoulli_)", lambda op: op == "aten::bernoulli_"),
    ("log-softmax of the output, forward and backward",
     lambda op: op in {"aten::_log_softmax", "aten::_log_softmax_backward_data"}),
    ("layer norm, forward and backward", lambda op: op.startswith("aten::native_layer_norm")),
    ("autograd engine's own time", lambda op: op.startswith("autograd::")),
    ("everything else", lambda op: True),
]


def group_of(op):
    return next(name for name, test in GROUPS if test(op))


def profile(run, precision, updates, threads, out):
    path = out / f"profile-{precision}.json"
    cmd = [sys.executable, "-m", "probattn_tools.baselines.translate", "--run", str(run), "--max-updates", str(updates),
           "--threads", str(threads), "--precision", precision, "--profile", str(path)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())


def per_update_ms(record):
    groups = {name: 0.0 for name, _ in GROUPS}
    for op, stat in record["ops"].items():
        groups[group_of(op)] += stat["self_cpu_us"] / 1000 / record["updates"]
    return groups


def tables(records):
    """profile.md's text and the summary's figures, from the two precisions' records."""
    f32, bf16 = (per_update_ms(records[p]) for p in PRECISIONS)
    total = {p: sum(g.values()) for p, g in zip(PRECISIONS, (f32, bf16))}
    updates, threads = records["f32"]["updates"], records["f32"]["threads"]
    lines = [f"Profiled: {updates} updates in each precision, {threads} threads; self CPU time per update.", "",
             "| operators | f32 ms | share of f32 | bf16 ms | bf16 / f32 |", "|---|---|---|---|---|"]
    for name, _ in GROUPS:
        ratio = f"{bf16[name] / f32[name]:.2f}" if f32[name] else "–"
        lines.append(f"| {name} | {f32[name]:.0f} | {f32[name] / total['f32']:.0%} | {bf16[name]:.0f} | {ratio} |")
    lines.append(f"| all | {total['f32']:.0f} | 100% | {total['bf16']:.0f} | {total['bf16'] / total['f32']:.2f} |")
    lines += ["", "Wall time per update by phase (perf_counter around each, under the profiler):", "",
              "| phase | f32 ms | bf16 ms | bf16 / f32 |", "|---|---|---|---|"]
    for phase in records["f32"]["phase_seconds"]:
        a, b = (records[p]["phase_seconds"][phase] * 1000 / records[p]["updates"] for p in PRECISIONS)
        lines.append(f"| {phase} | {a:.0f} | {b:.0f} | {b / a:.2f} |")
    products, kernels = GROUPS[0][0], GROUPS[1][0]
    bound = total["f32"] / (total["f32"] - f32[products] + bf16[products])
    lines += ["", f"Matrix products are {f32[products] / total['f32']:.0%} of the float32 step and run "
              f"{f32[products] / bf16[products]:.2f}x faster in bfloat16; the attention kernels, "
              f"{f32[kernels] / total['f32']:.0%} of it, run {bf16[kernels] / f32[kernels]:.2f}x slower. With only the "
              f"products sped up so and everything else as in float32, bfloat16 would train {bound:.2f}x faster; "
              f"the profile measures {total['f32'] / total['bf16']:.2f}x.", ""]
    return "\n".join(lines), {"per_update_ms": {"f32": f32, "bf16": bf16}, "products_only_bound": bound,
                              "measured": total["f32"] / total["bf16"], "updates": updates, "threads": threads}


def scripts_provenance():
    """The commit of this script's tree, and whether its Python files differ from it."""
    here = Path(__file__).resolve().parent
    git = lambda *a: subprocess.run(["git", *a], cwd=here, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {"git_sha": git("rev-parse", "HEAD") or None, "git_dirty": bool(git("status", "--porcelain", "--", ".."))}


def write(out, text, summary):
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    atomic_write_text(out / "profile.md", text)
    print(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a softmax Transformer run folder of probattn translate (to profile)")
    parser.add_argument("--updates", type=int, default=40, help="updates profiled in each precision (default 40)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--tables-only", action="store_true",
                        help="profile nothing: write OUT's tables again from its profile-<precision>.json records")
    args = parser.parse_args()
    if args.tables_only:
        try:
            records = {p: json.loads((args.out / f"profile-{p}.json").read_text()) for p in PRECISIONS}
        except (OSError, ValueError) as e:
            sys.exit(f"error: {args.out}: {e}")
        text, summary = tables(records)
        kept = ("run", "pytorch", "provenance", "command")
        if (args.out / "summary.json").exists():
            old = json.loads((args.out / "summary.json").read_text())
            summary.update({k: v for k, v in old.items() if k in kept})
        write(args.out, text, summary)
        return
    if args.run is None:
        sys.exit("error: give --run (a translate run folder to profile), or --tables-only")
    if not (args.run / "config.json").is_file() or not (args.run / "tokenizer.json").is_file():
        sys.exit(f"error: {args.run} is not a translate run folder (it needs config.json and tokenizer.json)")
    if args.updates < 1:
        sys.exit("error: --updates must be at least 1")
    if (args.out / "profile.md").exists():
        sys.exit(f"error: {args.out} has a profile already; give another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    records = {p: profile(args.run, p, args.updates, args.threads, args.out) for p in PRECISIONS}
    text, summary = tables(records)
    import torch
    summary.update(run=str(args.run), pytorch=torch.__version__, provenance=scripts_provenance(),
                   command=" ".join([os.path.basename(sys.executable), "-m", __spec__.name] + sys.argv[1:]))
    write(args.out, text, summary)


if __name__ == "__main__":
    main()

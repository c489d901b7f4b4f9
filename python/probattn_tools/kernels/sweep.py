"""Tunes the kernels' launch settings on a GPU: times a small grid of block shapes, warps and
pipeline stages for the plans, forward and backward, and writes the fastest per architecture,
dtype and head dimension to the table that the ahead-of-time build reads (`tuning.json` beside
this file; `kernels.aot` compiles each embedded cubin with its entry, float16 with bfloat16's
where it has none of its own, and with the defaults where the table has neither).

    python -m probattn_tools.kernels.sweep --out results/cuda/DATE/sweep
    python -m probattn_tools.kernels.sweep --out DIR --dtypes bfloat16 --head-dims 64 --shape 1x4096
    python -m probattn_tools.kernels.sweep --merge DIR/table.json     # into tuning.json, on a machine that builds

Every setting of the grid runs every plan asked for (`--plans`; softmax, DNAS and BAM-WC by
default) at one shape, bfloat16 or float16, and is held to the default setting's output and gradients first: a
setting that fails to compile, runs out of shared memory or disagrees is recorded with the reason
and never chosen. The score of a setting is the sum over the plans of its median forward +
backward time (calls taking turns, as `kernels.bench` times them); the fastest is the entry's
common setting.

Each kernel's launches are also timed apart (CUDA events around each launch, `plans.timed`), per
`settings.kernel_key`: a kernel, with BAM's specializations (which draw their noise in the loop
over tiles) apart from the deterministic plans'. A kernel whose fastest setting beats the common
one's time for it by 3% or more takes that setting as its own: on an H200, 128 × 64 blocks sped
softmax and DNAS up by 6% at 1 × 16,384 and slowed BAM's passes 1.5-2.7×
(results/cuda/2026-11-30/), which one setting for every pass cannot serve. The kernels' own
settings together are held to the default's outputs and gradients and timed against the common
setting alone in one run; they join the entry (`kernels`) only where they are faster together.
`sweep.json` keeps every time, `table.json` the winners with the shape they were chosen at, and
`sweep.md` a table per (dtype, head dimension) with each setting's time relative to the default's
and each kernel's time per setting; all three are rewritten after each (dtype, head dimension),
so a sweep stopped at a time limit keeps what it finished.

Triton compiles a kernel the first time it is called, one at a time in the calling process, and
the grid holds some hundred kernels: on a GPU, `--jobs` worker processes first call every setting
once, side by side, which fills Triton's on-disk cache, and the timing process then finds them
compiled. The workers' calls are not timed.
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from probattn_tools.kernels.settings import DEFAULT, TABLE, read_table

# (block_m, block_n, num_warps, num_stages): the defaults first, then shapes FlashAttention-2 and
# Triton's fused-attention tutorial use on Ampere and Hopper, then deeper pipelines of them.
GRID = [DEFAULT, (64, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (64, 128, 4, 2), (128, 128, 8, 2),
        (64, 32, 4, 2), (64, 64, 4, 4), (128, 64, 4, 3), (128, 32, 4, 3), (128, 128, 8, 3)]
# Agreement with the default setting (a different block order changes the rounding of the
# online sums, nothing else).
TOLERANCE = {"bfloat16": 3e-2, "float16": 4e-3}


def _worst(errors):
    """The largest of the errors, NaN above every number (max() may pass over a NaN)."""
    return max(errors, key=lambda e: math.inf if math.isnan(e) else e)


def merge(table, found):
    """`table` with the entries of `found` (a sweep's table.json) added or replaced."""
    out = json.loads(json.dumps(table))
    for arch, dtypes in found["configs"].items():
        for dtype, dims in dtypes.items():
            out["configs"].setdefault(arch, {}).setdefault(dtype, {}).update(dims)
    return out


def errors_vs(fns, inputs, reference):
    """{plan: the largest error of one step's output and q, k and v's gradients against the
    default setting's `reference`, relative to the reference's largest magnitude (at least 1)}."""
    errors = {}
    for name, step in fns.items():
        out = step()
        ours = [t.detach().float() for t in (out, *(x.grad for x in inputs))]
        errors[name] = _worst(((a - r).abs().max() / r.abs().max().clamp_min(1.0)).item()
                              for a, r in zip(ours, reference[name]))
    return errors


def steps(torch, plans, names, q, k, v, grad, config):
    """A forward + backward per plan name, with `config`."""
    def plan_step(name):
        if name == "softmax":
            return lambda: plans.attention(q, k, v, sweeps=0, config=config)
        if name == "dnas":
            return lambda: plans.attention(q, k, v, sweeps=1, config=config)
        if name.startswith("sinkhorn-"):
            n = int(name.split("-")[1])
            return lambda: plans.attention(q, k, v, sweeps=n, config=config)
        if name == "hnas":
            logit = torch.zeros(q.shape[1], device=q.device, dtype=torch.float32)
            return lambda: plans.hybrid_attention(q, k, v, logit, config=config)
        if name in ("bam-wc", "bam-lc"):
            noise, scale = ("weibull", 0.1) if name == "bam-wc" else ("lognormal", 1.0)
            sampling = plans.Sampling(noise, scale, seed=1234, kl=noise)
            prior = torch.full((1, q.shape[1], 1, k.shape[2]), 1.0 / k.shape[2], device=q.device)
            return lambda: plans.bam_attention(q, k, v, sampling, sweeps=0, prior=prior, config=config)[0]
        raise ValueError(f"unknown plan {name!r} (softmax, dnas, hnas, sinkhorn-N, bam-wc, bam-lc)")

    def run(forward):
        def step():
            for t in (q, k, v):
                t.grad = None
            out = forward()
            out.backward(grad)
            return out
        return step
    return {name: run(plan_step(name)) for name in names}


def _inputs(torch, args, dtype_name, head_dim):
    """q, k, v (requiring gradients) and the output gradient at the sweep's shape, seeded."""
    dtype, device = getattr(torch, dtype_name), torch.device(args.device)
    b, s = (int(x) for x in args.shape.lower().split("x"))
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, args.heads, s, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_(True)
               for _ in range(3))
    grad = torch.randn(b, args.heads, s, head_dim, device=device, dtype=dtype, generator=gen)
    return q, k, v, grad


def _compile(args, dtype_name, head_dim, setting):
    """Calls every plan once with `setting`, so Triton compiles (and caches) its kernels; run in a
    worker process. A setting that fails here is left for the timing process to record."""
    import torch

    from probattn_tools.baselines.bench import error_line
    from probattn_tools.kernels import plans

    q, k, v, grad = _inputs(torch, args, dtype_name, head_dim)
    try:
        for step in steps(torch, plans, args.plans.split(","), q, k, v, grad, plans.Config(*setting)).values():
            step()
        if q.is_cuda:
            torch.cuda.synchronize()
    except Exception as e:  # the timing process records it
        return error_line(e)
    return None


def compile_grid(args, groups):
    """Compiles every (dtype, head dimension, setting) of the sweep in `args.jobs` processes."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    work = [(dtype, head_dim, setting) for dtype, head_dim in groups for setting in GRID[:args.settings]]
    start = time.time()
    try:
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            failed = sum(job.result() is not None for job in [pool.submit(_compile, args, *w) for w in work])
    except Exception as e:  # a worker that died (a crashed launch, say): the timing process compiles the rest
        print(f"compiling ahead stopped ({type(e).__name__}: {e}); the timing compiles what is left", flush=True)
        return
    print(f"compiled {len(work)} settings' kernels in {args.jobs} processes ({time.time() - start:.0f} s, "
          f"{failed} failed: recorded below)", flush=True)


def sweep_one(torch, plans, args, dtype_name, head_dim, rows):
    """Times the grid for one (dtype, head dimension); the winner's setting, or None."""
    from probattn_tools.baselines.bench import error_line, time_interleaved

    device = torch.device(args.device)
    q, k, v, grad = _inputs(torch, args, dtype_name, head_dim)
    names = args.plans.split(",")
    reference = {}
    for name, step in steps(torch, plans, names, q, k, v, grad, plans.Config(*DEFAULT)).items():
        out = step()
        reference[name] = [t.detach().float().clone() for t in (out, q.grad, k.grad, v.grad)]
    candidates, timed = [], []
    for setting in GRID[:args.settings]:
        row = {"dtype": dtype_name, "head_dim": head_dim, "shape": args.shape, "heads": args.heads,
               "block_m": setting[0], "block_n": setting[1], "num_warps": setting[2], "num_stages": setting[3]}
        rows.append(row)
        try:
            fns = steps(torch, plans, names, q, k, v, grad, plans.Config(*setting))
            row["max_error_vs_default"] = errors = errors_vs(fns, (q, k, v), reference)
            worst = _worst(errors.values())
            if not worst <= TOLERANCE[dtype_name]:
                row["refused"] = f"disagrees with the default setting by {worst:.2e}"
                continue
            candidates.append((row, fns))
        except Exception as e:  # recorded; the other settings go on
            row["refused"] = error_line(e)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for row, fns in candidates:
        timed += [(row, name, fn) for name, fn in fns.items()]
    results = time_interleaved([fn for _, _, fn in timed], args.repeats, device)
    for (row, name, _), (med, iqr) in zip(timed, results):
        row.setdefault("ms", {})[name] = med
        row.setdefault("iqr_ms", {})[name] = iqr
    for row, fns in candidates:
        row["score_ms"] = sum(row["ms"].values())
        row["kernel_ms"] = kernel_times(plans, fns, args.repeats)
    if not candidates:
        return None
    best = min((row for row, _ in candidates), key=lambda r: r["score_ms"])
    default = next((r for r, _ in candidates if setting_of(r) == DEFAULT), None)
    for row, _ in candidates:
        if default is not None:
            row["vs_default"] = row["score_ms"] / default["score_ms"]
    own = own_settings([row for row, _ in candidates], best)
    together = own and try_own(torch, plans, args, names, (q, k, v, grad), reference, best, own, default, rows)
    if together:  # the kernels' own settings beside the common one, and the score of the two together
        best["own"] = {key: tuple(s) for key, s in together["kernels"].items()}
        best["own_score_ms"], best["own_vs_default"] = together["score_ms"], together.get("vs_default")
    return best


def table_entry(best, args, device_name):
    """A tuning table's entry for the winning row of `sweep_one`: its setting, the kernels' own
    beside it where it has them (`kernels`), the score they were chosen by and where."""
    fields = ("block_m", "block_n", "num_warps", "num_stages")
    entry = {k: best[k] for k in fields} | {
        "score_ms": best["score_ms"], "vs_default": best.get("vs_default"), "shape": args.shape, "heads": args.heads,
        "plans": args.plans, "device": device_name}
    if best.get("own"):
        entry["kernels"] = {key: dict(zip(fields, setting)) for key, setting in best["own"].items()}
        entry.update(score_ms=best["own_score_ms"], vs_default=best["own_vs_default"])
    return entry


def setting_of(row):
    return row["block_m"], row["block_n"], row["num_warps"], row["num_stages"]


def kernel_times(plans, fns, repeats):
    """{settings.kernel_key: median ms per forward + backward} of the plans' steps `fns`, each
    kernel's launches timed apart (`plans.timed`), summed over the plans that launch it."""
    out = {}
    for fn in fns.values():
        runs = []
        for _ in range(repeats):
            with plans.timed() as times:
                fn()
            runs.append(times)
        for key in runs[0]:
            series = sorted(r.get(key, 0.0) for r in runs)
            out[key] = out.get(key, 0.0) + series[len(series) // 2]
    return out


# A kernel takes a setting of its own only where that setting's time for it is at least this much
# below the common setting's (the timings' spread on one GPU is a few percent).
OWN_GAIN = 0.97


def own_settings(rows, common):
    """{kernel_key: row} of the kernels whose fastest setting among the timed `rows` beats the
    `common` setting's row for them by OWN_GAIN."""
    own = {}
    for key, ms in common["kernel_ms"].items():
        fastest = min((r for r in rows if key in r["kernel_ms"]), key=lambda r: r["kernel_ms"][key])
        if setting_of(fastest) != setting_of(common) and fastest["kernel_ms"][key] <= OWN_GAIN * ms:
            own[key] = fastest
    return own


def try_own(torch, plans, args, names, inputs, reference, common, own, default, rows):
    """The kernels' own settings `own` beside the `common` setting, held to the default's output and
    gradients and timed against the common setting alone in one interleaved run. The combination's
    row joins `rows`, and is returned where the two together are faster (None otherwise)."""
    from probattn_tools.baselines.bench import error_line, time_interleaved

    kernels = {key: setting_of(r) for key, r in own.items()}
    row = {"dtype": common["dtype"], "head_dim": common["head_dim"], "shape": args.shape, "heads": args.heads,
           **dict(zip(("block_m", "block_n", "num_warps", "num_stages"), setting_of(common))),
           "kernels": {key: list(s) for key, s in kernels.items()}}
    rows.append(row)
    q, k, v, grad = inputs
    try:
        mixed = steps(torch, plans, names, q, k, v, grad, plans.Config(*setting_of(common), kernels=kernels))
        alone = steps(torch, plans, names, q, k, v, grad, plans.Config(*setting_of(common)))
        row["max_error_vs_default"] = errors = errors_vs(mixed, (q, k, v), reference)
        if not _worst(errors.values()) <= TOLERANCE[common["dtype"]]:
            row["refused"] = f"disagrees with the default setting by {_worst(errors.values()):.2e}"
            return None
        timed = time_interleaved([*mixed.values(), *alone.values()], args.repeats, torch.device(args.device))
    except Exception as e:  # recorded; the common setting stands
        row["refused"] = error_line(e)
        return None
    row["ms"] = {name: med for name, (med, _) in zip(mixed, timed)}
    row["score_ms"] = sum(row["ms"].values())
    row["common_score_ms"] = sum(med for med, _ in timed[len(mixed):])
    if default is not None:
        row["vs_default"] = row["score_ms"] / default["score_ms"]
    row["vs_common"] = row["score_ms"] / row["common_score_ms"]
    return row if row["score_ms"] < row["common_score_ms"] else None


def markdown(rows, arch, device):
    lines = [f"# Launch settings on {device}" + (f" (sm_{arch})" if arch else ""), "",
             "Forward + backward, median ms per plan; the score is their sum; × default is the score over the "
             "default setting's (64 × 64 blocks, 4 warps, 2 stages).", ""]
    groups = {}
    for r in rows:
        groups.setdefault((r["dtype"], r["head_dim"]), []).append(r)
    for (dtype, head_dim), group in groups.items():
        plans = sorted({p for r in group for p in r.get("ms", {})})
        lines += [f"## {dtype}, head dimension {head_dim}, B × S {group[0]['shape']}, {group[0]['heads']} heads", "",
                  "| block_m | block_n | warps | stages | " + " | ".join(plans) + " | score | × default |",
                  "|---" * (6 + len(plans)) + "|"]
        for r in sorted(group, key=lambda r: r.get("score_ms", float("inf"))):
            cells = [str(r[k]) for k in ("block_m", "block_n", "num_warps", "num_stages")]
            if r.get("kernels"):
                cells[-1] += " + own: " + ", ".join(f"{key} {'/'.join(map(str, s))}" for key, s in r["kernels"].items())
            if "refused" in r:
                lines.append("| " + " | ".join(cells) + f" | refused: {r['refused']} |")
                continue
            cells += [f"{r['ms'][p]:.3f}" for p in plans] + [f"{r['score_ms']:.3f}", f"{r.get('vs_default', float('nan')):.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
        timed = [r for r in group if r.get("kernel_ms")]
        keys = sorted({key for r in timed for key in r["kernel_ms"]})
        if keys:
            lines += ["", "Each kernel's median ms per forward + backward, summed over the plans that launch it "
                      "(CUDA events around each launch; wall time under the interpreter):", "",
                      "| block_m | block_n | warps | stages | " + " | ".join(keys) + " |", "|---" * (4 + len(keys)) + "|"]
            for r in timed:
                lines.append("| " + " | ".join(str(r[k]) for k in ("block_m", "block_n", "num_warps", "num_stages"))
                             + " | " + " | ".join(f"{r['kernel_ms'][k]:.3f}" if k in r["kernel_ms"] else "–"
                                                  for k in keys) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for sweep.json, sweep.md and table.json")
    parser.add_argument("--shape", default="1x4096", help="B x S the settings are timed at")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dims", default="64,128", help="comma-separated")
    parser.add_argument("--dtypes", default="bfloat16", help="comma-separated (float16 takes bfloat16's entry where "
                                                                 "it has none of its own)")
    parser.add_argument("--plans", default="softmax,dnas,bam-wc", help="comma-separated: softmax, dnas, hnas, "
                                                                        "sinkhorn-N, bam-wc, bam-lc")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--settings", type=int, default=len(GRID), help=f"the first N settings of the grid (of {len(GRID)})")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                        help="processes that compile the grid's kernels before the timing (cuda only; 1: none)")
    parser.add_argument("--device", default="cuda", help="cuda; cpu runs the sweep's logic under Triton's interpreter "
                                                        "(TRITON_INTERPRET=1; float16 only; its times mean nothing)")
    parser.add_argument("--merge", help="merge this sweep's table.json into tuning.json instead of sweeping")
    args = parser.parse_args(argv)
    if args.merge:
        merged = merge(read_table(), read_table(args.merge))
        tmp = TABLE.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
        tmp.replace(TABLE)
        print(f"merged {args.merge} into {TABLE}")
        return 0
    if not args.out:
        parser.error("--out is required (or --merge)")
    import torch

    from probattn_tools.baselines.precision_profile import scripts_provenance
    from probattn_tools.kernels import plans

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("kernels.sweep: needs a CUDA GPU: it times the kernels")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("kernels.sweep: --device cpu runs under Triton's interpreter: set TRITON_INTERPRET=1")
    if args.device not in ("cuda", "cpu"):
        sys.exit(f"kernels.sweep: --device is cuda or cpu, got {args.device!r}")
    if not 1 <= args.settings <= len(GRID):
        sys.exit(f"kernels.sweep: --settings is 1 to {len(GRID)}, got {args.settings}")
    unknown = [d for d in args.dtypes.split(",") if d not in TOLERANCE]
    if unknown:
        sys.exit(f"kernels.sweep: unknown dtype(s) {unknown} (the kernels' table holds {', '.join(TOLERANCE)})")
    major, minor = torch.cuda.get_device_capability() if args.device == "cuda" else (0, 0)
    arch = major * 10 + minor
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "the CPU, under Triton's interpreter"
    if args.jobs < 1:
        sys.exit(f"kernels.sweep: --jobs is 1 or more, got {args.jobs}")
    rows, found, start = [], {"configs": {}}, time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def write():
        record = {"provenance": scripts_provenance(), "device": device_name, "arch": f"sm_{arch}",
                  "torch": torch.__version__, "settings": vars(args), "grid": GRID, "seconds": time.time() - start,
                  "rows": rows}
        for name, text in (("sweep.json", json.dumps(record, indent=1) + "\n"),
                           ("table.json", json.dumps(found, indent=1) + "\n"),
                           ("sweep.md", markdown(rows, arch, device_name) + "\n")):
            tmp = out / (name + ".tmp")
            tmp.write_text(text)
            tmp.replace(out / name)

    groups = [(dtype, int(d)) for dtype in args.dtypes.split(",") for d in args.head_dims.split(",")]
    if args.device == "cuda" and args.jobs > 1:
        compile_grid(args, groups)
    for dtype, head_dim in groups:
        best = sweep_one(torch, plans, args, dtype, head_dim, rows)
        if args.device == "cuda":  # the interpreter's times choose nothing
            if best is None:
                print(f"sm_{arch} {dtype} d {head_dim}: no setting ran", flush=True)
            else:
                entry = table_entry(best, args, device_name)
                found["configs"].setdefault(f"sm_{arch}", {}).setdefault(dtype, {})[str(head_dim)] = entry
                own = "".join(f"; {key} {s[0]} × {s[1]}, {s[2]} warps, {s[3]} stages"
                              for key, s in (best.get("own") or {}).items())
                print(f"sm_{arch} {dtype} d {head_dim}: {best['block_m']} × {best['block_n']}, {best['num_warps']} "
                      f"warps, {best['num_stages']} stages{own}: {entry['score_ms']:.3f} ms, "
                      f"{entry.get('vs_default') or float('nan'):.2f}× the default's", flush=True)
        write()
    print(f"wrote {out}/sweep.json, sweep.md and table.json ({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

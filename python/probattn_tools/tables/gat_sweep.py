"""Choose the BAM presets of `probattn gat` on validation accuracy only.

A greedy search, sized for 2 CPU cores, on tuning seeds that the reported runs do not use
(100, 101): the Weibull shape k is chosen on bam-nokl (k in 10, 100, 1000) and shared by the
Weibull variants, which then choose their KL weight (0.1 or 1); the Lognormal variants choose
sigma (0.1, 0.5, 1) at KL weight 1. Each choice is the highest mean validation accuracy (ties: the
first in grid order). Test accuracy is recorded by `probattn gat` but never read here. Finished
settings (their results.json exists) are reused when the sweep is run again.

    python -m probattn_tools.tables.gat_sweep --bin target/release/probattn --dataset cora --out results/gat/sweep-cora

`--variant V --grid name=v1,v2 ...` instead tries the full grid for one variant (a wider search
after the greedy one), with `--jobs` runs at a time:

    python -m probattn_tools.tables.gat_sweep --dataset cora --variant bam-wc --seeds 3 --jobs 2 \
        --grid k=100,1000 kl_weight=0.01,0.1,1 prior_beta=0.1,1,10 --out results/gat/sweep-wide-cora

The bam-wc presets come from a third grid, reaching stronger noise (smaller k) and KL weights
up to 10, on four tuning seeds (100-103):

    python -m probattn_tools.tables.gat_sweep --dataset cora --variant bam-wc --seeds 4 --jobs 2 \
        --grid k=10,30,100 kl_weight=0.03,0.1,0.3,1,3,10 prior_beta=10 --out results/gat/sweep-kl-cora
"""

import argparse
from concurrent.futures import ThreadPoolExecutor
import itertools
import json
import os
import subprocess
import sys

from probattn_tools.files import atomic_write_json
from probattn_tools.reference import variants


def grid(variant, chosen):
    """The settings tried for `variant`, given the choices already made."""
    if variant == "bam-nokl":
        return {"k": [10, 100, 1000]}
    if variant in ("bam-wf", "bam-wc"):
        return {"k": [chosen["bam-nokl"]["setting"]["k"]], "kl_weight": [0.1, 1.0]}
    return {"sigma": [0.1, 0.5, 1.0], "kl_weight": [1.0]}


# The registry's BAM variants, bam-nokl first: it chooses the Weibull shape the others share.
VARIANTS = sorted(variants.examples(family="bayesian"), key=lambda v: v != "bam-nokl")


def run_setting(args, variant, setting):
    """Runs (or reuses) one setting on the tuning seeds; returns its mean validation accuracy."""
    tag = "-".join(f"{k}{v}" for k, v in setting.items())
    out = os.path.join(args.out, f"{variant}-{tag}")
    cmd = [args.bin, "gat", "--dataset", args.dataset, "--attention", variant, "--seeds", str(args.seeds),
           "--seed-start", str(args.seed_start), "--threads", str(args.threads), "--device", "cpu", "--out", out]
    for k, v in setting.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    if not os.path.exists(os.path.join(out, "results.json")):
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "results.json")) as f:
        val = json.load(f)["val_acc_mean"]
    print(f"{args.dataset} {variant} {setting}: val acc {val:.4f}", file=sys.stderr, flush=True)
    return val


def parse_value(v):
    """A grid value: a number as a float, anything else (a prior scope) as it is."""
    try:
        return float(v)
    except ValueError:
        return v


def parse_grid(items):
    """`name=v1,v2` items into {name: [values]} (numbers as floats)."""
    grid = {}
    for item in items:
        name, _, values = item.partition("=")
        if not values:
            sys.exit(f"--grid takes name=v1,v2,..., got {item!r}")
        grid[name] = [parse_value(v) for v in values.split(",")]
    return grid


def full_grid(args):
    """Every setting of `--grid` for `--variant`; the best on mean validation accuracy wins."""
    g = parse_grid(args.grid)
    settings = [dict(zip(g, values)) for values in itertools.product(*g.values())]
    with ThreadPoolExecutor(args.jobs) as pool:
        vals = list(pool.map(lambda s: run_setting(args, args.variant, s), settings))
    tried = [{"variant": args.variant, "setting": s, "val_acc_mean": v} for s, v in zip(settings, vals)]
    best = max(tried, key=lambda t: t["val_acc_mean"])  # first in grid order on ties
    summary = {"dataset": args.dataset, "seeds": list(range(args.seed_start, args.seed_start + args.seeds)),
               "selection": "highest mean validation accuracy", "grid": g,
               "chosen": {args.variant: {"setting": best["setting"], "val_acc_mean": best["val_acc_mean"]}},
               "tried": tried}
    atomic_write_json(os.path.join(args.out, "sweep.json"), summary)
    print(json.dumps(summary["chosen"], indent=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", default="target/release/probattn")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--seed-start", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variant", help="with --grid: the one variant to search")
    parser.add_argument("--grid", nargs="+", help="name=v1,v2 ... (k, sigma, kl_weight, prior_beta, prior_scope)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (with --grid)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.grid or args.variant:
        if not (args.grid and args.variant):
            sys.exit("--grid and --variant go together")
        return full_grid(args)
    chosen, tried = {}, []
    for variant in VARIANTS:
        g = grid(variant, chosen)
        best = None
        for values in itertools.product(*g.values()):
            setting = dict(zip(g, values))
            val = run_setting(args, variant, setting)
            tried.append({"variant": variant, "setting": setting, "val_acc_mean": val})
            if best is None or val > best[1]:
                best = (setting, val)
        chosen[variant] = {"setting": best[0], "val_acc_mean": best[1]}
    summary = {"dataset": args.dataset, "seeds": list(range(args.seed_start, args.seed_start + args.seeds)),
               "selection": "highest mean validation accuracy", "chosen": chosen, "tried": tried}
    atomic_write_json(os.path.join(args.out, "sweep.json"), summary)
    print(json.dumps(chosen, indent=1))


if __name__ == "__main__":
    main()

"""Choose the BAM presets of `probattn gat` on validation accuracy only.

For each BAM variant, runs a small grid (Weibull: k x KL weight; Lognormal: sigma x KL weight;
bam-nokl: k) on tuning seeds that the reported runs do not use (100, 101), and picks per variant
the setting with the highest mean validation accuracy (ties: the first in grid order). Test
accuracy is recorded by `probattn gat` but never read here.

    python python/gat_sweep.py --bin target/release/probattn --dataset cora --out results/gat/sweep-cora
"""

import argparse
import itertools
import json
import os
import subprocess
import sys

GRID = {
    "bam-nokl": {"k": [10, 100, 1000]},
    "bam-wf": {"k": [10, 100, 1000], "kl_weight": [0.1, 1.0]},
    "bam-wc": {"k": [10, 100, 1000], "kl_weight": [0.1, 1.0]},
    "bam-lf": {"sigma": [0.1, 0.5, 1.0], "kl_weight": [0.1, 1.0]},
    "bam-lc": {"sigma": [0.1, 0.5, 1.0], "kl_weight": [0.1, 1.0]},
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", default="target/release/probattn")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--seed-start", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", nargs="+", default=list(GRID))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    chosen, tried = {}, []
    for variant in args.variants:
        grid = GRID[variant]
        best = None
        for values in itertools.product(*grid.values()):
            setting = dict(zip(grid, values))
            tag = "-".join(f"{k}{v}" for k, v in setting.items())
            out = os.path.join(args.out, f"{variant}-{tag}")
            cmd = [args.bin, "gat", "--dataset", args.dataset, "--attention", variant, "--seeds", str(args.seeds),
                   "--seed-start", str(args.seed_start), "--threads", str(args.threads), "--device", "cpu", "--out", out]
            for k, v in setting.items():
                cmd += [f"--{k.replace('_', '-')}", str(v)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            with open(os.path.join(out, "results.json")) as f:
                val = json.load(f)["val_acc_mean"]
            print(f"{args.dataset} {variant} {setting}: val acc {val:.4f}", file=sys.stderr, flush=True)
            tried.append({"variant": variant, "setting": setting, "val_acc_mean": val})
            if best is None or val > best[1]:
                best = (setting, val)
        chosen[variant] = {"setting": best[0], "val_acc_mean": best[1]}
    summary = {"dataset": args.dataset, "seeds": list(range(args.seed_start, args.seed_start + args.seeds)),
               "selection": "highest mean validation accuracy", "chosen": chosen, "tried": tried}
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(chosen, indent=1))


if __name__ == "__main__":
    main()

"""The Table 1 of the BAM paper from `probattn gat` results: one row per attention variant, one
column per dataset, test accuracy mean ± std over seeds (and the per-epoch time).

    python -m probattn_tools.tables.gat results/gat        # reads results/gat/<dataset>/<variant>/results.json

With several folders, the runs of each variant are pooled across them (e.g. seeds 0-9 and 10-19);
`n` says how many runs each cell has:

    python -m probattn_tools.tables.gat results/gat results/gat/seeds-10-19

Rows are the variants in the table's order, then any other folder found under a dataset (e.g.
`bam-wc-neighbourhood`, a prior scope). `--diff` adds a second table: each row minus softmax on
the same dataset, with the standard error of the difference, sqrt(s1²/n1 + s2²/n2).
"""

import argparse
import json
import os
import statistics
import sys

from probattn_tools.reference import variants
from probattn_tools.tables.common import cell, diff_cell, markdown

ORDER = variants.examples()  # the registry's order: softmax, dnas, hnas, sinkhorn-3, the five BAM
PAPER = {  # BAM paper Table 1 (5 runs; GAT row is their rerun) and the GAT paper (100 runs)
    "softmax": {"cora": "83.00 (GAT paper 83.0 ± 0.7)", "citeseer": "72.50 (GAT paper 72.5 ± 0.7)"},
    "bam-nokl": {"cora": "83.39", "citeseer": "72.91"},
    "bam-lf": {"cora": "83.24", "citeseer": "72.86"},
    "bam-lc": {"cora": "83.34", "citeseer": "73.04"},
    "bam-wf": {"cora": "83.48", "citeseer": "73.18"},
    "bam-wc": {"cora": "83.81", "citeseer": "73.52"},
}


def runs_of(roots, d, variant):
    paths = [os.path.join(r, d, variant, "results.json") for r in roots]
    runs = [run for p in paths if os.path.exists(p) for run in json.load(open(p))["runs"]]
    seeds = [run["seed"] for run in runs]
    if len(set(seeds)) != len(seeds):
        sys.exit(f"tables.gat: {d} {variant}: the folders repeat seeds {sorted(seeds)}; pool distinct seeds only")
    return runs


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m probattn_tools.tables.gat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("roots", nargs="*", default=["results/gat"], metavar="DIR",
                        help="folders of probattn gat results (default results/gat)")
    parser.add_argument("--diff", action="store_true", help="each variant minus softmax, ± standard error")
    args = parser.parse_args(argv)
    diff, roots = args.diff, args.roots
    for r in roots:
        if not os.path.isdir(r):
            sys.exit(f"tables.gat: {r} is not a folder of probattn gat results")
    datasets = [d for d in ("cora", "citeseer", "pubmed") if any(os.path.isdir(os.path.join(r, d)) for r in roots)]
    rows = []
    header = ["attention"] + [h for d in datasets for h in (f"{d} test acc % (mean ± std)", f"{d} paper", f"{d} ms/epoch")]
    extra = sorted({v for r in roots for d in datasets if os.path.isdir(os.path.join(r, d))
                    for v in os.listdir(os.path.join(r, d))
                    if v not in ORDER and os.path.exists(os.path.join(r, d, v, "results.json"))})
    variants = ORDER + extra
    for variant in variants:
        cells = [variant]
        for d in datasets:
            runs = runs_of(roots, d, variant)
            if not runs:
                cells += ["–", PAPER.get(variant, {}).get(d, "–"), "–"]
                continue
            cells.append(cell([100 * run["test_acc"] for run in runs]))
            cells.append(PAPER.get(variant, {}).get(d, "–"))
            cells.append(f"{statistics.mean(run['epoch_ms'] for run in runs):.1f}")
        rows.append(cells)
    print(markdown(header, rows))
    if diff:
        acc = lambda d, v: [100 * run["test_acc"] for run in runs_of(roots, d, v)]
        diffs = [[v] + [diff_cell(acc(d, v), acc(d, "softmax")) for d in datasets] for v in variants if v != "softmax"]
        print()
        print(markdown(["attention"] + [f"{d}: minus softmax (± standard error), points" for d in datasets], diffs))


if __name__ == "__main__":
    main()

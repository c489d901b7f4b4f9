"""The Table 1 of the BAM paper from `probattn gat` results: one row per attention variant, one
column per dataset, test accuracy mean ± std over seeds (and the per-epoch time).

    python python/gat_table.py results/gat        # reads results/gat/<dataset>/<variant>/results.json
"""

import json
import os
import sys

ORDER = ["softmax", "dnas", "hnas", "sinkhorn-3", "bam-nokl", "bam-lf", "bam-lc", "bam-wf", "bam-wc"]
PAPER = {  # BAM paper Table 1 (5 runs; GAT row is their rerun) and the GAT paper (100 runs)
    "softmax": {"cora": "83.00 (GAT paper 83.0 ± 0.7)", "citeseer": "72.50 (GAT paper 72.5 ± 0.7)"},
    "bam-nokl": {"cora": "83.39", "citeseer": "72.91"},
    "bam-lf": {"cora": "83.24", "citeseer": "72.86"},
    "bam-lc": {"cora": "83.34", "citeseer": "73.04"},
    "bam-wf": {"cora": "83.48", "citeseer": "73.18"},
    "bam-wc": {"cora": "83.81", "citeseer": "73.52"},
}


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "results/gat"
    datasets = [d for d in ("cora", "citeseer", "pubmed") if os.path.isdir(os.path.join(root, d))]
    rows = []
    header = "| attention | " + " | ".join(f"{d} test acc % (mean ± std) | {d} paper | {d} ms/epoch" for d in datasets) + " |"
    rows.append(header)
    rows.append("|---" * (1 + 3 * len(datasets)) + "|")
    for variant in ORDER:
        cells = [variant]
        for d in datasets:
            path = os.path.join(root, d, variant, "results.json")
            if not os.path.exists(path):
                cells += ["–", PAPER.get(variant, {}).get(d, "–"), "–"]
                continue
            r = json.load(open(path))
            cells.append(f"{100 * r['test_acc_mean']:.2f} ± {100 * r['test_acc_std']:.2f} (n={len(r['runs'])})")
            cells.append(PAPER.get(variant, {}).get(d, "–"))
            cells.append(f"{r['epoch_ms_mean']:.1f}")
        rows.append("| " + " | ".join(cells) + " |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

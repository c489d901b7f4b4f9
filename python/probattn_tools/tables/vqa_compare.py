"""Two sets of `probattn vqa` runs compared seed by seed: OTHER − BASE for every fusion and seed
that both hold, on validation (what a choice between recipes may look at) or on test:

    python -m probattn_tools.tables.vqa_compare BASE OTHER [--split val|test]

BASE and OTHER are folders holding results.json or run folders that do (one per fusion and
seed, as the Sort-of-CLEVR tables keep them; folders further down are not read). Cells: the paired difference in points, mean ± standard error
and on how many seeds OTHER is above; then the mean difference per question type. On validation
the per-type accuracies are those of each run's kept epoch (metrics.jsonl), and relational /
non-relational are the plain means of their types' accuracies (metrics.jsonl has no counts);
on test they are results.json's, weighted by questions.
"""

import argparse
import glob
import json
import os
import statistics

from probattn_tools.tables.common import markdown, paired_cell

ORDER = ["none", "softmax", "dnas", "hnas"]
# Sort-of-CLEVR's relational question types (its meta.json `relational_types`; results.json
# holds only the test accuracy over them, so validation's grouping is named here).
RELATIONAL = ("closest", "count", "furthest")


def runs(root):
    """(fusion, seed) → {"overall", "relational", "nonrelational", per type} in %, both splits."""
    found = {}
    for path in sorted(glob.glob(os.path.join(root, "results.json")) + glob.glob(os.path.join(root, "*", "results.json"))):
        r = json.load(open(path))
        metrics = os.path.join(os.path.dirname(path), "metrics.jsonl")
        rows = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
        for run in r["runs"]:
            key = (r["fusion"], run["seed"])
            if key in found:
                raise SystemExit(f"{root} holds fusion {key[0]} seed {key[1]} twice (second: {path})")
            test = {t: 100 * a for t, a in run["test_acc_by_type"].items()}
            test.update(overall=100 * run["test_acc"])
            if run.get("test_acc_relational") is not None:
                test.update(relational=100 * run["test_acc_relational"], nonrelational=100 * run["test_acc_nonrelational"])
            kept = [m for m in rows if m["seed"] == run["seed"] and m["epoch"] == run["best_epoch"] and "val_acc_by_type" in m]
            val = {"overall": 100 * run["val_acc"]}
            if kept:
                by_type = {t: 100 * a for t, a in kept[0]["val_acc_by_type"].items()}
                val.update(by_type)
                if run.get("test_acc_relational") is not None:
                    val["relational"] = statistics.mean(by_type[t] for t in RELATIONAL)
                    val["nonrelational"] = statistics.mean(a for t, a in by_type.items() if t not in RELATIONAL)
            found[key] = {"val": val, "test": test}
    if not found:
        raise SystemExit(f"{root}: no results.json in it or in the folders inside it")
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base")
    p.add_argument("other")
    p.add_argument("--split", choices=["val", "test"], default="val")
    args = p.parse_args()
    base, other = runs(args.base), runs(args.other)
    shared = sorted(set(base) & set(other), key=lambda k: (ORDER.index(k[0]) if k[0] in ORDER else len(ORDER), k[0], k[1]))
    if not shared:
        raise SystemExit(f"no fusion and seed is in both {args.base} and {args.other}")
    fusions = list(dict.fromkeys(f for f, _ in shared))
    types = sorted({t for k in shared for t in other[k][args.split]} - {"overall", "relational", "nonrelational"})
    header = ["fusion (seeds)", "overall", "relational", "non-relational"] + types
    rows = []
    for f in fusions:
        seeds = [s for g, s in shared if g == f]
        def values(field):  # seed → value, on the seeds where both sides have the field
            have = [s for s in seeds if field in other[(f, s)][args.split] and field in base[(f, s)][args.split]]
            return {s: other[(f, s)][args.split][field] for s in have}, {s: base[(f, s)][args.split][field] for s in have}

        def pair(field):
            a, b = values(field)
            if len(a) == 1:
                return "".join(f"{a[s] - b[s]:+.2f} (seed {s})" for s in a)
            return paired_cell(a, b) if a else "–"

        def mean_diff(field):
            a, b = values(field)
            return f"{statistics.mean(a[s] - b[s] for s in a):+.1f}" if a else "–"

        rows.append([f"{f} ({' '.join(map(str, seeds))})"] + [pair(c) for c in ("overall", "relational", "nonrelational")] + [mean_diff(t) for t in types])
    print(f"{args.split}: {args.other} − {args.base}, points, paired by seed\n")
    print(markdown(header, rows))


if __name__ == "__main__":
    main()

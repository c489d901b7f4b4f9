"""The VQA table from `probattn vqa` result folders (any number; each holds results.json, or one
folder per fusion as --fusion all writes):

    python -m probattn_tools.tables.vqa results/vqa/sort-of-clevr/*/ [--diff softmax]

Rows in Table 1's order (none, softmax, dnas), then the others. Cells: test accuracy (overall,
relational, non-relational, per question type) as mean ± std over seeds in %, the share of
ε-explained-away secondary boxes (mass < 1e-8) and the least mass × keys, HNAS's final u, and for
stochastic fusions PAvPU (t-test p > 0.05) and ECE, clean / noisy. --diff F adds each fusion's
difference from F with its standard error, unpaired (difference of means) and paired by seed (the
same seed gives every fusion the same data order and initial draws up to the fusion itself), and,
where every run has the uncertainty report, the paired differences of PAvPU and noisy accuracy.
--val prints instead one row per run with its settings (BAM k, KL weight) and its validation
measures, clean and noisy: the table a stochastic fusion's settings are chosen on.
"""

import argparse
import glob
import json
import os

from probattn_tools.tables.common import cell, diff_cell, markdown, mean_std, paired_cell

ORDER = ["none", "softmax", "dnas", "hnas"]


def result_paths(folders):
    """Each folder's results.json, or its subfolders' (--fusion all writes one per fusion)."""
    for folder in folders:
        own = os.path.join(folder, "results.json")
        yield from [own] if os.path.exists(own) else sorted(glob.glob(os.path.join(folder, "*", "results.json")))


def collect(folders):
    by_fusion = {}
    for path in result_paths(folders):
        r = json.load(open(path))
        by_fusion.setdefault(r["fusion"], []).extend(r["runs"])
    return dict(sorted(by_fusion.items(), key=lambda kv: (ORDER.index(kv[0]) if kv[0] in ORDER else len(ORDER), kv[0])))


def val_rows(folders):
    """One row per run: its folder, settings and validation measures (no test number)."""
    rows = []
    for path in result_paths(folders):
        config = json.load(open(os.path.join(os.path.dirname(path), "config.json")))
        bam = config["model"]["normalizer"]["bam"]
        results = json.load(open(path))
        fusion = results["fusion"]
        k, kl = (f"{bam['k']:g}", f"{config['kl_weight']:g}") if fusion.startswith("bam") else ("–", "–")
        for r in results["runs"]:
            val = (r.get("uncertainty") or {}).get("val")
            m = lambda side, key: f"{100 * val[side][key]:.2f}" if val else "–"
            rows.append([os.path.dirname(path), fusion, k, kl, str(r["seed"]),
                         f"{100 * r['val_acc']:.2f}", m("clean", "pavpu_05"), m("noisy", "accuracy"), m("noisy", "pavpu_05"), m("noisy", "uncertain_05")])
    return rows


def pct(values):
    return cell([100 * v for v in values]) if values else "–"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+")
    p.add_argument("--diff", help="a fusion to subtract (e.g. softmax)")
    p.add_argument("--val", action="store_true", help="one row per run: settings and validation measures")
    args = p.parse_args()
    if args.val:
        rows = val_rows(args.folders)
        if not rows:
            raise SystemExit("error: no results.json under " + ", ".join(args.folders))
        print(markdown(["run", "fusion", "k", "KL weight", "seed", "val acc (%)", "val PAvPU clean (%)", "val noisy acc (%)",
                        "val PAvPU noisy (%)", "val noisy uncertain (%)"], rows))
        return
    runs = collect(args.folders)
    if not runs:
        raise SystemExit("error: no results.json under " + ", ".join(args.folders))
    types = sorted({t for rs in runs.values() for r in rs for t in r["test_acc_by_type"]})
    rows = []
    for fusion, rs in runs.items():
        ea = [r["explained_away"] for r in rs if r.get("explained_away")]
        mc = [r["uncertainty"] for r in rs if r.get("uncertainty")]
        u = [x for r in rs if r.get("hnas_u") for x in r["hnas_u"]]
        rows.append([
            fusion,
            pct([r["test_acc"] for r in rs]),
            pct([r["test_acc_relational"] for r in rs if r.get("test_acc_relational") is not None]),
            pct([r["test_acc_nonrelational"] for r in rs if r.get("test_acc_nonrelational") is not None]),
            *[f"{100 * mean_std([r['test_acc_by_type'][t] for r in rs])[0]:.1f}" for t in types],
            f"{100 * mean_std([e['share_below_1e8'] for e in ea])[0]:.1f}" if ea else "–",
            f"{min(e['min_mass_times_keys'] for e in ea):.3g}" if ea else "–",
            f"{min(u):.2f}-{max(u):.2f}" if u else "–",
            f"{100 * mean_std([m['clean']['pavpu_05'] for m in mc])[0]:.1f} / {100 * mean_std([m['noisy']['pavpu_05'] for m in mc])[0]:.1f}" if mc else "–",
            f"{mean_std([m['clean']['ece'] for m in mc])[0]:.3f} / {mean_std([m['noisy']['ece'] for m in mc])[0]:.3f}" if mc else "–",
            " ".join(str(r["seed"]) for r in rs),
            f"{mean_std([r['epoch_seconds'] for r in rs])[0]:.0f}",
        ])
    print(markdown(["fusion", "test acc (%)", "relational (%)", "non-relational (%)", *types, "ε-explained-away (%)", "min mass × keys",
                    "HNAS u", "PAvPU clean / noisy (%)", "ECE clean / noisy", "seeds", "s/epoch"], rows))
    if args.diff and args.diff in runs:
        base = runs[args.diff]
        others = [(fusion, rs) for fusion, rs in runs.items() if fusion != args.diff]
        keys = ("test_acc", "test_acc_relational", "test_acc_nonrelational")

        def paired(rs, value):
            """value(run) × 100, fusion minus base, paired by seed."""
            return paired_cell({r["seed"]: 100 * value(r) for r in rs}, {r["seed"]: 100 * value(r) for r in base})

        # easy-VQA and VQA-v2 have no relational split: those cells are None there
        diff_rows, paired_rows = [], []
        for fusion, rs in others:
            present = [k for k in keys if all(r.get(k) is not None for r in rs + base)]
            diff_rows.append([fusion] + [diff_cell([100 * r[k] for r in rs], [100 * r[k] for r in base]) if k in present else "–" for k in keys])
            paired_rows.append([fusion] + [paired(rs, lambda r: r[k]) if k in present else "–" for k in keys])
        print()
        print(markdown([f"fusion minus {args.diff} (points ± s.e.)", "test acc", "relational", "non-relational"], diff_rows))
        print()
        print(markdown([f"fusion minus {args.diff}, paired by seed (points ± s.e.)", "test acc", "relational", "non-relational"], paired_rows))
        # BAM §4.2's comparison: the noisy half of every fusion of one seed is on the same noise draw
        mc_keys = [("clean", "pavpu_05"), ("noisy", "pavpu_05"), ("noisy", "accuracy")]
        mc_rows = [[fusion] + [paired(rs, lambda r: r["uncertainty"][side][k]) for side, k in mc_keys]
                   for fusion, rs in others if all(r.get("uncertainty") for r in rs + base)]
        if mc_rows:
            print()
            print(markdown([f"fusion minus {args.diff}, paired by seed (points ± s.e.)", "PAvPU clean (p > 0.05)", "PAvPU noisy (p > 0.05)", "noisy accuracy"], mc_rows))

if __name__ == "__main__":
    main()

"""bfloat16 against float32 from run folders (`--precision`): one row per experiment and
attention variant, the test score's mean ± std over seeds in each precision, their difference
and whether it lies within float32's seed spread (one std).

    python -m probattn_tools.tables.precision results/gat/precision results/translate/precision

Reads every `results.json` below the folders given: `probattn gat` runs (test accuracy, %) and
`probattn translate` runs (test sacreBLEU). A run's precision is its config's (`f32` when a
config predates the flag).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from probattn_tools.tables.common import markdown


def score(results):
    """(experiment, per-seed test scores) of one results.json."""
    if "test_acc_mean" in results:
        return f"gat {results['dataset']}", [100 * r["test_acc"] for r in results["runs"]]
    if "test_bleu_mean" in results:
        return f"translate {results['dataset']}", [r["test_bleu"] for r in results["runs"]]
    return None, None


def mean_std(values):
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+")
    args = parser.parse_args()
    groups = {}
    for folder in args.folders:
        for path in sorted(Path(folder).rglob("results.json")):
            results = json.loads(path.read_text())
            experiment, scores = score(results)
            if experiment is None:
                continue
            precision = results["config"].get("precision", "f32")
            groups.setdefault((experiment, results["attention"]), {}).setdefault(precision, []).extend(scores)
    if not groups:
        sys.exit(f"error: no gat or translate results.json under {args.folders}")
    rows = []
    for (experiment, attention), by in sorted(groups.items()):
        if "f32" not in by or "bf16" not in by:
            continue
        (m32, s32), (m16, s16) = mean_std(by["f32"]), mean_std(by["bf16"])
        diff = m16 - m32
        rows.append([experiment, attention, f"{m32:.2f} ± {s32:.2f} ({len(by['f32'])})", f"{m16:.2f} ± {s16:.2f} ({len(by['bf16'])})",
                     f"{diff:+.2f}", "yes" if abs(diff) <= s32 else "no"])
    header = ["experiment", "attention", "f32 test (mean ± std, n)", "bf16 test (mean ± std, n)", "bf16 − f32", "within f32's std"]
    print(markdown(header, rows))


if __name__ == "__main__":
    main()

"""The repulsive-attention tuning table from `probattn translate` runs on a tuning seed:
one row per run folder, validation only, MA (the folder `ma`) as the reference.

    python -m probattn_tools.tables.rma_tuning results/translate/rma-tuning [ma svgd-first-a0.01 ...]
    python -m probattn_tools.tables.rma_tuning --reference results/translate/rma-tuning/ma results/translate/bam-tuning/transformer

With folder names after the root, rows come in that order; otherwise every run folder, MA first.
`--reference DIR` takes the reference row (the `− MA` column) from DIR instead of the root's `ma`
(the BAM grids compare with the softmax run of their tuning seed). The LSTM's encoder has
no attention heads: its Dist column is `–`.
Columns: best validation sacreBLEU (the checkpoint-selection measure) and its difference to MA's;
the epoch that reached it; the median seconds per epoch (the median, because single epochs vary
with what else shares the machine) and its ratio to MA's; the encoder self-attention's head
diversity "Dist" per layer and its mean, at the selected checkpoint (measured on the test
sources: a diagnostic that no choice reads). Test BLEU, which every run also records, is not read.
"""

import json
import os
import statistics
import sys


def load(folder):
    """(name, metrics lines, run) of the one-seed run in `folder`."""
    path = os.path.join(folder, "results.json")
    if not os.path.isfile(path):
        sys.exit(f"tables.rma_tuning: {folder} has no results.json (a run still going, or not a run folder)")
    results = json.load(open(path))
    runs = results.get("runs", [])
    if len(runs) != 1 or "head_diversity" not in runs[0]:
        sys.exit(f"tables.rma_tuning: {path} is not a one-seed probattn translate result")
    seed = runs[0]["seed"]
    metrics_path = os.path.join(folder, f"seed-{seed}", "metrics.jsonl")
    lines = [json.loads(l) for l in open(metrics_path) if l.strip()]
    return os.path.basename(os.path.normpath(folder)), lines, runs[0]


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    reference_dir = None
    if argv[0] == "--reference":
        if len(argv) < 3:
            sys.exit("tables.rma_tuning: --reference needs a run folder, then the root")
        reference_dir, argv = argv[1], argv[2:]
    root, names = argv[0], argv[1:]
    if not os.path.isdir(root):
        sys.exit(f"tables.rma_tuning: {root} is not a folder")
    if not names:
        found = sorted(d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "results.json")))
        names = (["ma"] if "ma" in found else []) + [d for d in found if d != "ma"]
    rows = [load(os.path.join(root, n)) for n in names]
    reference = (load(reference_dir) if reference_dir else None) or next((r for r in rows if r[0] == "ma"), None) \
        or load(os.path.join(root, "ma"))
    if reference_dir:
        rows = [reference] + [r for r in rows if r[0] != reference[0]]
    seeds = {r[2]["seed"] for r in rows} | {reference[2]["seed"]}
    if len(seeds) != 1:
        sys.exit(f"tables.rma_tuning: the runs use different seeds {sorted(seeds)}; compare runs of one tuning seed")
    ref_bleu = max(m["valid_bleu"] for m in reference[1])
    ref_seconds = statistics.median(m["seconds"] for m in reference[1])
    ref = "MA" if reference[0] == "ma" else reference[0]
    print(f"| name | best valid sacreBLEU | − {ref} | best epoch | median s / epoch (vs {ref}) | Dist (encoder, per layer → mean) |")
    print("|---|---|---|---|---|---|")
    for name, lines, run in rows:
        best = max(lines, key=lambda m: m["valid_bleu"])  # the first epoch at the maximum, as the run keeps it
        seconds = statistics.median(m["seconds"] for m in lines)
        dist = run["head_diversity"]
        layers = " / ".join(f"{d:.2f}" for d in dist) + f" → {statistics.mean(dist):.3f}" if dist else "–"
        is_ref = name == reference[0]
        delta = "–" if is_ref else f"{best['valid_bleu'] - ref_bleu:+.2f}".replace("-", "−")
        ratio = "" if is_ref else f" ({seconds / ref_seconds:.2f})"
        print(f"| {name} | {best['valid_bleu']:.2f} | {delta} | {best['epoch']} of {len(lines)} | {seconds:.1f}{ratio} | {layers} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

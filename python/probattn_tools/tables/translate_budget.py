"""The translation budget check: runs trained for longer than the table's 13 epochs,
each set beside the table's run of the same attention and seed, the first pair being MA.

    python -m probattn_tools.tables.translate_budget LONG=SHORT [LONG=SHORT ...]

e.g. `results/translate/budget/softmax-e26-s1=results/translate/multi30k-softmax-seed1`. Prints
three markdown blocks:

1. Repetition: the long run's first epochs against the short run's, field by field (train loss,
   validation loss and BLEU): the learning-rate schedule does not depend on `--max-epochs`, so
   they should agree up to float32 rounding.
2. Validation sacreBLEU per epoch for every long run, and each one's difference to the first.
3. Test BLEU, tok-lc and sacreBLEU, each with the run's difference to the first run: the short
   run's (its selected checkpoint); the long run's own checkpoint at the short budget, when its
   seed folder holds `test-epochN.json` (that checkpoint decoded with `probattn translate
   --decode` and scored with `probattn bleu`); and the long run's (the best validation epoch
   of all of them).

A long run still going (no results.json yet) is shown with the epochs it has finished and
"running" for its test BLEU; such a table is a progress view, not a result.
"""

import json
import os
import sys

from probattn_tools.tables.common import markdown

FIELDS = ("train_loss", "valid_loss", "valid_bleu")


def load(folder):
    """(seed folder, metrics lines, the run's results entry or None while it is still going) of a
    one-seed run."""
    path = os.path.join(folder, "results.json")
    run = None
    if os.path.isfile(path):
        runs = json.load(open(path)).get("runs", [])
        if len(runs) != 1:
            sys.exit(f"tables.translate_budget: {path} is not a one-seed probattn translate result")
        run = runs[0]
    seeds = [d for d in sorted(os.listdir(folder)) if d.startswith("seed-")] if os.path.isdir(folder) else []
    if len(seeds) != 1:
        sys.exit(f"tables.translate_budget: {folder} should hold one seed-N folder (found {len(seeds)})")
    metrics = os.path.join(folder, seeds[0], "metrics.jsonl")
    if not os.path.isfile(metrics):
        sys.exit(f"tables.translate_budget: {metrics} is missing")
    lines = [json.loads(line) for line in open(metrics) if line.strip()]
    return os.path.join(folder, seeds[0]), lines, run


def at_epoch(seed_dir, epoch):
    """The test BLEU of a run's own checkpoint at `epoch` (test-epochN.json), or None."""
    path = os.path.join(seed_dir, f"test-epoch{epoch}.json")
    if not os.path.isfile(path):
        return None
    scored = json.load(open(path))
    if scored.get("epoch") != epoch:
        sys.exit(f"tables.translate_budget: {path} is for epoch {scored.get('epoch')}, not {epoch}")
    return scored


def name(folder):
    return os.path.basename(os.path.normpath(folder))


def minus(x):
    return f"{x:+.2f}".replace("-", "−")


def best(lines):
    """The first epoch at the highest validation BLEU, as a run keeps its checkpoint."""
    return max(lines, key=lambda m: m["valid_bleu"])


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    pairs = []
    for arg in argv:
        if "=" not in arg:
            sys.exit(f"tables.translate_budget: '{arg}' is not LONG=SHORT")
        long_dir, short_dir = arg.split("=", 1)
        (long_seed, long_lines, long_run), (_, short_lines, short_run) = load(long_dir), load(short_dir)
        if short_run is None:
            sys.exit(f"tables.translate_budget: {short_dir} has no results.json; the short run must be finished")
        own = at_epoch(long_seed, len(short_lines))
        pairs.append((name(long_dir), long_lines, long_run, short_lines, short_run, own))

    print("Repetition of the short runs' epochs (largest |difference| over the shared epochs):\n")
    rows = []
    for label, long_lines, _, short_lines, _, _ in pairs:
        shared = min(len(long_lines), len(short_lines))
        diffs = [max(abs(a[f] - b[f]) for a, b in zip(long_lines[:shared], short_lines[:shared])) for f in FIELDS] if shared else []
        rows.append([label, f"{shared} of {len(short_lines)}"] + ([f"{d:.2e}" for d in diffs] or [""] * len(FIELDS)))
    print(markdown(["run", "shared epochs", *FIELDS], rows))

    ref = pairs[0]
    print("\nValidation sacreBLEU per epoch (the checkpoint-selection measure):\n")
    rows = []
    for e in range(max(len(p[1]) for p in pairs)):
        cells = [f"{p[1][e]['valid_bleu']:.2f}" if e < len(p[1]) else "" for p in pairs]
        deltas = [minus(p[1][e]["valid_bleu"] - ref[1][e]["valid_bleu"]) if e < min(len(p[1]), len(ref[1])) else "" for p in pairs[1:]]
        rows.append([e + 1] + cells + deltas)
    print(markdown(["epoch"] + [p[0] for p in pairs] + [f"{p[0]} − {ref[0]}" for p in pairs[1:]], rows))

    def cell(run, ref_run):
        """'tok-lc / sacreBLEU', each with its difference to the reference in brackets."""
        if run is None:
            return "–"
        out = []
        for key in ("test_bleu_tok", "test_bleu"):
            delta = "" if ref_run is None or ref_run is run else f" ({minus(run[key] - ref_run[key])})"
            out.append(f"{run[key]:.2f}{delta}")
        return " / ".join(out)

    short_epochs = len(ref[3])
    print("\nTest BLEU (Multi30k test_2016_flickr), tok-lc / sacreBLEU:\n")
    rows = []
    for label, long_lines, long_run, short_lines, short_run, own in pairs:
        if long_run:
            long_best = f"{len(long_lines)}, {long_run['best_epoch']}"
        else:
            long_best = f"{len(long_lines)} so far, best {best(long_lines)['epoch']}" if long_lines else "none yet"
        rows.append([label, cell(short_run, ref[4]), cell(own, ref[5]), long_best, cell(long_run, ref[2]) if long_run else "running"])
    header = ["run", f"short run ({short_epochs} epochs)", f"long run's own epoch {short_epochs}", "long run (epochs, best)", "long run's best"]
    print(markdown(header, rows))
    print(f"\nIn brackets: the run minus {ref[0]} at the same budget.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

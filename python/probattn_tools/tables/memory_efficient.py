"""Eager against memory-efficient training, from run folders named NAME-eager and
NAME-memory-efficient (and, where present, NAME-eager-2threads: the same eager run on two threads,
whose difference from the one-thread run is what float32 summation order alone does).

    python -m probattn_tools.tables.memory_efficient results/memory-efficient

One row per NAME: for translate runs the validation loss after the first epoch, for VQA runs the
first epoch's training loss (VQA writes no validation loss), each side and their relative
difference; then the last epoch's value and the final test score (translate: test sacreBLEU; VQA:
test accuracy) of both sides.
"""

import json
import os
import sys

from probattn_tools.tables.common import markdown


def load(folder):
    """(kind, metrics lines, run) of a one-seed translate or VQA run folder."""
    results = json.load(open(os.path.join(folder, "results.json")))
    run = results["runs"][0]
    translate = os.path.isfile(os.path.join(folder, f"seed-{run['seed']}", "metrics.jsonl"))
    path = os.path.join(folder, f"seed-{run['seed']}", "metrics.jsonl") if translate else os.path.join(folder, "metrics.jsonl")
    lines = [json.loads(l) for l in open(path) if l.strip()]
    return ("translate" if translate else "vqa"), lines, run


def measure(kind, lines, run):
    """(first-epoch value, last-epoch value, test score)."""
    key = "valid_loss" if kind == "translate" else "train_loss"
    test = run["test_bleu"] if kind == "translate" else run["test_acc"]
    return lines[0][key], lines[-1][key], test


def relative(a, b):
    return f"{abs(a - b) / abs(a):.1e}"


def main(argv):
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    root = argv[0]
    if not os.path.isdir(root):
        sys.exit(f"tables.memory_efficient: {root} is not a folder")
    names = sorted(d[: -len("-eager")] for d in os.listdir(root) if d.endswith("-eager"))
    rows = []
    for name in names:
        me = os.path.join(root, f"{name}-memory-efficient")
        if not os.path.isfile(os.path.join(me, "results.json")):
            continue  # not run, or still running
        kind, eager_lines, eager_run = load(os.path.join(root, f"{name}-eager"))
        e = measure(kind, eager_lines, eager_run)
        m = measure(*load(me))
        control = os.path.join(root, f"{name}-eager-2threads")
        c = relative(e[0], measure(*load(control))[0]) if os.path.isdir(control) else "–"
        what = "valid loss, epoch 1" if kind == "translate" else "train loss, epoch 1"
        test = "test sacreBLEU" if kind == "translate" else "test accuracy"
        rows.append([name, what, f"{e[0]:.6f}", f"{m[0]:.6f}", relative(e[0], m[0]), c,
                     f"{e[1]:.4f} / {m[1]:.4f} ({len(eager_lines)} epochs)", f"{test} {e[2]:.3f} / {m[2]:.3f}"])
    header = ["run", "measure", "eager", "memory-efficient", "relative difference", "eager 1 vs 2 threads",
              "last epoch eager / memory-efficient", "final eager / memory-efficient"]
    print(markdown(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""One NCCL rank against one process without a process group, from the run folders of
`scripts/cuda_check.sh nccl`: each run's training tokens/s in the order the runs ran, and each
pair's ratio (NCCL / single) with their geometric mean.

    python -m probattn_tools.tables.nccl results/cuda/2026-11-28/nccl

A pair is `single-<i>` and `ranks1-<i>`. Runs on a GPU drift: on an H100 five runs of 300 updates
each ran faster than the one before, by 22% from first to last, whatever their backend. A pair's
ratio compares two neighbouring runs, and so carries only the drift between those two. Where the
order alternates from pair to pair (the step runs single first in odd pairs, NCCL first in even
ones), that share enters with opposite signs and a steady drift cancels from the geometric mean of
an even number of pairs. The table says how many pairs ran in each order, from the times the
runs recorded their results (`provenance.unix_time`; the step runs them one after another). Other runs (the step's `warmup`, `ranks<N>` on several GPUs) are
listed but not paired.
"""

import argparse
import json
import math
import sys
from pathlib import Path

from probattn_tools.tables.common import markdown


def load(folder):
    """Every run below `folder`, in the order they ran: dicts of name, ranks, backend, tokens/s and
    the time the run recorded its results."""
    runs = []
    for path in sorted(Path(folder).glob("*/results.json")):
        results = json.loads(path.read_text())
        dist = results.get("distributed") or {"world_size": 1, "backend": "none"}
        runs.append({
            "name": path.parent.name,
            "ranks": dist["world_size"],
            "backend": dist["backend"],
            "tokens_per_second": results["tokens_per_second_mean"],
            "recorded": results.get("provenance", {}).get("unix_time", 0),
        })
    return sorted(runs, key=lambda r: (r["recorded"], r["name"]))


def pairs(runs):
    """(index, order, single tokens/s, NCCL tokens/s, ratio) for each i with both `single-i` and
    `ranks1-i`; order is which of the two ran first."""
    by_name = {r["name"]: r for r in runs}
    out = []
    for name in by_name:
        if not name.startswith("single-"):
            continue
        index = name[len("single-"):]
        single, nccl = by_name[name], by_name.get(f"ranks1-{index}")
        if nccl is None:
            continue
        order = "single first" if single["recorded"] <= nccl["recorded"] else "NCCL first"
        out.append((index, order, single["tokens_per_second"], nccl["tokens_per_second"],
                    nccl["tokens_per_second"] / single["tokens_per_second"]))
    return sorted(out, key=lambda p: int(p[0]) if p[0].isdigit() else p[0])


def geometric_mean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values))


def table(folder):
    runs = load(folder)
    if not runs:
        raise SystemExit(f"error: no run folder with a results.json in {folder}")
    lines = [markdown(["run", "ranks, backend", "train tokens/s"],
                      [[r["name"], f"{r['ranks']}, {r['backend']}", f"{r['tokens_per_second']:.0f}"] for r in runs])]
    found = pairs(runs)
    if found:
        lines += ["", markdown(["pair", "order", "single tokens/s", "NCCL tokens/s", "NCCL / single"],
                               [[i, order, f"{s:.0f}", f"{n:.0f}", f"{ratio:.3f}"] for i, order, s, n, ratio in found])]
        firsts = sum(1 for p in found if p[1] == "single first")
        lines += ["", f"geometric mean of the pairs' ratios: {geometric_mean([p[4] for p in found]):.3f} "
                      f"({len(found)} pairs, {firsts} single first and {len(found) - firsts} NCCL first; target: within 3%)"]
        if firsts != len(found) - firsts:
            lines.append("the orders are unbalanced, so a drift from run to run does not cancel from the mean")
    singles = [r["tokens_per_second"] for r in runs if r["ranks"] == 1 and r["backend"] == "none" and r["name"] != "warmup"]
    for r in runs:
        if r["ranks"] > 1 and singles:
            lines.append(f"{r['name']} / the single runs' geometric mean: {r['tokens_per_second'] / geometric_mean(singles):.3f} (the scaling)")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="the nccl step's folder (its runs are its subfolders)")
    print(table(parser.parse_args().folder))


if __name__ == "__main__":
    sys.exit(main())

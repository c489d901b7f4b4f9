"""The fused CUDA route against PyTorch, from `probattn bench` folders (each holding a bench.json):

    python -m probattn_tools.tables.fused results/cuda/2026-11-29/fused-long results/cuda/2026-11-29/fused-tf32

Every folder below the ones given that holds a bench.json is read. One row per variant, length and
precision run by probattn's fused backend (`probattn-fused`): its forward + backward time, TFLOP/s
and peak memory; SDPA's softmax from the same bench run, and the ratios against it (time, memory);
FlexAttention's composition of the same variant where the run has it, and how many times faster
ours is. The route column is the one the fused backend took (`kernel`: softmax's own, SDPA's
kernels; `fused-cuda`: the embedded Triton kernels).
"""

import json
import os
import sys

from probattn_tools.tables.common import markdown


def bench_files(roots):
    """Every bench.json below the given folders, in path order."""
    found = []
    for root in roots:
        if not os.path.isdir(root):
            sys.exit(f"tables.fused: {root} is not a folder")
        for folder, _, files in os.walk(root):
            if "bench.json" in files:
                found.append(os.path.join(folder, "bench.json"))
    return sorted(found)


def rows_of(path):
    """The table's rows of one bench run: its probattn-fused measurements, each beside the run's
    SDPA and FlexAttention rows at the same shape."""
    bench = json.load(open(path))
    by = {}
    for m in bench["measurements"]:
        key = (m["impl"], m["variant"], m["batch"], m["seq_len"], m.get("precision"))
        by[key] = m
    rows = []
    for (impl, variant, batch, seq_len, precision), ours in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][3])):
        if impl != "probattn-fused":
            continue
        sdpa = by.get(("pytorch-sdpa", "softmax", batch, seq_len, precision))
        flex = by.get(("pytorch-flex", variant, batch, seq_len, precision))
        route = ours.get("route") or "–"
        ms, mem = ours["fwd_bwd_ms"], ours["peak_mem_bytes"]
        rows.append([
            variant, precision, f"{batch} × {seq_len:,}", route,
            f"{ms:.2f}", f"{ours['tflops']:.1f}", f"{mem / 2**20:.0f}",
            f"{sdpa['fwd_bwd_ms']:.2f}" if sdpa else "–",
            f"{ms / sdpa['fwd_bwd_ms']:.2f}×" if sdpa else "–",
            f"{mem / sdpa['peak_mem_bytes']:.2f}×" if sdpa else "–",
            f"{flex['fwd_bwd_ms']:.2f}" if flex else "–",
            f"{flex['fwd_bwd_ms'] / ms:.2f}×" if flex else "–",
        ])
    return rows


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    rows = [row for path in bench_files(argv) for row in rows_of(path)]
    if not rows:
        sys.exit(f"tables.fused: no probattn-fused measurement in {', '.join(argv)}")
    header = ["variant", "precision", "B × S", "route", "ours ms", "ours TFLOP/s", "ours peak MiB", "SDPA ms",
              "ours / SDPA", "memory / SDPA's", "Flex ms", "Flex / ours"]
    print(markdown(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Softmax attention on the CPU by its two routes, per length and dtype: libtorch's fused kernel
(`F.scaled_dot_product_attention`, which `probattn`'s softmax takes without weights) against the
eager form (the scores as a product, a float32 masked softmax, the weights cast back and a second
product), forward and backward, as `probattn`'s softmax computes each.

The batch holds a fixed number of tokens (B * S, as token batching does), H heads of size d, and a
key padding mask that excludes each sequence's last three keys. Each cell is the median of
`--reps` timed calls after one untimed one; the two routes alternate.

    python -m probattn_tools.baselines.sdpa_routes --threads 1 --out results/bench/sdpa-routes

Writes OUT/bench.json and OUT/bench.md (kernel ms, eager ms, kernel / eager per length and dtype).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from probattn_tools.tables.common import atomic_write_text

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def routes(b, h, s, d, dtype):
    q, k, v = (torch.randn(b, h, s, d, dtype=dtype, requires_grad=True) for _ in range(3))
    allowed = torch.ones(b, 1, 1, s, dtype=torch.bool)
    allowed[..., -3:] = False
    grad = torch.randn(b, h, s, d, dtype=dtype)

    def kernel():
        F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).backward(grad)

    def eager():
        scores = (q @ k.transpose(-1, -2) * d ** -0.5).float().masked_fill(~allowed, float("-inf"))
        (scores.softmax(-1).to(dtype) @ v).backward(grad)

    return kernel, eager


def timed(fn):
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128, 192, 256, 384, 512])
    parser.add_argument("--tokens", type=int, default=8192, help="B * S of each batch (default 8192)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    if min(args.lengths) < 4 or args.reps < 1 or args.tokens < max(args.lengths):
        sys.exit("error: lengths must be at least 4 (three keys are padding), --reps at least 1, "
                 "and --tokens at least the longest length")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for s in args.lengths:
        b = args.tokens // s
        for name, dtype in DTYPES.items():
            kernel, eager = routes(b, args.heads, s, args.head_dim, dtype)
            kernel(), eager()
            times = {"kernel": [], "eager": []}
            for _ in range(args.reps):
                times["kernel"].append(timed(kernel))
                times["eager"].append(timed(eager))
            med = {route: statistics.median(t) for route, t in times.items()}
            rows.append({"length": s, "batch": b, "dtype": name, "kernel_ms": med["kernel"], "eager_ms": med["eager"],
                         "kernel_over_eager": med["kernel"] / med["eager"]})
            print(f"S {s} B {b} {name}: kernel {med['kernel']:.1f} ms, eager {med['eager']:.1f} ms",
                  file=sys.stderr, flush=True)
    record = {"tokens": args.tokens, "heads": args.heads, "head_dim": args.head_dim, "threads": args.threads,
              "reps": args.reps, "pytorch": torch.__version__, "rows": rows}
    lines = [f"Forward and backward, {args.tokens} tokens a batch, H {args.heads}, d {args.head_dim}, "
             f"{args.threads} thread(s), median of {args.reps}; PyTorch {torch.__version__}.", "",
             "| S | B | " + " | ".join(f"{n} kernel ms | {n} eager ms | {n} kernel / eager" for n in DTYPES) + " |",
             "|---|---|" + "---|---|---|" * len(DTYPES)]
    for s in args.lengths:
        cells = [r for r in rows if r["length"] == s]
        lines.append(f"| {s} | {cells[0]['batch']} | " + " | ".join(
            f"{r['kernel_ms']:.1f} | {r['eager_ms']:.1f} | {r['kernel_over_eager']:.2f}" for r in cells) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "bench.json", json.dumps(record, indent=1) + "\n")
    atomic_write_text(args.out / "bench.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

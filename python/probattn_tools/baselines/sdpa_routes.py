"""Softmax attention on the CPU by its routes, per length and dtype: libtorch's fused kernel
(`F.scaled_dot_product_attention`, which `probattn`'s softmax takes without weights) against the
eager form as `probattn`'s softmax computes it (the scores as a product, a masked softmax, the value
product; for bfloat16 inputs all of it in float32, the output cast back), and, for bfloat16, the
eager form with bfloat16 products (float32 softmax between), as autocast would run it. Forward and
backward.

The batch holds a fixed number of tokens (B * S, as token batching does), H heads of size d, and a
key padding mask that excludes each sequence's last three keys. Each cell is the median of
`--reps` timed calls after one untimed one; the routes take turns.

    python -m probattn_tools.baselines.sdpa_routes --threads 1 --out results/bench/sdpa-routes

Writes OUT/bench.json and OUT/bench.md (ms per route, and the kernel over the eager form).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from probattn_tools.files import atomic_write_text

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def routes(b, h, s, d, dtype):
    """The routes as closures over one batch: {name: forward and backward}."""
    q, k, v = (torch.randn(b, h, s, d, dtype=dtype, requires_grad=True) for _ in range(3))
    allowed = torch.ones(b, 1, 1, s, dtype=torch.bool)
    allowed[..., -3:] = False
    grad = torch.randn(b, h, s, d, dtype=dtype)

    def kernel():
        F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).backward(grad)

    def eager():
        scores = (q.float() @ k.float().transpose(-1, -2) * d ** -0.5).masked_fill(~allowed, float("-inf"))
        (scores.softmax(-1) @ v.float()).to(dtype).backward(grad)

    def eager_products():
        scores = (q @ k.transpose(-1, -2) * d ** -0.5).float().masked_fill(~allowed, float("-inf"))
        (scores.softmax(-1).to(dtype) @ v).backward(grad)

    found = {"kernel": kernel, "eager": eager}
    if dtype != torch.float32:
        found["eager, bf16 products"] = eager_products
    return found


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
            found = routes(b, args.heads, s, args.head_dim, dtype)
            for fn in found.values():
                fn()
            times = {route: [] for route in found}
            for _ in range(args.reps):
                for route, fn in found.items():
                    times[route].append(timed(fn))
            med = {route: statistics.median(t) for route, t in times.items()}
            rows.append({"length": s, "batch": b, "dtype": name, "ms": med, "kernel_over_eager": med["kernel"] / med["eager"]})
            print(f"S {s} B {b} {name}: " + ", ".join(f"{r} {t:.1f} ms" for r, t in med.items()), file=sys.stderr, flush=True)
    record = {"tokens": args.tokens, "heads": args.heads, "head_dim": args.head_dim, "threads": args.threads,
              "reps": args.reps, "pytorch": torch.__version__, "rows": rows}
    lines = [f"Forward and backward, {args.tokens} tokens a batch, H {args.heads}, d {args.head_dim}, "
             f"{args.threads} thread(s), median of {args.reps}, ms; PyTorch {torch.__version__}.", "",
             "| S | B | f32 kernel | f32 eager | f32 kernel / eager | bf16 kernel | bf16 eager (float32 inside) "
             "| bf16 eager, bf16 products | bf16 kernel / eager |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in args.lengths:
        f32, bf16 = (next(r for r in rows if r["length"] == s and r["dtype"] == n) for n in DTYPES)
        lines.append(f"| {s} | {f32['batch']} | {f32['ms']['kernel']:.1f} | {f32['ms']['eager']:.1f} | "
                     f"{f32['kernel_over_eager']:.2f} | {bf16['ms']['kernel']:.1f} | {bf16['ms']['eager']:.1f} | "
                     f"{bf16['ms']['eager, bf16 products']:.1f} | {bf16['kernel_over_eager']:.2f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "bench.json", json.dumps(record, indent=1) + "\n")
    atomic_write_text(args.out / "bench.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

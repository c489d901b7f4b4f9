"""What bfloat16 gains on this CPU, kernel by kernel: libtorch's matrix product and its
flash-attention kernel for the CPU (the one `scaled_dot_product_attention` and probattn's
memory-efficient path call), float32 against bfloat16, in one run.

Whether `--precision bf16` speeds anything up depends on the processor: with AMX or AVX512-BF16
a bfloat16 product runs faster than a float32 one; without them libtorch emulates it, slower
(docs/precision.md). The record names the processor and the instructions it has:

    python -m probattn_tools.baselines.cpu_kernels --threads 1 --out results/bench/precision/cpu-kernels
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from probattn_tools.baselines.bench import time_interleaved
from probattn_tools.files import atomic_write_text

CPU = torch.device("cpu")
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def cpu_description(cpuinfo):
    """'<model name>; bfloat16 instructions: <flags>' from the text of /proc/cpuinfo, as probattn's
    provenance records it; None without a model name."""
    fields = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    if "model name" not in fields:
        return None
    bf16 = [f for f in fields.get("flags", "").split() if f in ("avx512_bf16", "amx_bf16")]
    return f"{fields['model name']}; bfloat16 instructions: {' '.join(bf16) or 'none'}"


def this_cpu():
    try:
        return cpu_description(Path("/proc/cpuinfo").read_text())
    except OSError:
        return None


def median_seconds(step, repeats):
    """Median seconds of `repeats` calls of `step` after two warm-up calls (bench's timing)."""
    (median_ms, _), = time_interleaved([step], repeats, CPU)
    return median_ms / 1e3


def matmul(n, dtype, repeats):
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return median_seconds(lambda: torch.mm(a, b), repeats)


def attention(shape, dtype, repeats, backward):
    b, h, s, d = shape
    q, k, v = (torch.randn(b, h, s, d, dtype=dtype, requires_grad=backward) for _ in range(3))
    grad = torch.randn(b, h, s, d, dtype=dtype)

    def step():
        out = F.scaled_dot_product_attention(q, k, v)
        if backward:
            torch.autograd.grad(out, (q, k, v), grad)

    with torch.set_grad_enabled(backward):
        return median_seconds(step, repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of each kernel, after 2 warm-ups (median)")
    parser.add_argument("--matmul-size", type=int, default=2048, help="n of the n x n by n x n product")
    parser.add_argument("--seq-len", type=int, default=4096, help="S of the attention kernel (B 1, H 8, d 64)")
    parser.add_argument("--out", required=True, help="folder for kernels.json and kernels.md")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    shape = (1, 8, args.seq_len, 64)
    rows = {}
    for p, dtype in DTYPES.items():
        seconds = matmul(args.matmul_size, dtype, args.repeats)
        rows[("matmul GFLOP/s", p)] = 2 * args.matmul_size ** 3 / seconds / 1e9
        rows[("flash forward ms", p)] = attention(shape, dtype, args.repeats, backward=False) * 1e3
        rows[("flash forward + backward ms", p)] = attention(shape, dtype, args.repeats, backward=True) * 1e3
    kernels = ("matmul GFLOP/s", "flash forward ms", "flash forward + backward ms")
    # bf16's gain over f32: a rate's ratio, or a time's inverse ratio, so > 1 is faster
    gain = {k: (rows[(k, "bf16")] / rows[(k, "f32")]) if k.endswith("/s") else rows[(k, "f32")] / rows[(k, "bf16")]
            for k in kernels}
    record = {"threads": args.threads, "repeats": args.repeats, "matmul_size": args.matmul_size,
              "attention_shape": list(shape), "torch": torch.__version__, "cpu": this_cpu(),
              "kernels": {f"{k} {p}": rows[(k, p)] for k in kernels for p in DTYPES},
              "bf16_speedup": gain}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "kernels.json", json.dumps(record, indent=1) + "\n")
    lines = ["| kernel | f32 | bf16 | bf16 speed-up |", "|---|---|---|---|"]
    lines += [f"| {k} | {rows[(k, 'f32')]:.1f} | {rows[(k, 'bf16')]:.1f} | {gain[k]:.2f} |" for k in kernels]
    table = "\n".join(lines) + "\n"
    atomic_write_text(out / "kernels.md", f"{record['cpu']}; torch {torch.__version__}, {args.threads} thread(s), "
                                          f"median of {args.repeats}; matmul {args.matmul_size}³, attention B 1, H 8, "
                                          f"S {args.seq_len}, d 64\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()

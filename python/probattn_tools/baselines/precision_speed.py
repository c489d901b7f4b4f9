"""Translation training speed in float32 and bfloat16, probattn against PyTorch, in one run.

For each precision, `probattn translate` trains the small preset's Transformer for a fixed number
of updates, then `probattn_tools.baselines.translate` trains the same model on the same batches
from that run's folder (config.json, tokenizer.json) under `torch.autocast` for bf16. The four
take turns, round after round, so a machine's drift reaches each alike; the training loop's
tokens per second of each (validation and decoding excluded, on both sides) go into
`bench.json` and `bench.md` with the ratios the precision targets are stated in (docs/precision.md):

    python -m probattn_tools.baselines.precision_speed --probattn target/release/probattn \\
        --updates 100 --threads 2 --out results/translate/precision/speed
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from probattn_tools.files import atomic_write_text

PRECISIONS = ("f32", "bf16")


def ours(binary, precision, updates, threads, out):
    cmd = [binary, "translate", "--max-updates", str(updates), "--threads", str(threads), "--precision", precision,
           "--seeds", "1", "--limit-valid", "100", "--limit-test", "100", "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    results = json.loads((out / "results.json").read_text())
    return results["runs"][0]["tokens_per_second"], results["provenance"]


def theirs(run, precision, updates, threads):
    cmd = [sys.executable, "-m", "probattn_tools.baselines.translate", "--run", str(run), "--max-updates", str(updates),
           "--threads", str(threads), "--precision", precision]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)["tokens_per_second"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probattn", required=True, help="the probattn binary (a release build)")
    parser.add_argument("--updates", type=int, default=100, help="training updates per measurement")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="rounds of the four measurements, taken in turns")
    parser.add_argument("--out", required=True, help="folder for bench.json and bench.md")
    args = parser.parse_args()
    if "PROBATTN_DATA" not in os.environ:
        print("note: PROBATTN_DATA is unset; probattn reads data/multi30k", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {(side, p): [] for side in ("probattn", "pytorch") for p in PRECISIONS}
    provenance = None
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.rounds):
            for p in PRECISIONS:
                run = Path(scratch) / f"{p}-{r}"
                tps, provenance = ours(args.probattn, p, args.updates, args.threads, run)
                rows[("probattn", p)].append(tps)
                rows[("pytorch", p)].append(theirs(run, p, args.updates, args.threads))
                print(f"round {r + 1}: {p}: probattn {tps:.0f} tok/s, pytorch {rows[('pytorch', p)][-1]:.0f} tok/s",
                      file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    ratios = {
        "probattn_bf16_over_f32": med[("probattn", "bf16")] / med[("probattn", "f32")],
        "pytorch_bf16_over_f32": med[("pytorch", "bf16")] / med[("pytorch", "f32")],
        "probattn_over_pytorch_f32": med[("probattn", "f32")] / med[("pytorch", "f32")],
        "probattn_over_pytorch_bf16": med[("probattn", "bf16")] / med[("pytorch", "bf16")],
    }
    record = {"updates": args.updates, "threads": args.threads, "rounds": args.rounds,
              "tokens_per_second": {f"{side} {p}": v for (side, p), v in rows.items()},
              "median": {f"{side} {p}": v for (side, p), v in med.items()}, "ratios": ratios,
              "pytorch": subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                                        capture_output=True, text=True).stdout.strip(),
              "probattn_provenance": provenance}
    atomic_write_text(out / "bench.json", json.dumps(record, indent=1) + "\n")
    lines = ["| side | f32 tok/s | bf16 tok/s | bf16 / f32 |", "|---|---|---|---|"]
    for side in ("probattn", "pytorch"):
        a, b = med[(side, "f32")], med[(side, "bf16")]
        lines.append(f"| {side} | {a:.0f} | {b:.0f} | {b / a:.2f} |")
    lines.append(f"| probattn / pytorch | {ratios['probattn_over_pytorch_f32']:.2f} | {ratios['probattn_over_pytorch_bf16']:.2f} | |")
    table = "\n".join(lines) + "\n"
    atomic_write_text(out / "bench.md", f"Training tokens/s, {args.updates} updates, {args.threads} threads, "
                                        f"median of {args.rounds} round(s)\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()

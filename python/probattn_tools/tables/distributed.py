"""The CPU scaling table from scripts/distributed_scaling.sh's runs: training tokens/s of
1 rank x 1 thread, 1 rank x 2 threads and 2 ranks x 1 thread per round, and the ratios.

    python -m probattn_tools.tables.distributed results/distributed/scaling
"""
import json
import sys
from pathlib import Path

CONFIGS = ["1rank-1thread", "1rank-2threads", "2ranks-1thread"]


def main(root: Path) -> None:
    rows, ratios = [], []
    for round_dir in sorted(root.glob("round-*")):
        rates = {}
        for name in CONFIGS:
            results = json.loads((round_dir / name / "results.json").read_text())
            run = results["runs"][0]
            rates[name] = run["tokens_per_second"]
            per_rank = run.get("distributed_tokens_per_second")
            rows.append(
                f"| {round_dir.name} | {name} | {run['updates']} | {run['train_seconds']:.1f} | {run['tokens_per_second']:.0f} | "
                + (" / ".join(f"{r:.0f}" for r in per_rank) if per_rank else "–")
                + f" | {results['provenance'].get('git_sha', '')[:7]}{' (dirty)' if results['provenance'].get('git_dirty') else ''} |"
            )
        ratios.append(
            (round_dir.name, rates["2ranks-1thread"] / rates["1rank-1thread"], rates["2ranks-1thread"] / rates["1rank-2threads"])
        )
    lines = [
        "| round | configuration | updates | train s | tokens/s (job) | tokens/s per rank | commit |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "| round | 2 ranks x 1 thread / 1 rank x 1 thread (target >= 1.6) | 2 ranks x 1 thread / 1 rank x 2 threads (target >= 1.0) |",
        "|---|---|---|",
        *[f"| {name} | {a:.2f} | {b:.2f} |" for name, a, b in ratios],
    ]
    text = "\n".join(lines) + "\n"
    (root / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0)
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "results/distributed/scaling"))

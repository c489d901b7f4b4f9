"""Validation BLEU per CPU-hour of translation presets: the evidence behind the `small` preset.

    P=results/translate/presets
    python -m probattn_tools.tables.translate_presets \
        --preset small results/translate/multi30k-softmax-seed1 results/translate/table/softmax-s2 \
                       results/translate/table/softmax-s3 \
        --preset tiny $P/tiny --preset wide $P/wide \
        --speed small $P/speed/small/results.json --speed tiny $P/speed/tiny/results.json \
        --speed wide $P/speed/wide/results.json --threads 2 --budgets 0.25 0.5 0.75 0.85 --out $P

Each run folder is a `probattn translate` run (config.json, seed-*/metrics.jsonl). The runs were
trained on a machine shared with other work, so their wall-clock times are not comparable; the
CPU time of a run is therefore rebuilt from the target tokens it trained on (per epoch, tokens/s
times seconds, as metrics.jsonl records them) divided by the preset's training speed measured on
the idle machine (`--speed`: the results.json of a short `--max-updates` run, whose
tokens_per_second times the training loop alone), times the threads. Validation (beam-search
decoding of the validation set after each epoch) is not counted: it is the same work for every
preset up to the model's decoding speed, and a user can validate less often.

Writes OUT/presets.md (a table: validation BLEU reached within fixed CPU budgets, the best
reached, the CPU-hours to it) and OUT/presets.svg (validation BLEU against CPU-hours, one line
per run).
"""

import argparse
import glob
import json
import os

from probattn_tools.files import atomic_write_text


def curves(folder, clean_tps, threads):
    """[(cpu_hours, valid_bleu)] per seed folder of a run."""
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "seed-*", "metrics.jsonl"))):
        tokens, points = 0.0, []
        for line in open(path):
            m = json.loads(line)
            tokens += m["tokens_per_second"] * m["seconds"]
            points.append((tokens / clean_tps * threads / 3600.0, m["valid_bleu"]))
        out.append((path, points))
    if not out:
        raise SystemExit(f"{folder}: no seed-*/metrics.jsonl")
    return out


def cell(points, budget):
    """The best validation BLEU a run reached within `budget` CPU-hours; a run that stopped before
    the budget has no value there (it says where it stopped), nor one not yet validated ("-")."""
    if points[-1][0] < budget:
        return f"(ended at {points[-1][0]:.2f})"
    within = [b for h, b in points if h <= budget]
    return f"{max(within):.1f}" if within else "-"


def svg(path, series, x_max, y_max):
    w, h, left, bottom, top, right = 720, 420, 60, 50, 30, 150
    sx = lambda x: left + (w - left - right) * x / x_max  # noqa: E731
    sy = lambda y: h - bottom - (h - bottom - top) * y / y_max  # noqa: E731
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="{w / 2}" y="18" text-anchor="middle">Multi30k de-en: validation sacreBLEU per CPU-hour of training, by preset</text>',
             f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="black"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>',
             f'<text x="{(left + w - right) / 2}" y="{h - 12}" text-anchor="middle">CPU-hours (training tokens / idle tokens per second x threads)</text>',
             f'<text x="16" y="{(top + h - bottom) / 2}" transform="rotate(-90 16 {(top + h - bottom) / 2})" text-anchor="middle">validation BLEU</text>']
    for i in range(6):
        x, y = x_max * i / 5, y_max * i / 5
        parts.append(f'<text x="{sx(x)}" y="{h - bottom + 16}" text-anchor="middle">{x:.2f}</text>')
        parts.append(f'<text x="{left - 6}" y="{sy(y) + 4}" text-anchor="end">{y:.0f}</text>')
    for k, (name, runs) in enumerate(series):
        c = colours[k % len(colours)]
        for _, points in runs:
            pts = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
            parts.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="1.5"/>')
        parts.append(f'<line x1="{w - right + 10}" y1="{top + 20 * k}" x2="{w - right + 30}" y2="{top + 20 * k}" stroke="{c}" stroke-width="2"/>')
        parts.append(f'<text x="{w - right + 35}" y="{top + 20 * k + 4}">{name}</text>')
    parts.append("</svg>")
    atomic_write_text(path, "\n".join(parts) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", nargs="+", action="append", required=True, metavar=("NAME", "RUN"), help="a preset's name and its run folders")
    p.add_argument("--speed", nargs=2, action="append", required=True, metavar=("NAME", "RESULTS"), help="a preset's idle-machine speed run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5, 0.9], help="CPU-hour budgets of the table")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    speed = {}
    for name, path in args.speed:
        r = json.load(open(path))
        speed[name] = (r["runs"][0]["tokens_per_second"], r["config"])
    rows, series, x_max, y_max = [], [], 0.0, 0.0
    for name, *folders in args.preset:
        if name not in speed:
            raise SystemExit(f"--preset {name} has no --speed {name}")
        tps, cfg = speed[name]
        runs = [c for f in folders for c in curves(f, tps, args.threads)]
        series.append((name, runs))
        x_max = max([x_max] + [pts[-1][0] for _, pts in runs])
        y_max = max([y_max] + [b for _, pts in runs for _, b in pts])
        t = json.load(open(os.path.join(folders[0], "config.json")))["model"]["transformer"]
        dims = f"{t['encoder_layers']}+{t['decoder_layers']}, E {t['embed_dim']}, FFN {t['ffn_dim']}"
        cells = []
        for budget in args.budgets:
            cells.append(" / ".join(cell(pts, budget) for _, pts in runs))
        best = [max(pts, key=lambda p: p[1]) for _, pts in runs]
        rows.append(f"| {name} | {dims} | {tps:.0f} | " + " | ".join(cells) + " | " + " / ".join(f"{b:.1f} at {h:.2f}" for h, b in best) + f" | {len(runs)} |")
    os.makedirs(args.out, exist_ok=True)
    header = ["| preset | layers, width | idle train tokens/s | " + " | ".join(f"valid BLEU within {b} CPU-h" for b in args.budgets)
              + " | best valid BLEU at CPU-h | runs |", "|---" * (5 + len(args.budgets)) + "|"]
    atomic_write_text(os.path.join(args.out, "presets.md"), "\n".join(header + rows) + "\n")
    svg(os.path.join(args.out, "presets.svg"), series, x_max * 1.02, max(5.0, y_max * 1.05))
    print("\n".join(header + rows))


if __name__ == "__main__":
    main()

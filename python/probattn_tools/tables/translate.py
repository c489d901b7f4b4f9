"""The translation table from `probattn translate` results: one row per configuration (model,
attention and its settings, repulsive heads), runs pooled over every results.json found under the
folders given, so runs of one seed each (run one at a time, as they fit) make one table.

Rows of the attentional LSTM (`--arch lstm`) are named `lstm-<attention>`; BAM rows whose KL
weight, Weibull shape or anneal differ from the defaults (1, 10, none) carry them in the name
(`bam-wc-k100-w0.1`, `-anneal2000`), so a tuned row stands beside the untuned one; runs in
bfloat16 (`--precision bf16`) end in `-bf16`, beside their float32 row. Each row's
difference (`--diff`) is taken against the softmax row of its own model.

    python -m probattn_tools.tables.translate results/translate/table [--diff] [--paper]

Columns: test BLEU of both kinds (tokenized and lowercased, as the papers and fairseq report it;
sacreBLEU's default, cased and detokenized), mean ± std over seeds; mean best validation
sacreBLEU; epochs; training tokens/s; the head diversity "Dist" of the encoder self-attention
(mean over layers). `--diff` adds each row minus softmax (MA) with the standard error of the
difference, sqrt(s1²/n1 + s2²/n2), for both BLEUs and Dist: the repulsive-attention paper's claim
is RMA − MA = +0.8 BLEU (IWSLT14) and a larger Dist. With `--diff`, each bfloat16 row is also set
against its own float32 row: the difference (unpaired, and paired by seed), the float32 seeds'
range of test BLEU and whether the bfloat16 mean lies within it (the quality check of docs/precision.md).
`--paper` adds the difference each paper reports for the row (`paper_difference`; IWSLT14 de-en,
tokenized lowercased BLEU, not Multi30k): beside it, not comparable in size, only in sign and
rough scale.
`--stalled BLEU` adds how many runs of each row stalled, a stall being a best validation
sacreBLEU below BLEU (fixed before the runs are read: the threshold is a flag, not a fit), with the
stalled seeds, the test BLEU of the runs that did not stall, and Fisher's exact test of the row's
stall count against its model's softmax row.
"""

import argparse
import json
import os
import statistics
import sys

from probattn_tools.tables.common import cell, diff_cell, fisher_exact, markdown, paired_cell

# Each model's softmax row before the rows set against it; other rows follow in name order, the
# bfloat16 rows last.
ORDER = ["softmax", "softmax-svgd", "softmax-svgd-cross", "softmax-spos-cross", "dnas", "hnas", "bam-wc",
         "bam-wc-w0.1-anneal1000", "lstm-softmax"]


def ordered(names):
    """The table's rows in order: ORDER's, the other float32 rows by name, then the bfloat16 rows."""
    return [n for n in ORDER if n in names] + sorted((n for n in names if n not in ORDER),
                                                     key=lambda n: (float32_row(n) is not None, n))


def is_lstm(results):
    return "lstm" in results["config"]["model"]


def attention_name(results):
    """The attention with its non-default BAM settings, prefixed `lstm-` for the LSTM."""
    name = results["attention"]
    config = results["config"]
    if name.startswith("bam-"):
        model = config["model"].get("lstm") or config["model"]["transformer"]
        k = model["normalizer"]["bam"]["k"]
        if name.startswith("bam-w") and k != 10:
            name += f"-k{k:g}"
        if config["kl_weight"] != 1:
            name += f"-w{config['kl_weight']:g}"
        if config.get("kl_anneal_updates"):
            name += f"-anneal{config['kl_anneal_updates']}"
    return ("lstm-" if is_lstm(results) else "") + name


def row_name(results):
    """attention[-repulsive[-selection]][-bf16]: `softmax-svgd` repels every module's heads,
    `softmax-svgd-cross` only the kinds / layers its `--selection` names."""
    rep = results["repulsive"]
    bf16 = "-bf16" if results["config"].get("precision", "f32") == "bf16" else ""
    if rep == "none":
        return attention_name(results) + bf16
    selection = results["config"].get("selection") or {}
    parts = [k for k in selection.get("kinds") or []]
    parts += [f"layer{l}" for l in selection.get("layers") or []]
    parts += [p for p in selection.get("projections") or []]
    return "-".join([results["attention"], rep] + parts) + bf16


def pooled_config(results):
    """The configuration runs must share to pool: without repulsive heads, the repulsive settings
    (whose defaults changed over time) do not act and are left out; so is `data_dir`, where the
    data lay on the machine that ran (which data is `dataset`, and the same data gives the same
    learned tokenizer, compared by hand: results/translate/table/README.md)."""
    config = dict(results["config"])
    config.pop("data_dir", None)
    if config.get("precision") == "f32":  # runs from before --precision were float32
        config.pop("precision")
    if results["repulsive"] == "none":
        config.pop("repulsive_config", None)
        config.pop("selection", None)
    return config


def collect(roots):
    """{row: [run, ...]} over every results.json under the roots; a seed twice in a row is an error."""
    rows = {}
    for root in roots:
        if not os.path.isdir(root):
            sys.exit(f"tables.translate: {root} is not a folder of probattn translate results")
        for folder, _, files in sorted(os.walk(root)):
            if "results.json" not in files:
                continue
            results = json.load(open(os.path.join(folder, "results.json")))
            if "test_bleu_tok" not in results.get("runs", [{}])[0]:
                continue  # not a translate result
            for run in results["runs"]:
                run["_folder"] = folder
                run["_config"] = pooled_config(results)
                rows.setdefault(row_name(results), []).append(run)
    for name, runs in rows.items():
        first = runs[0]["_config"]
        for r in runs[1:]:
            keys = sorted(k for k in set(first) | set(r["_config"]) if first.get(k) != r["_config"].get(k))
            if keys:
                sys.exit(f"tables.translate: {name}: {runs[0]['_folder']} and {r['_folder']} differ in {', '.join(keys)}; "
                         "pool runs of one configuration only")
        seeds = [r["seed"] for r in runs]
        if len(set(seeds)) != len(seeds):
            dup = sorted({s for s in seeds if seeds.count(s) > 1})
            folders = sorted({r["_folder"] for r in runs if r["seed"] in dup})
            sys.exit(f"tables.translate: {name}: seed(s) {dup} appear more than once ({', '.join(folders)}); pool distinct seeds only")
    return rows


def dist(run):
    return statistics.mean(run["head_diversity"])


def dist_cell(runs, fn):
    """Dist, or '–' for the LSTM, whose encoder has no attention heads."""
    if not all(r["head_diversity"] for r in runs):
        return "–"
    return fn(runs)


# The papers' own differences from softmax, by row: (BLEU difference, where it comes from).
PAPER = [
    ("lstm-bam-wc", 33.81 - 32.77, "BAM Table 4: attentional LSTM, BAM-WC 33.81 vs soft 32.77"),
    ("softmax-svgd-cross", 34.9 - 34.4, "RMA Table 10: encoder-decoder heads only, 34.9 vs MA 34.4"),
    ("softmax-spos-cross", 34.9 - 34.4, "RMA Table 10, its encoder-decoder row (SVGD; no SPOS translation row), 34.9 vs MA 34.4"),
    ("softmax-svgd", 35.2 - 34.4, "RMA Table 10: every head, 35.2 vs MA 34.4"),
]


def paper_difference(name):
    """(difference, source) the papers report for a row, or None: BAM's for the LSTM's BAM-WC rows
    (the paper ran no Transformer), RMA's for the repulsive rows; none for DNAS and HNAS, whose
    paper has no translation experiment. Tuned and bfloat16 rows take their base row's."""
    base = float32_row(name) or name
    for prefix, value, source in PAPER:
        if base == prefix or (prefix == "lstm-bam-wc" and base.startswith(prefix + "-")):
            return value, source
    return None


def reference(name):
    """The softmax row a row is compared with: its own model's."""
    return "lstm-softmax" if name.startswith("lstm-") else "softmax"


def float32_row(name):
    """The float32 row of a bfloat16 row (`dnas` for `dnas-bf16`); None for a float32 row."""
    return name[: -len("-bf16")] if name.endswith("-bf16") else None


def precision_row(name, runs, base):
    """A bfloat16 row against its own float32 row (docs/precision.md's quality check): the test BLEU
    difference ± s.e., the same paired by seed, the float32 seeds' range, and whether the bfloat16
    mean lies in it."""
    bf16 = [r["test_bleu_tok"] for r in runs]
    f32 = [r["test_bleu_tok"] for r in base]
    mean = statistics.mean(bf16)
    inside = "yes" if min(f32) <= mean <= max(f32) else ("above" if mean > max(f32) else "below")
    return [
        f"{name} − {float32_row(name)}",
        diff_cell(bf16, f32),
        paired_cell({r["seed"]: r["test_bleu_tok"] for r in runs}, {r["seed"]: r["test_bleu_tok"] for r in base}),
        cell(bf16),
        f"{min(f32):.2f} – {max(f32):.2f} (n={len(f32)})",
        inside,
    ]


def stall_row(name, runs, base, below):
    """How often a row's runs stalled (best validation sacreBLEU < `below`): the count, the stalled
    seeds with their best validation BLEU, the test BLEU of the others, and Fisher's exact p of the
    count against `base`'s (its model's softmax row; '–' for that row itself or without it)."""
    stalled = sorted((r for r in runs if r["valid_bleu"] < below), key=lambda r: r["seed"])
    others = [r["test_bleu_tok"] for r in runs if r["valid_bleu"] >= below]
    against = "–"
    if base is not None and base is not runs:
        k = sum(r["valid_bleu"] < below for r in base)
        against = f"{fisher_exact(len(stalled), len(runs), k, len(base)):.3f} ({len(stalled)}/{len(runs)} vs {k}/{len(base)})"
    return [
        name,
        f"{len(stalled)} of {len(runs)}",
        ", ".join(f"{r['seed']} ({r['valid_bleu']:.2f})" for r in stalled) or "–",
        cell(others) if others else "–",
        against,
    ]


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m probattn_tools.tables.translate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("roots", nargs="*", default=["results/translate"], metavar="DIR",
                        help="folders searched for results.json (default results/translate)")
    parser.add_argument("--diff", action="store_true", help="each row minus its model's softmax row, ± standard error")
    parser.add_argument("--paper", action="store_true", help="beside the differences (implies --diff), the difference each paper reports for the row")
    parser.add_argument("--stalled", type=float, metavar="BLEU",
                        help="count the runs whose best validation sacreBLEU is below BLEU, per row, with Fisher's exact "
                             "test against the model's softmax row")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    diff, paper, roots = args.diff or args.paper, args.paper, args.roots
    rows = collect(roots)
    if not rows:
        sys.exit(f"tables.translate: no probattn translate results.json under {', '.join(roots)}")
    names = ordered(rows)
    table = []
    for name in names:
        runs = rows[name]
        table.append([
            name,
            cell([r["test_bleu_tok"] for r in runs]),
            cell([r["test_bleu"] for r in runs]),
            f"{statistics.mean(r['valid_bleu'] for r in runs):.2f}",
            "/".join(str(r["epochs"]) for r in runs),
            f"{statistics.mean(r['tokens_per_second'] for r in runs):.0f}",
            dist_cell(runs, lambda rs: cell([dist(r) for r in rs], 3)),
            " ".join(str(r["seed"]) for r in runs),
        ])
    header = ["attention", "test BLEU tok-lc", "test sacreBLEU", "valid sacreBLEU (best)", "epochs",
              "train tokens/s", "Dist (encoder)", "seeds"]
    print(markdown(header, table))
    if diff:
        table = []
        for name in names:
            ref = reference(name)
            if name == ref or ref not in rows or float32_row(name):
                continue  # a bfloat16 row is set against its float32 row, in the table after this one
            runs, base = rows[name], rows[ref]
            row = [
                f"{name} − {ref}",
                diff_cell([r["test_bleu_tok"] for r in runs], [r["test_bleu_tok"] for r in base]),
                diff_cell([r["test_bleu"] for r in runs], [r["test_bleu"] for r in base]),
                dist_cell(runs + base, lambda _: diff_cell([dist(r) for r in runs], [dist(r) for r in base], 3)),
            ]
            if paper:
                reported = paper_difference(name)
                row.append(f"{reported[0]:+.2f} ({reported[1]})" if reported else "–")
            table.append(row)
        print()
        header = ["rows", "tok-lc BLEU difference (± s.e.)", "sacreBLEU difference (± s.e.)", "Dist difference (± s.e.)"]
        print(markdown(header + (["paper's difference (IWSLT14, tok-lc BLEU)"] if paper else []), table))
        table = [precision_row(name, rows[name], rows[float32_row(name)]) for name in names if float32_row(name) in rows]
        if table:
            print()
            header = ["bfloat16 − float32", "tok-lc BLEU difference (± s.e.)", "paired by seed (± s.e.)", "bfloat16 tok-lc",
                      "float32 seeds' range", "bfloat16 mean within it"]
            print(markdown(header, table))
    if args.stalled is not None:
        table = [stall_row(name, rows[name], rows.get(reference(name)), args.stalled) for name in names]
        header = ["attention", f"stalled (best valid sacreBLEU < {args.stalled:g})", "stalled seeds (best valid)",
                  "test BLEU tok-lc of the others", "Fisher's exact p against its softmax row"]
        print()
        print(markdown(header, table))


if __name__ == "__main__":
    main()

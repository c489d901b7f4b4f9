"""The translation table from `probattn translate` results: one row per configuration (attention
and repulsive heads), runs pooled over every results.json found under the folders given, so runs
of one seed each (run one at a time, as they fit) make one table.

    python python/translate_table.py results/translate/table [--diff] [--paper]

Columns: test BLEU of both kinds (tokenized and lowercased, as the papers and fairseq report it;
sacreBLEU's default, cased and detokenized), mean ± std over seeds; mean best validation
sacreBLEU; epochs; training tokens/s; the head diversity "Dist" of the encoder self-attention
(mean over layers). `--diff` adds each row minus softmax (MA) with the standard error of the
difference, sqrt(s1²/n1 + s2²/n2), for both BLEUs and Dist: the repulsive-attention paper's claim
is RMA − MA = +0.8 BLEU (IWSLT14) and a larger Dist.
"""

import json
import os
import statistics
import sys

from tables import cell, diff_cell, markdown

ORDER = ["softmax", "softmax-svgd", "softmax-svgd-cross", "softmax-spos-cross", "dnas", "hnas", "bam-wc"]


def row_name(results):
    """attention[-repulsive[-selection]]: `softmax-svgd` repels every module's heads,
    `softmax-svgd-cross` only the kinds / layers its `--selection` names."""
    rep = results["repulsive"]
    if rep == "none":
        return results["attention"]
    selection = results["config"].get("selection") or {}
    parts = [k for k in selection.get("kinds") or []]
    parts += [f"layer{l}" for l in selection.get("layers") or []]
    parts += [p for p in selection.get("projections") or []]
    return "-".join([results["attention"], rep] + parts)


def pooled_config(results):
    """The configuration runs must share to pool: without repulsive heads, the repulsive settings
    (whose defaults changed over time) do not act and are left out."""
    config = dict(results["config"])
    if results["repulsive"] == "none":
        config.pop("repulsive_config", None)
        config.pop("selection", None)
    return config


def collect(roots):
    """{row: [run, ...]} over every results.json under the roots; a seed twice in a row is an error."""
    rows = {}
    for root in roots:
        if not os.path.isdir(root):
            sys.exit(f"translate_table.py: {root} is not a folder of probattn translate results")
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
                sys.exit(f"translate_table.py: {name}: {runs[0]['_folder']} and {r['_folder']} differ in {', '.join(keys)}; "
                         "pool runs of one configuration only")
        seeds = [r["seed"] for r in runs]
        if len(set(seeds)) != len(seeds):
            dup = sorted({s for s in seeds if seeds.count(s) > 1})
            folders = sorted({r["_folder"] for r in runs if r["seed"] in dup})
            sys.exit(f"translate_table.py: {name}: seed(s) {dup} appear more than once ({', '.join(folders)}); pool distinct seeds only")
    return rows


def dist(run):
    return statistics.mean(run["head_diversity"])


def main():
    args = sys.argv[1:]
    diff = "--diff" in args
    roots = [a for a in args if not a.startswith("--")] or ["results/translate"]
    rows = collect(roots)
    if not rows:
        sys.exit(f"translate_table.py: no probattn translate results.json under {', '.join(roots)}")
    names = [n for n in ORDER if n in rows] + sorted(n for n in rows if n not in ORDER)
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
            cell([dist(r) for r in runs], 3),
            " ".join(str(r["seed"]) for r in runs),
        ])
    header = ["attention", "test BLEU tok-lc", "test sacreBLEU", "valid sacreBLEU (best)", "epochs",
              "train tokens/s", "Dist (encoder)", "seeds"]
    print(markdown(header, table))
    if diff and "softmax" in rows:
        base = rows["softmax"]
        table = []
        for name in names:
            if name == "softmax":
                continue
            runs = rows[name]
            table.append([
                name,
                diff_cell([r["test_bleu_tok"] for r in runs], [r["test_bleu_tok"] for r in base]),
                diff_cell([r["test_bleu"] for r in runs], [r["test_bleu"] for r in base]),
                diff_cell([dist(r) for r in runs], [dist(r) for r in base], 3),
            ])
        print()
        print(markdown(["attention", "tok-lc BLEU minus softmax (± s.e.)", "sacreBLEU minus softmax (± s.e.)",
                        "Dist minus softmax (± s.e.)"], table))


if __name__ == "__main__":
    main()

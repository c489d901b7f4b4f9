"""sacreBLEU's corpus BLEU of a hypothesis file, for the parity test of `probattn bleu`.

    python -m probattn_tools.reference.bleu --ref REF --hyp HYP            # JSON, one entry per setting
    python -m probattn_tools.reference.bleu corrupt --ref REF --out HYP --seed 1

`corrupt` writes system-like outputs from a reference file: per line a seeded mix of dropped,
repeated, swapped and substituted words, changed case and punctuation, and now and then an empty
line, so that every n-gram order, the brevity penalty and the tokenizer's rules are exercised.
They are not a translation system's outputs; the test also scores real ones when a run left them.
"""

import argparse
import json
import random
import sys


SETTINGS = {
    "default": dict(),
    "lowercase": dict(lowercase=True),
    "tok-none": dict(tokenize="none"),
    "smooth-none": dict(smooth_method="none"),
}


def read(path):
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def score(args):
    from sacrebleu.metrics import BLEU
    refs, hyps = read(args.ref), read(args.hyp)
    out = {}
    for name, kwargs in SETTINGS.items():
        bleu = BLEU(**kwargs)
        s = bleu.corpus_score(hyps, [refs])
        out[name] = {"bleu": s.score, "precisions": s.precisions, "bp": s.bp, "sys_len": s.sys_len,
                     "ref_len": s.ref_len, "signature": str(bleu.get_signature())}
    json.dump(out, sys.stdout)


def corrupt(args):
    rng = random.Random(args.seed)
    vocab = sorted({w for line in read(args.ref) for w in line.split()})
    out = []
    for line in read(args.ref):
        words = line.split()
        if rng.random() < 0.02:
            out.append("")
            continue
        new = []
        for w in words:
            r = rng.random()
            if r < 0.08:
                continue  # dropped
            if r < 0.14:
                new.append(rng.choice(vocab))  # substituted
            elif r < 0.17:
                new += [w, w]  # repeated
            elif r < 0.20:
                new.append(w.lower() if w[:1].isupper() else w.capitalize())
            else:
                new.append(w)
        if len(new) > 2 and rng.random() < 0.2:
            i = rng.randrange(len(new) - 1)
            new[i], new[i + 1] = new[i + 1], new[i]
        text = " ".join(new)
        if rng.random() < 0.1:
            text = text.rstrip(".") + rng.choice([" .", "!", ", 2.5-3.0", " &amp; co.", "'s"])
        out.append(text)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="score", choices=["score", "corrupt"])
    parser.add_argument("--ref", required=True)
    parser.add_argument("--hyp")
    parser.add_argument("--out")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.command == "corrupt":
        corrupt(args)
    else:
        score(args)


if __name__ == "__main__":
    main()

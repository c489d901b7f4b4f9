"""The official VQA accuracy, as GT-Vision-Lab/VQA's vqaEval.py computes it, for checking
`probattn vqa-eval`; and seeded test files in the official formats.

    python -m probattn_tools.reference.vqa_eval score --questions Q.json --annotations A.json --results R.json
    python -m probattn_tools.reference.vqa_eval make-cases --out DIR --seed 0 [--questions 300]

`score` prints {"overall", "perAnswerType", "perQuestionType"} (0-100, rounded to 2 decimals).
Written from the official evaluation's steps: the prediction is cleaned (newlines, tabs, strip),
then punctuation- and digit/article-processed; the human answers get punctuation processing only
when they are not all equal; accuracy = mean over the left-out answer of min(1, matches / 3).
The regular expressions are the official ones, including `periodStrip.sub("", text, re.UNICODE)`,
whose third argument is the replacement count (re.UNICODE = 32).
"""

import argparse
import json
import os
import random
import re

from probattn_tools.files import atomic_write_json

PUNCT = [";", r"/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?", "!"]
COMMA_STRIP = re.compile(r"(\d)(,)(\d)")
PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)")
NUMBERS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
           "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
ARTICLES = ["a", "an", "the"]
# A sample of the official contraction map: the cases below use only these; the Rust side carries
# the whole map.
CONTRACTIONS = {"dont": "don't", "cant": "can't", "isnt": "isn't", "whats": "what's", "youre": "you're", "oclock": "o'clock",
                "somebody'd": "somebodyd", "twas": "'twas", "yall": "y'all", "Im": "I'm"}


def process_punctuation(text):
    out = text
    for p in PUNCT:
        if (p + " " in text or " " + p in text) or (re.search(COMMA_STRIP, text) is not None):
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    return PERIOD_STRIP.sub("", out, re.UNICODE)


def process_digit_article(text):
    words = [NUMBERS.setdefault(w, w) for w in text.lower().split()]
    words = [w for w in words if w not in ARTICLES]
    return " ".join(CONTRACTIONS.get(w, w) for w in words)


def score(questions, annotations, results):
    with open(annotations) as f:
        gts = {a["question_id"]: a for a in json.load(f)["annotations"]}
    with open(results) as f:
        res = {r["question_id"]: r for r in json.load(f)}
    acc_all, by_q, by_a = [], {}, {}
    for qid in gts:
        ans = res[qid]["answer"].replace("\n", " ").replace("\t", " ").strip()
        ans = process_digit_article(process_punctuation(ans))
        humans = [a["answer"] for a in gts[qid]["answers"]]
        if len(set(humans)) > 1:
            humans = [process_punctuation(h) for h in humans]
        accs = [min(1, sum(1 for j, h in enumerate(humans) if j != i and h == ans) / 3) for i in range(len(humans))]
        acc = sum(accs) / len(accs)
        acc_all.append(acc)
        by_q.setdefault(gts[qid]["question_type"], []).append(acc)
        by_a.setdefault(gts[qid]["answer_type"], []).append(acc)
    pct = lambda v: round(100 * sum(v) / len(v), 2)  # noqa: E731
    return {"overall": pct(acc_all), "perAnswerType": {k: pct(v) for k, v in sorted(by_a.items())},
            "perQuestionType": {k: pct(v) for k, v in sorted(by_q.items())}}


def make_cases(out, seed, n):
    rng = random.Random(seed)
    pool = ["yes", "no", "2", "two", "Two", "the dog", "a dog", "dog", "dont know", "don't know", "red.", "red", "1,000",
            "1000", "3.5", "left-right", "left right", "(blue)", "blue", "yes, it is", "yes it is", "cat's toy", "the cat's toy",
            "none", "0", "oclock", "twas", "what is it?", "whats it", "Im here", "a.m.", "am", "x...", "x", "e-mail", "email",
            "  padded  ", "tab\tanswer", "new\nline", "somebody'd", "yall", "It's", "it's"]
    qtypes, atypes = ["what color", "how many", "is the", "what is"], ["yes/no", "number", "other"]
    questions, annotations, results = [], [], []
    for qid in range(1, n + 1):
        questions.append({"question_id": qid, "image_id": qid // 3, "question": f"question {qid}?"})
        base = rng.choice(pool)
        if rng.random() < 0.3:
            humans = [base] * 10
        else:
            humans = [base if rng.random() < 0.5 else rng.choice(pool) for _ in range(10)]
        annotations.append({"question_id": qid, "image_id": qid // 3, "question_type": rng.choice(qtypes),
                            "answer_type": rng.choice(atypes), "multiple_choice_answer": base,
                            "answers": [{"answer": h, "answer_confidence": "yes", "answer_id": i + 1} for i, h in enumerate(humans)]})
        results.append({"question_id": qid, "answer": rng.choice(humans) if rng.random() < 0.7 else rng.choice(pool)})
    os.makedirs(out, exist_ok=True)
    for name, data in (("questions.json", {"questions": questions}), ("annotations.json", {"annotations": annotations}),
                       ("results.json", results)):
        atomic_write_json(os.path.join(out, name), data, indent=None)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("score")
    p.add_argument("--questions", required=True)
    p.add_argument("--annotations", required=True)
    p.add_argument("--results", required=True)
    p = sub.add_parser("make-cases")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--questions", type=int, default=300)
    args = parser.parse_args()
    if args.command == "score":
        print(json.dumps(score(args.questions, args.annotations, args.results)))
    else:
        make_cases(args.out, args.seed, args.questions)


if __name__ == "__main__":
    main()

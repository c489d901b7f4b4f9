"""Training steps of a tiny BERT (masked LM) on a padded batch, with transformers' `sdpa` and
probattn's implementations: milliseconds per forward and backward step (the median after the
warm-up steps) and the routes probattn's calls took (`probattn.attention_routes()`), one JSON
object on stdout. The batch's sequence b has its last 16·b tokens padded, so transformers builds
the padding mask every layer receives.

    PYTHONPATH=<package folder> python python/probattn/benchmarks/hf_padding.py \\
        --impls sdpa,probattn-dnas-me,probattn-softmax-me,probattn-sinkhorn-3-me

Every model starts from the same weights (seed 0); its loss is printed beside its time, so that a
route that computes something else shows. Needs transformers.
"""

import argparse
import json
import statistics
import sys
import time

import torch

from _record import git_state  # this folder's, beside the script


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", default="sdpa,probattn-dnas-me,probattn-softmax-me",
                   help="comma-separated attention implementations (sdpa, eager, or probattn's names)")
    p.add_argument("--batch", type=int, default=8, help="sequences in the batch (default 8)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--steps", type=int, default=7, help="timed steps (default 7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args()
    if args.batch < 1 or args.seq < 16 * args.batch or args.steps < 1 or args.warmup < 0 or args.threads < 1:
        sys.exit("error: --batch, --steps and --threads must be at least 1, --warmup 0 or more, and --seq at least "
                 "16 x --batch (the last sequence keeps 16 tokens)")
    return args


def main():
    args = parse_args()
    import probattn
    import probattn.hf
    from transformers import BertConfig, BertForMaskedLM

    registered = probattn.hf.register()
    impls = args.impls.split(",")
    unknown = [i for i in impls if i not in registered and i not in ("sdpa", "eager")]
    if unknown:
        sys.exit(f"error: unknown implementation(s) {unknown} (sdpa, eager, or one of {registered})")
    torch.set_num_threads(args.threads)
    config = BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=512, max_position_embeddings=max(512, args.seq),
                        attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    ids = torch.randint(5, 1000, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    padding = torch.ones(args.batch, args.seq, dtype=torch.long)
    for b in range(1, args.batch):
        padding[b, args.seq - 16 * b:] = 0
    out = {"settings": vars(args), "provenance": git_state(), "torch": torch.__version__, "rows": {}}
    for impl in impls:
        torch.manual_seed(0)
        model = BertForMaskedLM(config)
        model.set_attn_implementation(impl)
        probattn.attention_routes(reset=True)
        times = []
        for _ in range(args.warmup + args.steps):
            start = time.perf_counter()
            loss = model(input_ids=ids, attention_mask=padding, labels=ids).loss
            loss.backward()
            times.append(time.perf_counter() - start)
            model.zero_grad()
        out["rows"][impl] = {"ms": round(1000 * statistics.median(times[args.warmup:]), 1), "loss": loss.item(),
                             "routes": probattn.attention_routes()}
        print(f"{impl}: {out['rows'][impl]['ms']} ms, routes {out['rows'][impl]['routes']}", file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Training steps of a tiny BERT (masked LM) or Llama (causal LM) on a padded batch, with
transformers' `sdpa` and probattn's implementations: milliseconds per forward and backward step
(the median after the warm-up steps) and the routes probattn's calls took
(`probattn.attention_routes()`), one JSON object on stdout. The batch's sequence b has 16·b
tokens padded (BERT: its last ones; Llama: its first ones, as a batch for generation is padded),
so transformers builds the padding mask every layer receives.

    PYTHONPATH=<package folder> python python/probattn/benchmarks/hf_padding.py \\
        --impls sdpa,probattn-dnas-me,probattn-softmax-me,probattn-sinkhorn-3-me
    PYTHONPATH=<package folder> python python/probattn/benchmarks/hf_padding.py --model llama \\
        --impls sdpa,probattn-softmax-me,probattn-bam-wc-me --whole-mask

probattn's mask builder hands the library an encoder's padding mask as key padding and a causal
mask joined with padding as the causal pattern and key padding. `--whole-mask` adds a row for
each probattn implementation with transformers' own SDPA mask builder instead (the whole
(S, S) mask, a pattern), in the same run. Every model starts from the same weights (seed 0), and
BAM draws from the same seed; its loss is printed beside its time, so that a route that computes
something else shows. Needs transformers.
"""

import argparse
import json
import statistics
import sys
import time

import torch

from _record import git_state  # this folder's, beside the script


# A causal model takes only causal-safe variants (softmax, BAM over softmax).
DEFAULT_IMPLS = {"bert": "sdpa,probattn-dnas-me,probattn-softmax-me", "llama": "sdpa,probattn-softmax-me,probattn-bam-wc-me"}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("bert", "llama"), default="bert",
                   help="bert: a masked LM, padded at the end; llama: a causal LM with grouped-query attention "
                        "(4 query heads over 2 key/value heads), padded at the start (default bert)")
    p.add_argument("--whole-mask", action="store_true",
                   help="also run each probattn implementation under transformers' own SDPA mask builder")
    p.add_argument("--impls", help="comma-separated attention implementations (sdpa, eager, or probattn's names; "
                                   f"default for bert {DEFAULT_IMPLS['bert']}, for llama {DEFAULT_IMPLS['llama']})")
    p.add_argument("--batch", type=int, default=8, help="sequences in the batch (default 8)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--steps", type=int, default=7, help="timed steps (default 7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args()
    args.impls = args.impls or DEFAULT_IMPLS[args.model]
    if args.batch < 1 or args.seq < 16 * args.batch or args.steps < 1 or args.warmup < 0 or args.threads < 1:
        sys.exit("error: --batch, --steps and --threads must be at least 1, --warmup 0 or more, and --seq at least "
                 "16 x --batch (the last sequence keeps 16 tokens)")
    return args


def build(kind, seq):
    """The tiny model of `kind`, from seed 0."""
    from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, intermediate_size=512,
                                            max_position_embeddings=max(512, seq), attention_dropout=0.0))
    return BertForMaskedLM(BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=512, max_position_embeddings=max(512, seq),
                                      attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0))


def main():
    args = parse_args()
    import probattn
    import probattn.hf
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    registered, aliases = probattn.hf.register(), probattn.hf.names()
    impls = args.impls.split(",")
    unknown = [i for i in impls if i not in registered and i not in ("sdpa", "eager")]
    if unknown:
        sys.exit(f"error: unknown implementation(s) {unknown} (sdpa, eager, or one of {registered})")
    if args.model == "llama":
        leaking = [i for i in impls if aliases.get(i) and not probattn._registry.entry(aliases[i][0])["causal_safe"]]
        if leaking:
            sys.exit(f"error: {leaking} normalize each key over the queries, which a causal model refuses "
                     f"(--model llama takes softmax and BAM over softmax)")
    torch.set_num_threads(args.threads)
    ids = torch.randint(5, 1000, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    padding = torch.ones(args.batch, args.seq, dtype=torch.long)
    for b in range(1, args.batch):
        if args.model == "llama":
            padding[b, :16 * b] = 0
        else:
            padding[b, args.seq - 16 * b:] = 0
    runs = [(impl, False) for impl in impls]
    if args.whole_mask:
        runs += [(impl, True) for impl in impls if impl in registered]
    out = {"settings": vars(args), "provenance": git_state(), "torch": torch.__version__, "rows": {}}
    for impl, whole in runs:
        model = build(args.model, args.seq)
        model.set_attn_implementation(impl)
        variant = (aliases.get(impl) or (None,))[0]
        if variant is not None and probattn._registry.entry(variant)["parameters"]:
            probattn.hf.prepare(model, variant)
        if whole:
            AttentionMaskInterface.register(impl, sdpa_mask)
        probattn.attention_routes(reset=True)
        torch.manual_seed(1)
        times = []
        for _ in range(args.warmup + args.steps):
            start = time.perf_counter()
            loss = model(input_ids=ids, attention_mask=padding, labels=ids).loss
            loss.backward()
            times.append(time.perf_counter() - start)
            model.zero_grad()
        if whole:
            probattn.hf.register()
        name = f"{impl} (whole mask)" if whole else impl
        out["rows"][name] = {"ms": round(1000 * statistics.median(times[args.warmup:]), 1), "loss": loss.item(),
                             "routes": probattn.attention_routes()}
        print(f"{name}: {out['rows'][name]['ms']} ms, routes {out['rows'][name]['routes']}", file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

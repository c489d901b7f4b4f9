"""A tiny BERT trained as a masked language model (or, with `--model llama`, a tiny Llama as a
causal one) on Multi30k's English side with probattn's transformers implementations against
`sdpa`, the models trained in turns, step by step, on the same batches, masks and dropout draws from the
same initial weights: validation loss curves side by side and training tokens/s (results/python/mlm/,
results/python/llama/).

    python python/probattn/benchmarks/mlm.py --data $PROBATTN_DATA/multi30k \\
        --tokenizer results/translate/multi30k-softmax-seed1/tokenizer.json --out results/python/mlm

DNAS runs in the encoder only: it normalizes each key over the queries, which a causal model
must not do (docs/python.md). Models: BERT or Llama (2 key/value heads) with 2 layers, E 128,
4 heads, FFN 256, attention dropout 0 (the memory-efficient forms have none),
sentences cut to 48 BPE tokens, 15% of tokens masked (replaced by a [MASK] id added after the BPE
vocabulary), AdamW lr 1e-3, batch 32, one thread (or `--device cuda`). Writes curves.json (every step's loss and time,
the code's version), curves.md and val_loss.svg.
"""

import argparse
import copy
import json
import os
import random
import sys
import time

import torch
from _record import git_state, write_atomic  # this folder's, beside the script



def encode(tokenizer, path, limit):
    with open(path) as f:
        lines = [line.strip() for line in f if line.strip()]
    return [tokenizer.encode(line).ids[:limit] for line in lines]


def batches(sentences, count, size, pad, mask_id, vocab, seed):
    """`count` batches of `size` sentences: (input ids, labels with -100 off the masked tokens,
    attention mask), drawn and masked from `seed`."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        chosen = [sentences[rng.randrange(len(sentences))] for _ in range(size)]
        length = max(len(s) for s in chosen)
        ids = torch.full((size, length), pad, dtype=torch.long)
        for i, s in enumerate(chosen):
            ids[i, : len(s)] = torch.tensor(s)
        attention = (ids != pad).long()
        masked = (torch.rand(ids.shape, generator=g) < 0.15) & (attention == 1)
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        inputs = torch.where(masked, torch.full_like(ids, mask_id), ids)
        out.append((inputs, labels, attention))
    return out


def l_or_i(inputs, labels):
    """The unmasked ids: the label where a token was masked, else the input."""
    return torch.where(labels != -100, labels, inputs)


def svg(curves, path, title, width=640, height=360, pad=48):
    """Validation loss against step, one polyline per implementation."""
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    points = [(s, v) for c in curves.values() for s, v in zip(c["val_steps"], c["val_loss"])]
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    sx = lambda s: pad + (s - x0) / max(x1 - x0, 1) * (width - 2 * pad)  # noqa: E731
    sy = lambda v: height - pad - (v - y0) / max(y1 - y0, 1e-9) * (height - 2 * pad)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{width / 2}" y="20" text-anchor="middle">{title}</text>',
             f'<text x="{width / 2}" y="{height - 10}" text-anchor="middle">update</text>',
             f'<text x="{pad}" y="{height - pad + 16}" text-anchor="middle">{x0}</text>',
             f'<text x="{width - pad}" y="{height - pad + 16}" text-anchor="middle">{x1}</text>',
             f'<text x="{pad - 4}" y="{sy(y0)}" text-anchor="end">{y0:.2f}</text>',
             f'<text x="{pad - 4}" y="{sy(y1)}" text-anchor="end">{y1:.2f}</text>']
    for i, (name, c) in enumerate(curves.items()):
        colour = colours[i % len(colours)]
        pts = " ".join(f"{sx(s):.1f},{sy(v):.1f}" for s, v in zip(c["val_steps"], c["val_loss"]))
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{pts}"/>')
        parts.append(f'<text x="{width - pad - 150}" y="{pad + 16 * i}" fill="{colour}">{name}</text>')
    parts.append("</svg>")
    write_atomic(path, "\n".join(parts) + "\n")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="the Multi30k folder (train.en, val.en)")
    parser.add_argument("--tokenizer", required=True, help="a probattn translate run's tokenizer.json (joint BPE)")
    parser.add_argument("--model", choices=["bert", "llama"], default="bert")
    parser.add_argument("--impls", nargs="+", default=None,
                        help="default: sdpa probattn-softmax-me probattn-dnas-me (bert), sdpa probattn-softmax probattn-softmax-me (llama)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def build_models(args, build, config, device):
    """One model and optimizer per implementation, each from the same initial weights."""
    models, optimizers, curves = {}, {}, {}
    for impl in args.impls:
        torch.manual_seed(args.seed)
        m = build(copy.deepcopy(config))  # a config each: set_attn_implementation writes into it
        m.set_attn_implementation(impl)
        m.to(device)
        models[impl], optimizers[impl] = m, torch.optim.AdamW(m.parameters(), lr=1e-3)
        curves[impl] = {"train_loss": [], "seconds": [], "tokens": [], "val_steps": [], "val_loss": []}
    for impl, m in models.items():
        if m.config._attn_implementation != impl:
            sys.exit(f"error: the {impl} model runs {m.config._attn_implementation}")
    return models, optimizers, curves


def train_in_turns(args, models, optimizers, curves, train_batches, val_batches, sync):
    """Trains the models in turns, step by step, on the same batches, recording into `curves`."""
    def evaluate(m):
        m.eval()
        with torch.no_grad():
            losses = [m(input_ids=i, labels=l, attention_mask=a).loss.item() for i, l, a in val_batches]
        m.train()
        return sum(losses) / len(losses)

    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            for impl, m in models.items():
                curves[impl]["val_steps"].append(step)
                curves[impl]["val_loss"].append(evaluate(m))
            print(f"step {step:4d}: " + ", ".join(f"{impl} {c['val_loss'][-1]:.3f}" for impl, c in curves.items()), file=sys.stderr)
        if step == args.steps:
            break
        inputs, labels, attention = train_batches[step]
        for impl, m in models.items():  # in turns: drift of a shared machine hits each alike
            torch.manual_seed(args.seed * 1_000_003 + step)  # the same dropout masks for every model
            sync()
            start = time.perf_counter()
            loss = m(input_ids=inputs, labels=labels, attention_mask=attention).loss
            optimizers[impl].zero_grad()
            loss.backward()
            optimizers[impl].step()
            sync()
            c = curves[impl]
            c["seconds"].append(time.perf_counter() - start)
            c["tokens"].append(int(attention.sum()))
            c["train_loss"].append(loss.item())


def write_results(args, curves, device):
    """curves.json, curves.md and val_loss.svg under --out; prints the tables."""
    summary = {}
    for impl, c in curves.items():
        summary[impl] = {"final_val_loss": c["val_loss"][-1], "tokens_per_second": sum(c["tokens"]) / sum(c["seconds"])}
    base = summary[args.impls[0]]["tokens_per_second"]
    lines = [f"Tiny {'BERT MLM' if args.model == 'bert' else 'Llama causal LM'} on Multi30k en, {args.steps} updates of {args.batch} sentences, seed {args.seed}, {'CUDA' if device.type == 'cuda' else f'{args.threads} thread(s)'}:", "",
             "| implementation | final validation loss | training tokens/s | / " + args.impls[0] + " |", "|---|---|---|---|"]
    for impl, s in summary.items():
        lines.append(f"| {impl} | {s['final_val_loss']:.3f} | {s['tokens_per_second']:.0f} | {s['tokens_per_second'] / base:.2f} |")
    lines += ["", "Validation loss by update:", "", "| update | " + " | ".join(args.impls) + " |", "|---" * (len(args.impls) + 1) + "|"]
    for i, step in enumerate(curves[args.impls[0]]["val_steps"]):
        lines.append(f"| {step} | " + " | ".join(f"{curves[impl]['val_loss'][i]:.3f}" for impl in args.impls) + " |")
    result = {"settings": vars(args), "provenance": git_state(), "torch": torch.__version__, "summary": summary, "curves": curves}
    os.makedirs(args.out, exist_ok=True)
    for name, text in (("curves.json", json.dumps(result, indent=1) + "\n"), ("curves.md", "\n".join(lines) + "\n")):
        write_atomic(os.path.join(args.out, name), text)
    what = "MLM loss (Multi30k en, tiny BERT)" if args.model == "bert" else "causal LM loss (Multi30k en, tiny Llama)"
    svg(curves, os.path.join(args.out, "val_loss.svg"), "validation " + what)
    print("\n".join(lines))


def main():
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: CUDA is not available to this torch")
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # time each step to its end
    torch.set_num_threads(args.threads)
    if args.impls is None:
        args.impls = ["sdpa", "probattn-softmax-me", "probattn-dnas-me"] if args.model == "bert" else ["sdpa", "probattn-softmax", "probattn-softmax-me"]
    from tokenizers import Tokenizer
    from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM

    import probattn.hf

    registered = probattn.hf.register()
    for impl in args.impls:
        if impl not in registered and impl not in ("sdpa", "eager"):
            sys.exit(f"error: unknown implementation {impl!r} (sdpa, eager, or one of {registered})")
    tok = Tokenizer.from_file(args.tokenizer)
    vocab = tok.get_vocab_size()
    pad = tok.token_to_id("<pad>") if tok.token_to_id("<pad>") is not None else 1
    mask_id = vocab  # one id past the BPE vocabulary
    train = encode(tok, os.path.join(args.data, "train.en"), 48)
    val = encode(tok, os.path.join(args.data, "val.en"), 48)
    train_batches = batches(train, args.steps, args.batch, pad, mask_id, vocab, args.seed)
    val_batches = batches(val, 8, 64, pad, mask_id, vocab, args.seed + 1)
    if args.model == "llama":
        # A causal language model: every real token is a target, nothing is masked.
        train_batches = [(torch.where(a == 1, l_or_i(i, l), torch.full_like(i, pad)), torch.where(a == 1, l_or_i(i, l), torch.full_like(i, -100)), a)
                         for i, l, a in train_batches]
        val_batches = [(torch.where(a == 1, l_or_i(i, l), torch.full_like(i, pad)), torch.where(a == 1, l_or_i(i, l), torch.full_like(i, -100)), a)
                       for i, l, a in val_batches]
        config = LlamaConfig(vocab_size=vocab + 1, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=256, max_position_embeddings=64, attention_dropout=0.0, pad_token_id=pad)
        build = LlamaForCausalLM
    else:
        config = BertConfig(vocab_size=vocab + 1, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=256, max_position_embeddings=64, attention_probs_dropout_prob=0.0, pad_token_id=pad)
        build = BertForMaskedLM
    train_batches = [tuple(t.to(device) for t in b) for b in train_batches]
    val_batches = [tuple(t.to(device) for t in b) for b in val_batches]
    models, optimizers, curves = build_models(args, build, config, device)
    train_in_turns(args, models, optimizers, curves, train_batches, val_batches, sync)
    write_results(args, curves, device)


if __name__ == "__main__":
    main()

"""Translation in plain PyTorch: the model, BPE'd data, batching and recipe of a `probattn
translate` run (softmax attention; the Transformer, or the attentional LSTM of `--arch lstm`),
for training speed and BLEU side by side.

It reads the run's config.json and tokenizer.json (the Python `tokenizers` package loads the Rust
crate's file, so both sides see the same token ids), batches by token count in the same seeded
order, and trains the same model with the same loss and optimizer:

    probattn translate --max-updates 200 --threads 2 --out runs/ours     # writes config and tokenizer
    python -m probattn_tools.baselines.translate --run runs/ours --max-updates 200 --threads 2 > pytorch.json

Model: sqrt(E)-scaled embeddings shared by source, target and output; fairseq's sinusoidal
positions; post-norm encoder and decoder layers built from torch.nn.MultiheadAttention
(batch_first) and a ReLU FFN; dropout on embeddings, attention outputs and FFN outputs.
Loss: label-smoothed cross-entropy over non-padding targets, divided by their number. Optimizer:
fairseq's Adam with decoupled weight decay, written out as in `probattn` (optim.rs), and the
inverse-sqrt schedule. `--decode` adds greedy decoding of the test set (the baseline has no
key/value cache: each step re-runs the decoder on the prefix) and sacreBLEU of it.

Prints JSON: tokens_per_second (training loop only), updates, train_seconds, valid_loss,
and with --decode test_bleu (greedy) and its signature; on stderr, a line per epoch of training.

The attentional LSTM (`--arch lstm`, Deng et al. 2018) is written here independently of
models/src/lstm.rs: the encoder is `torch.nn.LSTM(bidirectional=True)` over packed sequences, one
per layer (ours reverses each sentence within its length); the decoder is `torch.nn.LSTMCell`s with
input feeding of the context; the attention is `softmax(q·m / sqrt(M))` of `q = W_a s_t` over the
memory, padded keys excluded (or, for a `dnas` run, causal DNAS: step t's score of source position
j less the logsumexp of that position's scores over steps 1..t, then the softmax); the output
`tanh(W_out [c; s])` and a generator. Its recipe: Adam
(β2 0.999) without weight decay, gradient norm clipping, the constant rate of the first epoch
(OpenNMT-py's decay acts between epochs), cross-entropy without smoothing, as the run's config says.

Weights both ways: `--load-state-dict SD.safetensors` loads a trained probattn model, exported with
`probattn export --checkpoint CKPT --out SD.safetensors`, with `load_state_dict(strict=True)`
instead of training, and `--export-torchscript M.pt` saves the model scripted (torch.jit.script)
for `probattn compare --native translation`. The parameter names are probattn's, except the one
shared embedding matrix, `embed` here (`encoder.embed_tokens.weight` there); the positions are a
non-persistent buffer, rebuilt from the config.

    probattn export --checkpoint RUN/seed-1/checkpoint_best.safetensors --out sd.safetensors
    python -m probattn_tools.baselines.translate --run RUN --load-state-dict sd.safetensors --export-torchscript base.pt
"""

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time

from typing import Optional

import torch
import torch.nn.functional as F

from probattn_tools.files import atomic_write_json, atomic_write_text

PAD, EOS = 1, 2


def read(path):
    """Lines as `probattn` reads them: split at \n only, a final newline ends the last line."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.strip() for line in lines]


def split_file(data_dir, split, lang):
    p = os.path.join(data_dir, f"{split}.{lang}")
    if not os.path.exists(p) and split == "valid":
        p = os.path.join(data_dir, f"val.{lang}")
    return p


def encode(tok, lines):
    return [tok.encode(l, add_special_tokens=False).ids + [EOS] for l in lines]


def token_batches(src, tgt, max_tokens, max_len):
    order = [i for i in range(len(src)) if len(src[i]) <= max_len and len(tgt[i]) <= max_len]
    order.sort(key=lambda i: (len(src[i]), len(tgt[i]), i))
    batches, cur, longest = [], [], 0
    for i in order:
        n = max(len(src[i]), len(tgt[i]))
        if cur and (len(cur) + 1) * max(longest, n) > max_tokens:
            batches.append(cur)
            cur, longest = [], 0
        longest = max(longest, n)
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def pad(rows):
    width = max(len(r) for r in rows)
    return torch.tensor([r + [PAD] * (width - len(r)) for r in rows], dtype=torch.long)


def sinusoids(rows, dim, pad_idx):
    half = dim // 2
    step = math.log(10000) / max(half - 1, 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.float) * -step)
    angles = torch.arange(rows, dtype=torch.float)[:, None] * freqs[None, :]
    table = torch.cat([angles.sin(), angles.cos()], 1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(rows, 1)], 1)
    table[pad_idx] = 0
    return table


def xavier_linear(i, o):
    layer = torch.nn.Linear(i, o)
    torch.nn.init.xavier_uniform_(layer.weight)
    torch.nn.init.zeros_(layer.bias)
    return layer


class Layer(torch.nn.Module):
    def __init__(self, e, heads, ffn, dropout, cross):
        super().__init__()
        self.self_attn = torch.nn.MultiheadAttention(e, heads, dropout=0.0, batch_first=True)
        self.self_attn_layer_norm = torch.nn.LayerNorm(e)
        if cross:
            self.encoder_attn = torch.nn.MultiheadAttention(e, heads, dropout=0.0, batch_first=True)
            self.encoder_attn_layer_norm = torch.nn.LayerNorm(e)
        self.fc1, self.fc2 = xavier_linear(e, ffn), xavier_linear(ffn, e)
        self.final_layer_norm = torch.nn.LayerNorm(e)
        self.p = dropout

    def forward(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor], memory: Optional[torch.Tensor] = None,
                memory_pad: Optional[torch.Tensor] = None, causal: Optional[torch.Tensor] = None) -> torch.Tensor:
        a, _ = self.self_attn(x, x, x, key_padding_mask=pad_mask if memory is None else None, attn_mask=causal, need_weights=False)
        x = self.self_attn_layer_norm(x + F.dropout(a, self.p, self.training))
        # hasattr is decided when TorchScript compiles each layer: encoder layers have no encoder_attn.
        if hasattr(self, "encoder_attn"):
            if memory is not None:
                c, _ = self.encoder_attn(x, memory, memory, key_padding_mask=memory_pad, need_weights=False)
                x = self.encoder_attn_layer_norm(x + F.dropout(c, self.p, self.training))
        f = self.fc2(F.relu(self.fc1(x)))
        return self.final_layer_norm(x + F.dropout(f, self.p, self.training))


class Seq2Seq(torch.nn.Module):
    __constants__ = ["pad", "e", "p"]  # TorchScript reads no module-level globals

    def __init__(self, cfg):
        super().__init__()
        t = cfg["model"]["transformer"]
        e, v = t["embed_dim"], cfg["model"]["vocab"]
        self.e, self.p, self.pad = e, t["dropout"], PAD
        self.embed = torch.nn.Parameter(torch.randn(v, e) * e ** -0.5)
        with torch.no_grad():
            self.embed[PAD] = 0
        self.register_buffer("positions", sinusoids(cfg["model"]["max_positions"] + PAD + 1, e, PAD), persistent=False)
        self.encoder = torch.nn.ModuleList(Layer(e, t["heads"], t["ffn_dim"], self.p, False) for _ in range(t["encoder_layers"]))
        self.decoder = torch.nn.ModuleList(Layer(e, t["heads"], t["ffn_dim"], self.p, True) for _ in range(t["decoder_layers"]))

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        keep = tokens.ne(self.pad)
        pos = torch.cumsum(keep.long(), 1) * keep + self.pad
        x = F.embedding(tokens, self.embed, self.pad) * math.sqrt(self.e) + F.embedding(pos, self.positions, self.pad)
        return F.dropout(x, self.p, self.training)

    def forward(self, src: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        src_pad, tgt_len = src.eq(self.pad), prev.size(1)
        x = self.embed_tokens(src)
        for layer in self.encoder:
            x = layer(x, src_pad)
        causal = torch.ones(tgt_len, tgt_len, dtype=torch.bool, device=src.device).triu(1)
        y = self.embed_tokens(prev)
        for layer in self.decoder:
            y = layer(y, None, memory=x, memory_pad=src_pad, causal=causal)
        return y @ self.embed.t()


class AttentionalLstm(torch.nn.Module):
    """The LSTM of `probattn translate --arch lstm` (softmax or causal DNAS attention), parameters
    named so that `probattn export`'s state dict loads through `load_probattn`."""

    def __init__(self, cfg):
        super().__init__()
        c, v = cfg["model"]["lstm"], cfg["model"]["vocab"]
        e, h, m, hd = c["embed_dim"], c["encoder_hidden"], 2 * c["encoder_hidden"], c["decoder_hidden"]
        self.p, self.pad, self.m, self.hd = c["dropout"], PAD, m, hd
        if c["variant"] not in ("softmax", "dnas"):
            raise ValueError(f"the LSTM baseline attends with softmax or causal DNAS, not {c['variant']}")
        self.causal_dnas = c["variant"] == "dnas"
        self.src_embed = torch.nn.Embedding(v, e, padding_idx=PAD)
        self.tgt_embed = torch.nn.Embedding(v, e, padding_idx=PAD)
        self.encoder = torch.nn.ModuleList(
            torch.nn.LSTM(e if l == 0 else m, h, batch_first=True, bidirectional=True) for l in range(c["encoder_layers"]))
        self.decoder = torch.nn.ModuleList(torch.nn.LSTMCell(e + m if l == 0 else hd, hd) for l in range(c["decoder_layers"]))
        self.linear_in = torch.nn.Linear(hd, m, bias=False)
        self.linear_out = torch.nn.Linear(m + hd, hd, bias=False)
        self.generator = torch.nn.Linear(hd, v)
        r = c["init_range"]
        for p in self.parameters():
            torch.nn.init.uniform_(p, -r, r)
        with torch.no_grad():
            self.src_embed.weight[PAD] = 0
            self.tgt_embed.weight[PAD] = 0

    def probattn_names(self):
        """probattn's name of each parameter -> its name here."""
        ours = {"encoder.embed_tokens.weight": "src_embed.weight", "decoder.embed_tokens.weight": "tgt_embed.weight",
                "decoder.attention.linear_in.weight": "linear_in.weight",
                "decoder.attention.linear_out.weight": "linear_out.weight",
                "generator.weight": "generator.weight", "generator.bias": "generator.bias"}
        for l in range(len(self.encoder)):
            for d, suffix in (("forward", ""), ("backward", "_reverse")):
                for w in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                    ours[f"encoder.layers.{l}.{d}.{w}"] = f"encoder.{l}.{w}_l0{suffix}"
        for l in range(len(self.decoder)):
            for w in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                ours[f"decoder.layers.{l}.{w}"] = f"decoder.{l}.{w}"
        return ours

    def load_probattn(self, sd):
        """Loads `probattn export`'s names (strict): encoder.layers.L.forward|backward.weight_ih, ..."""
        ours = self.probattn_names()
        unknown = sorted(set(sd) - set(ours))
        if unknown:
            raise RuntimeError(f"not parameters of the LSTM baseline: {', '.join(unknown)}")
        self.load_state_dict({ours[k]: t for k, t in sd.items()}, strict=True)

    def encode(self, src):
        lengths = src.ne(self.pad).sum(1)
        x = F.dropout(self.src_embed(src), self.p, self.training)
        for l, lstm in enumerate(self.encoder):
            if l:
                x = F.dropout(x, self.p, self.training)
            packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
            x, _ = lstm(packed)
            x, _ = torch.nn.utils.rnn.pad_packed_sequence(x, batch_first=True, total_length=src.size(1))
        return x

    def forward(self, src, prev):
        memory, src_pad = self.encode(src), src.eq(self.pad)
        b = src.size(0)
        hs = [memory.new_zeros(b, self.hd) for _ in self.decoder]
        cs = [memory.new_zeros(b, self.hd) for _ in self.decoder]
        feed, outs, past = memory.new_zeros(b, self.m), [], []
        emb = F.dropout(self.tgt_embed(prev), self.p, self.training)
        for t in range(prev.size(1)):
            x = torch.cat([emb[:, t], feed], 1)
            for l, cell in enumerate(self.decoder):
                if l:
                    x = F.dropout(x, self.p, self.training)
                hs[l], cs[l] = cell(x, (hs[l], cs[l]))
                x = hs[l]
            q = self.linear_in(x)
            scores = torch.einsum("bm,bsm->bs", q, memory) / math.sqrt(self.m)
            if self.causal_dnas:
                # Each source position over the steps so far. Padded positions' columns are
                # never attended, so they need no masking inside the logsumexp.
                past.append(scores)
                scores = scores - torch.logsumexp(torch.stack(past), 0)
            weights = scores.masked_fill(src_pad, -math.inf).softmax(-1)
            feed = torch.einsum("bs,bsm->bm", weights, memory)
            outs.append(F.dropout(torch.tanh(self.linear_out(torch.cat([feed, x], 1))), self.p, self.training))
        return self.generator(torch.stack(outs, 1))


def label_smoothed(logits, target, eps):
    lprobs = logits.float().log_softmax(-1)  # float32 under autocast too, as fairseq
    keep = target.ne(PAD).float()
    nll = -lprobs.gather(-1, target[..., None]).squeeze(-1) * keep
    smooth = -lprobs.sum(-1) * keep
    return (1 - eps) * nll.sum() + eps / lprobs.size(-1) * smooth.sum(), nll.sum()


class FairseqAdam:
    """fairseq's Adam with decoupled weight decay, as probattn's optim.rs."""

    def __init__(self, params, beta1, beta2, eps, wd):
        self.params = [p for p in params if p.requires_grad]
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.b1, self.b2, self.eps, self.wd, self.t = beta1, beta2, eps, wd, 0

    @torch.no_grad()
    def step(self, lr):
        self.t += 1
        step_size = lr * math.sqrt(1 - self.b2 ** self.t) / (1 - self.b1 ** self.t)
        for p, m, v in zip(self.params, self.m, self.v):
            if p.grad is None:
                continue
            g = p.grad
            m.mul_(self.b1).add_(g, alpha=1 - self.b1)
            v.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
            denom = v.sqrt().add_(self.eps)
            if self.wd:
                p.mul_(1 - lr * self.wd)
            p.addcdiv_(m, denom, value=-step_size)


def lr_at(s, update):
    if "warmup_updates" not in s:
        return s["lr"]  # OpenNMT-py's decay: constant within an epoch (the first, here)
    w = max(s["warmup_updates"], 1)
    if update < w:
        return s["warmup_init_lr"] + (s["lr"] - s["warmup_init_lr"]) * update / w
    return s["lr"] * math.sqrt(w / update)


@torch.no_grad()
def greedy(model, sources, max_len_a, max_len_b, batch=64):
    out = [None] * len(sources)
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    for k in range(0, len(order), batch):
        idx = order[k:k + batch]
        src = pad([sources[i] for i in idx])
        limits = [int(max_len_a * (len(sources[i]) - 1)) + max_len_b for i in idx]
        prefix = torch.full((len(idx), 1), EOS, dtype=torch.long)
        hyps, done = [[] for _ in idx], [False] * len(idx)
        for _ in range(max(limits) + 1):
            lp = model(src, prefix)[:, -1].log_softmax(-1)
            lp[:, :2] = -math.inf
            nxt = lp.argmax(-1).tolist()
            for j, t in enumerate(nxt):
                if not done[j] and (t == EOS or len(hyps[j]) >= limits[j]):
                    done[j] = True
                elif not done[j]:
                    hyps[j].append(t)
            if all(done):
                break
            col = torch.tensor([PAD if done[j] else t for j, t in enumerate(nxt)])[:, None]
            prefix = torch.cat([prefix, col], 1)
        for j, i in enumerate(idx):
            out[i] = hyps[j]
    return out


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a probattn translate run folder (config.json, tokenizer.json)")
    parser.add_argument("--max-updates", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--precision", choices=["f32", "tf32", "bf16"], default=None,
                        help="bf16: forward passes under torch.autocast(device, torch.bfloat16), backward after; "
                             "tf32 runs as f32 here, on the CPU (default: the run's config.json precision, f32 when "
                             "it has none)")
    parser.add_argument("--decode", action="store_true", help="greedy-decode the test set and score it")
    parser.add_argument("--hyp", metavar="FILE", help="with --decode: also write the test hypotheses here, one per line")
    parser.add_argument("--load-state-dict", metavar="SD", help="load these weights (strict) instead of training")
    parser.add_argument("--export-torchscript", metavar="M.pt", help="save the model scripted (after training or loading)")
    parser.add_argument("--logits", nargs=2, metavar=("IN", "OUT"),
                        help="with --load-state-dict: the eval-mode logits of IN's `src` and `prev` (safetensors) "
                             "to OUT, in IN's dtype, and nothing else; when IN also holds `r` (the logits' "
                             "shape), OUT also holds `grad.NAME`, the gradient of sum(r * logits) over the "
                             "live steps (prev not padding) for each parameter, by probattn's name (the LSTM)")
    parser.add_argument("--profile", metavar="OUT.json",
                        help="time the training loop's phases (forward with the loss, backward, clipping with the "
                             "optimizer step) and profile it (torch.profiler, CPU): each operator's self time and "
                             "calls to OUT.json")
    return parser.parse_args()


def write_logits(args, cfg, lstm):
    """--logits: the loaded model's eval-mode logits of IN (and, given `r`, the LSTM's gradients) to OUT."""
    from safetensors.torch import load_file, save_file
    if not args.load_state_dict:
        sys.exit("--logits needs --load-state-dict")
    inputs = load_file(args.logits[0])
    model = AttentionalLstm(cfg) if lstm else Seq2Seq(cfg)
    sd = load_file(args.load_state_dict)
    model.to(next(iter(sd.values())).dtype)
    model.load_probattn(sd) if lstm else model.load_state_dict(sd, strict=True)
    model.eval()
    logits = model(inputs["src"], inputs["prev"])
    out = {"logits": logits.detach().contiguous()}
    if "r" in inputs:
        if not lstm:
            sys.exit("--logits with `r` (gradients) is the LSTM's")
        live = inputs["prev"].ne(PAD).unsqueeze(-1).to(logits.dtype)
        (inputs["r"] * logits * live).sum().backward()
        params = dict(model.named_parameters())
        out.update({f"grad.{ours}": params[theirs].grad.contiguous()
                    for ours, theirs in model.probattn_names().items()})
    save_file(out, args.logits[1])


def read_splits(cfg, tok):
    """Each split as (source ids, target ids, target lines), cut to the run's limits."""
    d, s, t = cfg["data_dir"], cfg["src"], cfg["tgt"]
    lim = {"train": cfg.get("limit_train"), "valid": cfg.get("limit_valid"), "test": cfg.get("limit_test")}
    data = {}
    for split in ("train", "valid", "test"):
        src_lines, tgt_lines = read(split_file(d, split, s)), read(split_file(d, split, t))
        if lim[split]:
            src_lines, tgt_lines = src_lines[:lim[split]], tgt_lines[:lim[split]]
        data[split] = (encode(tok, src_lines), encode(tok, tgt_lines), tgt_lines)
    return data


def train(model, cfg, train_split, args, autocast):
    """Trains for args.max_updates updates, in the run's batches and order; returns (updates, tokens, seconds,
    seconds by phase, the profiler or None)."""
    opt = FairseqAdam(model.parameters(), cfg["adam"]["beta1"], cfg["adam"]["beta2"], cfg["adam"]["eps"], cfg["adam"]["weight_decay"])
    src, tgt, _ = train_split
    batches = token_batches(src, tgt, cfg["max_tokens"], cfg["model"]["max_positions"])
    updates, tokens, seconds, epoch = 0, 0, 0.0, 0
    model.train()
    phases = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}  # seconds of the training loop, by phase
    profiler = contextlib.nullcontext()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        profiler = profile(activities=[ProfilerActivity.CPU])
    with profiler:
        while updates < args.max_updates:
            order = list(range(len(batches)))
            random.Random(args.seed * 1_000_003 + epoch).shuffle(order)
            start = time.perf_counter()
            for b in order:
                if updates >= args.max_updates:
                    break
                rows = batches[b]
                s_t = pad([src[i] for i in rows])
                prev = pad([[EOS] + tgt[i][:-1] for i in rows])
                target = pad([tgt[i] for i in rows])
                ntok = sum(len(tgt[i]) for i in rows)
                t0 = time.perf_counter()
                with autocast():
                    loss, _ = label_smoothed(model(s_t, prev), target, cfg["label_smoothing"])
                for p in model.parameters():
                    p.grad = None
                t1 = time.perf_counter()
                (loss / ntok).backward()
                t2 = time.perf_counter()
                if cfg.get("max_grad_norm"):
                    torch.nn.utils.clip_grad_norm_(opt.params, cfg["max_grad_norm"])
                opt.step(lr_at(cfg["schedule"], updates))  # fairseq: update n runs at the rate set after n - 1
                t3 = time.perf_counter()
                for phase, t in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                    phases[phase] += t
                updates += 1
                tokens += ntok
            elapsed = time.perf_counter() - start
            seconds += elapsed
            epoch += 1
            print(f"epoch {epoch}: {updates} of {args.max_updates} updates, {tokens / seconds:.0f} tokens/s, {elapsed:.0f} s",
                  file=sys.stderr, flush=True)
    return updates, tokens, seconds, phases, profiler if args.profile else None


def valid_loss(model, cfg, valid_split, autocast):
    """The label-smoothed loss per target token over the validation split, in eval mode."""
    vs, vt, _ = valid_split
    total, ntok = 0.0, 0
    with torch.no_grad(), autocast():
        for rows in token_batches(vs, vt, cfg["max_tokens"], 10 ** 9):
            prev = pad([[EOS] + vt[i][:-1] for i in rows])
            loss, _ = label_smoothed(model(pad([vs[i] for i in rows]), prev), pad([vt[i] for i in rows]), cfg["label_smoothing"])
            total += loss.item()
            ntok += sum(len(vt[i]) for i in rows)
    return total / ntok


def decode_test(model, cfg, tok, test_split, hyp_path, out):
    """Greedy-decodes the test split into `out`: sentences/s, BLEU and its signature."""
    from sacrebleu.metrics import BLEU
    ts, _, refs = test_split
    dec = cfg["decode"]
    start = time.perf_counter()
    hyps = [tok.decode([i for i in h if i > EOS], skip_special_tokens=True).strip() for h in greedy(model, ts, dec["max_len_a"], dec["max_len_b"])]
    out["test_sentences_per_second"] = len(ts) / (time.perf_counter() - start)
    bleu = BLEU()
    out["test_bleu_greedy"] = bleu.corpus_score(hyps, [refs]).score
    out["test_signature"] = str(bleu.get_signature())
    if hyp_path:
        atomic_write_text(hyp_path, "".join(h + "\n" for h in hyps))


def main():
    args = parse_args()
    from tokenizers import Tokenizer
    if args.threads:
        torch.set_num_threads(args.threads)
    with open(os.path.join(args.run, "config.json")) as f:
        cfg = json.load(f)
    lstm = "lstm" in cfg["model"]
    variant = (cfg["model"].get("lstm") or cfg["model"]["transformer"])["variant"]
    if variant not in (("softmax", "dnas") if lstm else ("softmax",)) or cfg["repulsive"] != "none":
        sys.exit("the baseline is softmax attention (or the LSTM's causal DNAS) without repulsive heads; "
                 f"this run has {variant} attention and repulsive {cfg['repulsive']}")
    if lstm and args.export_torchscript:
        sys.exit("--export-torchscript is the Transformer's (the LSTM decoder is a Python loop)")
    if args.logits:
        write_logits(args, cfg, lstm)
        return
    tok = Tokenizer.from_file(os.path.join(args.run, "tokenizer.json"))
    data = read_splits(cfg, tok)
    torch.manual_seed(args.seed)
    precision = args.precision or cfg.get("precision", "f32")
    autocast = lambda: torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16")  # noqa: E731
    model = AttentionalLstm(cfg) if lstm else Seq2Seq(cfg)
    if args.load_state_dict:
        from safetensors.torch import load_file
        try:
            sd = load_file(args.load_state_dict)
            model.load_probattn(sd) if lstm else model.load_state_dict(sd, strict=True)
        except RuntimeError as e:
            sys.exit(f"error: {args.load_state_dict}: {e}")
        args.max_updates = 0
    updates, tokens, seconds, phases, profiler = train(model, cfg, data["train"], args, autocast)
    if profiler is not None:
        ops = {e.key: {"self_cpu_us": e.self_cpu_time_total, "calls": e.count} for e in profiler.key_averages()}
        record = {"precision": precision, "threads": torch.get_num_threads(), "updates": updates, "train_tokens": tokens,
                  "train_seconds": seconds, "phase_seconds": phases, "ops": ops}
        atomic_write_json(args.profile, record)
    model.eval()
    if args.export_torchscript:
        import warnings
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.jit.*deprecated.*")
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            torch.jit.script(model).save(args.export_torchscript)
    out = {"implementation": f"pytorch {torch.__version__}", "threads": torch.get_num_threads(), "precision": precision,
           "updates": updates,
           "train_seconds": seconds, "train_tokens": tokens, "phase_seconds": phases, "tokens_per_second": tokens / seconds if seconds else None,
           "valid_loss": valid_loss(model, cfg, data["valid"], autocast)}
    if args.decode:
        decode_test(model, cfg, tok, data["test"], args.hyp, out)
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()

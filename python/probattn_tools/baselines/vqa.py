"""Multi-view VQA in plain PyTorch: the same fusion, head and recipe as `probattn vqa`, over the
same cached region features, printing a results JSON, so accuracy and time per epoch compare on
one machine:

    python -m probattn_tools.baselines.vqa --data data/vqa/sort-of-clevr --features FEATURES.safetensors \
        --fusion dnas --seeds 1 --threads 2 [--export-torchscript model.pt]

(`probattn vqa` prints the features file it used; it is `<data>/features/<key>.safetensors`.)

Model (models/src/vqa.rs, Ding et al. 2020 Appendix B): primary boxes give queries, each secondary
view keys through its own linear map and its features untransformed as values;
y = LayerNorm(x_P + sum_s softmax-or-dnas-or-hnas(q k_s^T / sqrt(d)) x_s), one head, dropout 0.1 on
the weights; no-attention: the views' boxes concatenated, then the LayerNorm. Head: word
embeddings + GRU or LSTM (state at the last word), or a bag of words (`tanh(W mean_t e_t)`, the mean
over the question's words; `--question-encoder`); `--reasoning-layers` post-norm Transformer encoder
layers over the boxes plus the projected question; optionally a relational layer (`Relate`: each
box's closest / furthest / like-me summaries under learned metrics) whose output the glimpses read;
top-down attention with glimpses; element-wise
product with the question; two-layer classifier. Adam, cross-entropy, early stopping on validation
accuracy. Sub-module names follow the Rust model's parameter paths.
"""

import argparse
import json
import math
import os
import sys
import time
import warnings
from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file


def normalize(variant: str, z, hybrid_logit):
    """z (B, 1, Nq, Nk) -> weights over the keys of each query."""
    if variant == "softmax":
        return torch.softmax(z, -1)
    dnas = torch.softmax(z - torch.logsumexp(z, -2, keepdim=True), -1)
    if variant == "dnas":
        return dnas
    u = torch.sigmoid(hybrid_logit).view(1, -1, 1, 1)
    return u * dnas + (1 - u) * torch.softmax(z, -1)


class Normalizer(nn.Module):
    def __init__(self, variant: str, init_u: float):
        super().__init__()
        self.variant = variant
        if variant == "hnas":
            self.hybrid_logit = nn.Parameter(torch.full((1,), math.log(init_u / (1 - init_u))))
        else:  # not a parameter, not saved: only so that the scripted code is the same
            self.register_buffer("hybrid_logit", torch.zeros(1), persistent=False)

    def forward(self, z):
        return normalize(self.variant, z, self.hybrid_logit)


class View(nn.Module):
    """A secondary view's key map and normalizer."""

    def __init__(self, dim, key_dim, variant, init_u):
        super().__init__()
        self.key = nn.Linear(dim, key_dim)
        self.normalizer = Normalizer(variant, init_u)

    def forward(self, q, x, training: bool):
        w = self.normalizer(q @ self.key(x).unsqueeze(1).transpose(-1, -2))  # (B, 1, N_P, N_s)
        return w, (F.dropout(w, 0.1, training) @ x.unsqueeze(1)).squeeze(1)


class AttentionFusion(nn.Module):
    """y = LayerNorm(x_P + sum_s normalize(Q x_P (K_s x_s)^T / sqrt(d)) x_s), three views."""

    def __init__(self, dim, variant):
        super().__init__()
        self.query = nn.Linear(dim, dim)
        self.view1 = View(dim, dim, variant, 0.5)
        self.view2 = View(dim, dim, variant, 0.5)
        self.norm = nn.LayerNorm(dim)

    def forward(self, v0, v1, v2):
        q = self.query(v0).unsqueeze(1) / math.sqrt(v0.shape[-1])
        w1, y1 = self.view1(q, v1, self.training)
        w2, y2 = self.view2(q, v2, self.training)
        return self.norm(v0 + y1 + y2), [w1, w2]


class ConcatFusion(nn.Module):
    """No attention: the views' boxes concatenated, then the LayerNorm."""

    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)

    def forward(self, v0, v1, v2):
        no_weights: List[torch.Tensor] = []
        return self.norm(torch.cat([v0, v1, v2], 1)), no_weights


class Reasoning(nn.Module):
    __constants__ = ["prenorm"]

    def __init__(self, hidden, heads, dropout, prenorm=False):
        super().__init__()
        self.prenorm = prenorm
        self.self_attn = nn.MultiheadAttention(hidden, heads, dropout=dropout, batch_first=True)
        self.linear1, self.linear2 = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.dropout = dropout

    def forward(self, x):
        if self.prenorm:  # x + attn(LN x), x + ffn(LN x)
            h = self.norm1(x)
            x = x + F.dropout(self.self_attn(h, h, h, need_weights=False)[0], self.dropout, self.training)
            return x + F.dropout(self.linear2(F.relu(self.linear1(self.norm2(x)))), self.dropout, self.training)
        a = self.self_attn(x, x, x, need_weights=False)[0]
        x = self.norm1(x + F.dropout(a, self.dropout, self.training))
        return self.norm2(x + F.dropout(self.linear2(F.relu(self.linear1(x))), self.dropout, self.training))


class Relate(nn.Module):
    """Relational summaries of every box, no question: per head r and box i, scores over the other
    boxes j, s_rij = exp(log_scale_r) sign_r ||P_r z_i - P_r z_j||^2 + key_r(z_j), then
    x_i = [z_i, sum_j softmax_j(s_ri)_j z_j (per head), mean_j sigmoid(s_rij) (per head)], j != i.
    A softmax over a scaled squared distance is a soft argmin / argmax (closest / furthest), the
    sigmoid mass a count (objects like box i)."""

    __constants__ = ["heads", "metric_dim"]

    def __init__(self, hidden, heads, metric_dim):
        super().__init__()
        self.heads, self.metric_dim = heads, metric_dim
        self.metric = nn.Linear(hidden, heads * metric_dim, bias=False)
        self.key = nn.Linear(hidden, heads)
        self.sign = nn.Parameter(torch.tensor([-1.0 if r % 2 == 0 else 1.0 for r in range(heads)]))
        self.log_scale = nn.Parameter(torch.zeros(heads))

    def forward(self, z):
        b, n, h = z.shape
        p = self.metric(z).view(b, n, self.heads, self.metric_dim)
        d = (p.unsqueeze(2) - p.unsqueeze(1)).pow(2).sum(-1)  # (B, N_i, N_j, R)
        s = self.log_scale.exp() * self.sign * d + self.key(z).unsqueeze(1)
        other = ~torch.eye(n, dtype=torch.bool, device=z.device).view(1, n, n, 1)
        w = torch.softmax(s.masked_fill(~other, float("-inf")), 2)
        summary = torch.einsum("bijr,bjh->birh", w, z).reshape(b, n, self.heads * h)
        counts = (torch.sigmoid(s) * other).sum(2) / n
        return torch.cat([z, summary, counts], -1)


class VqaModel(nn.Module):
    __constants__ = ["prenorm", "primary_skip", "primary_beside"]

    def __init__(self, views, dim, variant, vocab, answers, hidden=128, layers=2, glimpses=2, word_dim=64, question_dim=128, dropout=0.1,
                 prenorm=False, relational_heads=0, metric_dim=8, question_encoder="gru", primary_skip=False, primary_beside=False):
        super().__init__()
        assert views == 3, "the baseline is written for three views"
        self.fusion = ConcatFusion(dim) if variant == "none" else AttentionFusion(dim, variant)
        self.embed = nn.Embedding(vocab, word_dim)
        # Exactly one of gru / lstm / bag exists; forward asks hasattr, which TorchScript resolves
        # when it compiles, so the scripted model holds only the chosen encoder.
        if question_encoder == "gru":
            self.gru = nn.GRU(word_dim, question_dim, batch_first=True)
        elif question_encoder == "lstm":
            self.lstm = nn.LSTM(word_dim, question_dim, batch_first=True)
        elif question_encoder == "bow":
            self.bag = nn.Linear(word_dim, question_dim)
        else:
            raise ValueError(f"question_encoder must be gru, lstm or bow, got {question_encoder!r}")
        self.box_proj, self.box_question = nn.Linear(dim, hidden), nn.Linear(question_dim, hidden)
        # The head also reads each primary box unfused: added, z_i = W y_i + W_P x^P_i (skip), or
        # beside the box after the relational layer, [z_i, W_P x^P_i] (beside).
        if primary_skip or primary_beside:
            if variant == "none":
                raise ValueError("primary_skip and primary_beside need an attention fusion: the concatenated views already hold the primary's boxes")
            if primary_skip and primary_beside:
                raise ValueError("primary_skip and primary_beside are two ways to read the primary's boxes: choose one")
            self.primary_proj = nn.Linear(dim, hidden)
        self.primary_skip, self.primary_beside = primary_skip, primary_beside
        self.prenorm = prenorm  # pre-norm reasoning layers, their stack's output added to the boxes it started from
        self.reasoning = nn.ModuleList([Reasoning(hidden, 4, dropout, prenorm) for _ in range(layers)])
        self.relate = Relate(hidden, relational_heads, metric_dim) if relational_heads > 0 else nn.Identity()
        width = hidden * (relational_heads + 1) + relational_heads + (hidden if primary_beside else 0)  # a box, its relational summaries, the primary's
        self.att_box, self.att_question = nn.Linear(width, hidden), nn.Linear(question_dim, hidden)
        self.att_logits = nn.Linear(hidden, glimpses)
        self.glimpse_proj, self.question_proj = nn.Linear(glimpses * width, hidden), nn.Linear(question_dim, hidden)
        self.classifier1, self.classifier2 = nn.Linear(hidden, hidden), nn.Linear(hidden, answers)
        self.dropout = dropout

    def encode_question(self, tokens):
        words = self.embed(tokens)
        if hasattr(self, "bag"):
            mask = tokens.ne(0).to(words.dtype).unsqueeze(2)
            return torch.tanh(self.bag((words * mask).sum(1) / mask.sum(1).clamp(min=1.0)))
        if hasattr(self, "lstm"):
            out, _ = self.lstm(words)
        else:
            out, _ = self.gru(words)
        last = (tokens.ne(0).sum(1) - 1).clamp(min=0)
        return out.gather(1, last.view(-1, 1, 1).expand(-1, 1, out.shape[2])).squeeze(1)

    def forward(self, v0, v1, v2, tokens):
        boxes, _ = self.fusion(v0, v1, v2)
        q = self.encode_question(tokens)
        z = self.box_proj(boxes)
        if hasattr(self, "primary_proj") and self.primary_skip:
            z = z + self.primary_proj(v0)
        if len(self.reasoning) > 0:
            start = z
            z = z + self.box_question(q).unsqueeze(1)
            for layer in self.reasoning:
                z = layer(z)
            if self.prenorm:
                z = start + z
        z = self.relate(z)
        if hasattr(self, "primary_proj") and self.primary_beside:
            z = torch.cat([z, self.primary_proj(v0)], -1)
        joint = F.relu(self.att_box(z) * self.att_question(q).unsqueeze(1))
        att = torch.softmax(self.att_logits(F.dropout(joint, self.dropout, self.training)), 1)
        v = F.relu(self.glimpse_proj((att.transpose(1, 2) @ z).flatten(1)))
        h = F.relu(self.classifier1(F.dropout(v * F.relu(self.question_proj(q)), self.dropout, self.training)))
        return self.classifier2(F.dropout(h, self.dropout, self.training))


def evaluate(model, views, split, data, batch=1024):
    model.eval()
    hits = torch.zeros(len(data["types"]))
    totals = torch.zeros(len(data["types"]))
    with torch.no_grad():
        q = data[split]
        for i in range(0, len(q["answer"]), batch):
            sl = slice(i, i + batch)
            img = q["image"][sl]
            pred = model(*(v[img] for v in views), q["tokens"][sl]).argmax(-1)
            hits.index_add_(0, q["type"][sl], (pred == q["answer"][sl]).float())
            totals.index_add_(0, q["type"][sl], torch.ones(len(img)))
    return (hits.sum() / totals.sum()).item(), (hits / totals.clamp(min=1)).tolist()


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="folder written by python/probattn_tools/data/vqa.py")
    p.add_argument("--features", required=True, help="the features cache probattn vqa wrote (view0, view1, view2)")
    p.add_argument("--fusion", default="dnas", choices=["none", "softmax", "dnas", "hnas"])
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--seed-start", type=int, default=0)
    p.add_argument("--max-epochs", type=int, default=30)
    p.add_argument("--patience", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-decay", type=float, default=1.0, help="multiply the learning rate by this after every --lr-patience epochs without a better validation accuracy (as probattn vqa)")
    p.add_argument("--lr-patience", type=int, default=2)
    p.add_argument("--reasoning-layers", type=int, default=2)
    p.add_argument("--reasoning-prenorm", action="store_true", help="pre-norm reasoning layers with a skip around their stack")
    p.add_argument("--relational-heads", type=int, default=0, help="heads of the relational layer before the glimpses (0: none)")
    p.add_argument("--relational-dim", type=int, default=8, help="size of each relational head's learned metric")
    p.add_argument("--question-encoder", default="gru", choices=["gru", "lstm", "bow"],
                   help="word embeddings + GRU or LSTM (state at the last word), or their mean (a bag of words)")
    p.add_argument("--primary-skip", action="store_true", help="the head also reads each primary box unfused (attention fusions; as probattn vqa)")
    p.add_argument("--primary-beside", action="store_true", help="the glimpses read each primary box unfused beside the head's box (attention fusions; as probattn vqa)")
    p.add_argument("--glimpses", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--max-train", type=int, default=0, help="use at most this many training questions (0: all)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--export-torchscript", help="save the last seed's kept model here (torch.jit.script)")
    return p.parse_args()


def train_one_seed(args, seed, meta, data, views):
    """Trains from `seed`, keeping the epoch with the best validation accuracy (early stopping with
    --patience, the rate decayed by --lr-decay); returns that model and its run record."""
    torch.manual_seed(seed)
    model = VqaModel(3, views[0].shape[-1], args.fusion, len(meta["vocab"]), len(meta["answers"]), args.hidden, args.reasoning_layers, args.glimpses,
                     prenorm=args.reasoning_prenorm, relational_heads=args.relational_heads, metric_dim=args.relational_dim,
                     question_encoder=args.question_encoder, primary_skip=args.primary_skip and args.fusion != "none",
                     primary_beside=args.primary_beside and args.fusion != "none")
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    best, best_state, best_epoch, waited, epoch_times = -1.0, None, 0, 0, []
    tr = data["train"]
    for epoch in range(args.max_epochs):
        model.train()
        start = time.perf_counter()
        order = torch.randperm(len(tr["answer"]))
        total = 0.0
        for i in range(0, len(order), args.batch):
            idx = order[i : i + args.batch]
            img = tr["image"][idx]
            loss = F.cross_entropy(model(*(v[img] for v in views), tr["tokens"][idx]), tr["answer"][idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        epoch_times.append(time.perf_counter() - start)
        val, _ = evaluate(model, views, "val", data)
        print(f"{args.fusion} seed {seed} epoch {epoch}: train loss {total / math.ceil(len(order) / args.batch):.4f}, val acc {val:.4f}, {epoch_times[-1]:.1f} s", file=sys.stderr, flush=True)
        if val > best:
            best, best_epoch, waited = val, epoch, 0
            best_state = {k: v.clone() for k, v in model.state_dict().items()}
        else:
            waited += 1
            if waited >= args.patience:
                break
            if args.lr_decay != 1.0 and waited % args.lr_patience == 0:
                for group in opt.param_groups:
                    group["lr"] *= args.lr_decay
    model.load_state_dict(best_state)
    test, by_type = evaluate(model, views, "test", data)
    return model, {"seed": seed, "val_acc": best, "test_acc": test, "test_acc_by_type": dict(zip(meta["types"], by_type)), "best_epoch": best_epoch,
                   "epochs": len(epoch_times), "epoch_seconds": sum(epoch_times) / len(epoch_times)}


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = json.load(open(os.path.join(args.data, "meta.json")))
    raw = load_file(os.path.join(args.data, "data.safetensors"))
    data = {"types": meta["types"]}
    for s in ("train", "val", "test"):
        data[s] = {k: raw[f"{s}_{k}"] for k in ("image", "tokens", "answer", "type")}
    if args.max_train:
        data["train"] = {k: v[: args.max_train] for k, v in data["train"].items()}
    feats = load_file(args.features)
    views = [feats[f"view{i}"] for i in range(3)]
    runs = []
    for seed in range(args.seed_start, args.seed_start + args.seeds):
        model, run = train_one_seed(args, seed, meta, data, views)
        runs.append(run)
        if args.export_torchscript:
            model.eval()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # TorchScript is deprecated in 2.11 but is what libtorch loads
                torch.jit.script(model).save(args.export_torchscript)
    print(json.dumps({"fusion": args.fusion, "torch": torch.__version__, "threads": torch.get_num_threads(), "runs": runs}, indent=2))


if __name__ == "__main__":
    main()

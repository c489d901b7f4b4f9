"""How many updates does the Relation Network recipe need on *perfect objects*? Santoro et al.
(2017)'s RN head on the 6 objects' true state (one-hot colour, one-hot shape, centre (x, y) in
[0, 1]; no detectors, no grid, no fusion) and the question as the RN paper encodes it (one-hot
colour + one-hot question type), g: 4 x 256 ReLU MLP over every ordered pair with the question,
summed, f: 256-256-answers; Adam, batch 64, cross-entropy; validation accuracy per type on the
first 3,000 validation questions every 1,000 updates (columns as the other logs: shape, horizontal,
vertical, closest, furthest, count). Training questions and images are the default data's.

    python rn_objects.py UPDATES LR [SEED [VARIANT]]   (PAD=N in the environment: N empty boxes)

VARIANT rn (default) or nearest: per object i and head r (3 heads), a softmax over the other
objects j of s_rij = exp(tau_r) b_r ||P_r (e_i - e_j)||^2 + key_r(e_j) (e = an MLP of the object,
P_r a learned 8-d metric, b_r a learned sign started at -1, +1, -1), giving the summaries
sum_j softmax_j e_j and a count mean_j sigmoid(s_rij) beside e_i; then one question-guided
attention over the objects reads the summaries, and an MLP of them and the question answers.
nearest-gru: the question as the VQA model encodes it instead (word embeddings 64, GRU 128, the
state at the last word) in place of the one-hot. nearest-bow: the question as the mean of its word
embeddings (64) through a linear map to 128 (a bag of words: order lost, but colour and type each
a separate word). nearest-grubow: the GRU state and that bag of words concatenated (256).
"""
import json, os, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
from safetensors.torch import load_file

updates, lr, seed = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0
variant = sys.argv[4] if len(sys.argv) > 4 else "rn"
torch.set_num_threads(int(os.environ.get("THREADS", "1")))
torch.manual_seed(seed)
meta = json.load(open("data/vqa/sort-of-clevr/meta.json"))
raw = load_file("data/vqa/sort-of-clevr/data.safetensors")
col, shp, cen = raw["aux_color"].flatten(1), raw["aux_shape"].flatten(1), raw["aux_center"].flatten(1, 2)
# objects per image from the label grid: colour k's cell (an image whose two centres share a cell
# loses one object; the object then reads as all zeros)
n_img = col.shape[0]
objects = torch.zeros(n_img, 6, 10)
for k in range(1, 7):
    has = col == k  # (n, G*G)
    cell = has.float().argmax(1)
    present = has.any(1).float().unsqueeze(1)
    objects[:, k - 1, k - 1] = present.squeeze(1)
    s = shp.gather(1, cell.unsqueeze(1)).squeeze(1)
    objects[:, k - 1, 6:8] = F.one_hot(s.clamp(min=1) - 1, 2).float() * present
    objects[:, k - 1, 8:10] = cen[torch.arange(n_img), cell] * present
if os.environ.get("PAD"):  # PAD=19: 19 all-zero "empty cells" after the objects, 25 boxes as the label grid has
    objects = torch.cat([objects, torch.zeros(n_img, int(os.environ["PAD"]), 10)], 1)
vocab = meta["vocab"]
inv = {i: w for i, w in enumerate(vocab)} if isinstance(vocab, list) else {v: k for k, v in vocab.items()}
colors = meta["colors"]


def encode(split):
    tok, typ = raw[f"{split}_tokens"], raw[f"{split}_type"]
    colour_ids = torch.tensor([i for i, w in inv.items() if w in colors])
    colour_of = {i: colors.index(inv[i]) for i in colour_ids.tolist()}
    c = torch.tensor([next(colour_of[int(t)] for t in row if int(t) in colour_of) for row in tok])
    return torch.cat([F.one_hot(c, 6), F.one_hot(typ, 6)], 1).float()


data = {s: (raw[f"{s}_image"], raw[f"{s}_tokens"] if ("gru" in variant or "bow" in variant) else encode(s), raw[f"{s}_answer"], raw[f"{s}_type"]) for s in ("train", "val")}
data["val"] = tuple(t[:3000] for t in data["val"])


class RN(nn.Module):
    def __init__(self, answers):
        super().__init__()
        self.g = nn.Sequential(nn.Linear(2 * 10 + 12, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                               nn.Linear(256, 256), nn.ReLU())
        self.f = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Dropout(0.5), nn.Linear(256, answers))

    def forward(self, o, q):
        b, n, _ = o.shape
        pairs = torch.cat([o.unsqueeze(2).expand(b, n, n, -1), o.unsqueeze(1).expand(b, n, n, -1), q.view(b, 1, 1, -1).expand(b, n, n, -1)], -1)
        return self.f(self.g(pairs).sum((1, 2)))


class Nearest(nn.Module):
    def __init__(self, answers, e=64, heads=3, k=8):
        super().__init__()
        self.heads, self.k = heads, k
        self.embed = nn.Sequential(nn.Linear(10, e), nn.ReLU(), nn.Linear(e, e))
        self.metric = nn.Linear(e, heads * k, bias=False)
        self.key = nn.Linear(e, heads)
        self.sign = nn.Parameter(torch.tensor([-1.0, 1.0, -1.0]))
        self.tau = nn.Parameter(torch.zeros(heads))
        width = e * (heads + 1) + heads
        self.gru, self.bow = "gru" in variant, "bow" in variant
        qd = 128 * (self.gru + self.bow) if (self.gru or self.bow) else 12
        if self.gru or self.bow:
            self.embed_words = nn.Embedding(len(vocab), 64)
        if self.gru:
            self.rnn = nn.GRU(64, 128, batch_first=True)
        if self.bow:
            self.bag = nn.Linear(64, 128)
        self.att_obj, self.att_q, self.att_logit = nn.Linear(width, 128), nn.Linear(qd, 128), nn.Linear(128, 1)
        self.f = nn.Sequential(nn.Linear(width + qd, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, answers))

    def forward(self, o, q):
        b, n, _ = o.shape
        if self.gru or self.bow:  # q holds the tokens
            words, parts = self.embed_words(q), []
            if self.gru:
                out, _ = self.rnn(words)
                last = (q.ne(0).sum(1) - 1).clamp(min=0)
                parts.append(out.gather(1, last.view(-1, 1, 1).expand(-1, 1, out.shape[2])).squeeze(1))
            if self.bow:
                m = q.ne(0).float().unsqueeze(2)
                parts.append(torch.tanh(self.bag((words * m).sum(1) / m.sum(1).clamp(min=1))))
            q = torch.cat(parts, -1)
        e = self.embed(o)
        p = self.metric(e).view(b, n, self.heads, self.k)
        d = (p.unsqueeze(2) - p.unsqueeze(1)).pow(2).sum(-1)  # (B, N_i, N_j, R)
        s = (self.tau.exp() * self.sign) * d + self.key(e).unsqueeze(1)
        eye = torch.eye(n, dtype=torch.bool).view(1, n, n, 1)
        w = torch.softmax(s.masked_fill(eye, float("-inf")), 2)
        summary = torch.einsum("bijr,bjh->birh", w, e).flatten(2)
        counts = torch.sigmoid(s).masked_fill(eye, 0.0).sum(2) / n
        x = torch.cat([e, summary, counts], -1)  # (B, N, width)
        a = torch.softmax(self.att_logit(F.relu(self.att_obj(x) * self.att_q(q).unsqueeze(1))), 1)
        return self.f(torch.cat([(a * x).sum(1), q], -1))


model = RN(len(meta["answers"])) if variant == "rn" else Nearest(len(meta["answers"]))
opt = torch.optim.Adam(model.parameters(), lr=lr)
img, q, ans, typ = data["train"]
order = torch.randperm(len(ans))
start = time.time()
for step in range(1, updates + 1):
    i = ((step - 1) * 64) % len(order)
    if i == 0 and step > 1:
        order = torch.randperm(len(ans))
    idx = order[i:i + 64]
    model.train()
    loss = F.cross_entropy(model(objects[img[idx]], q[idx]), ans[idx])
    opt.zero_grad(); loss.backward(); opt.step()
    if step % 1000 == 0:
        model.eval()
        vi, vq, va, vt = data["val"]
        with torch.no_grad():
            pred = torch.cat([model(objects[vi[j:j + 1000]], vq[j:j + 1000]).argmax(-1) for j in range(0, len(va), 1000)])
        hit = (pred == va).float()
        by = [round(hit[vt == t].mean().item(), 2) for t in range(6)]
        print(variant + "-objects", step, f"{time.time() - start:.0f}s", f"{hit.mean().item():.3f}", by, flush=True)

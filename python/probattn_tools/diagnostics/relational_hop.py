"""Does a second, relational hop give the head pairwise reasoning? python/probattn_tools/baselines/vqa.py's model
(softmax fusion, no reasoning layers) with a hop after the top-down glimpses: the second hop's
score for box j is an MLP of (z_j, the glimpses, the question), so it can score each box by its
relation to the object the first hop found; its glimpse joins the classifier input.
Validation accuracy per type every 500 updates (selection on val only).

    python relational_hop.py VARIANT UPDATES [SEED]

ORACLE=1 in the environment replaces the detector features with the objects' true state, per cell
of the 5x5 label grid (one-hot colour, one-hot shape, centre: the detectors' own labels), as all
three views.

VARIANT: L0 (no hop), hop, hop-pos (a learned embedding per primary region added to the boxes),
hop-count (hop plus the hop's sigmoid mass sum_j sigma(s_j), a count), hop-pos-count; rn: instead
of a hop, a relation-network term (Santoro et al. 2017) over every pair of boxes,
sum_ij W_2 relu(W_1 relu(A z_i + B z_j + C q)), joined with the glimpses (no hop).
metric: R = 2 relational glimpses anchored on the first top-down glimpse's box a = sum_j att_1j z_j:
score s_rj = t_r(z_j, q) + beta_r(q) ||P_r (z_j - a)||^2 (P_r a learned k = 8 dimensional metric,
beta_r a linear function of the question, t_r a top-down score), joined with the glimpses as
sum_j softmax(s_r)_j z_j and a count sum_j sigmoid(s_rj). A squared distance to the anchor is
what an additive MLP score (hop) has to approximate and a softmax over -beta d is an argmin.
metric-anchor: the anchor from its own top-down attention instead of the first glimpse;
metric-temp: the distance term scaled by exp(tau), tau a learned scalar from log 10;
metric-anchor-temp: both.
pairwise: before the glimpses, a relational layer over the boxes that needs no question: per head r
(R = 3) and box i, scores over the other boxes j, s_rij = exp(tau_r) b_r ||P_r (z_i - z_j)||^2 +
key_r(z_j) (b_r a learned sign, started at -1, +1, -1 so the heads differ), giving
sum_j softmax_j(s_ri)_j V_r z_j and a count sum_j sigmoid(s_rij); both, projected, are added to z_i.
The top-down glimpse that finds c for shape questions can then read c's closest / furthest /
same-shape summaries from c's box. pairwise-zero: the layer's output map started at zero
(the plain pairwise layer kept even the shape questions at 0.75 after 4,500 updates). Both: the
counts divided by the number of boxes and the layer's output LayerNormed before its map (without,
even the zero-started layer held shape questions at 0.75).
nearest: the pairwise layer's summaries and counts (its V_r the identity) concatenated to each box
instead of added, x_i = [z_i, sum_j softmax_j(s_1i) z_j, ..., counts_i], and the top-down glimpses
read x (rn_objects.py's `nearest`, which learned closest / furthest on perfect objects).
nearest-read: also rn_objects.py's readout: one question-guided attention over x, then an MLP
(256, 256) of the attended x and the question, instead of the glimpses and the product head.
nearest-mlp: the metric an MLP of the box (P_r relu(W z)) rather than linear in it, as
rn_objects.py's metric acts on an MLP embedding of the object.
nearest-nofusion: the primary view's boxes go to the head as they are (no fusion, no LayerNorm).
Any variant with `bow` in its name encodes the question as a bag of words instead of the GRU state:
tanh(W mean_t e_t) (128), the mean of the word embeddings (rn_objects.py's nearest-bow, which
learned closest where the GRU state did not)."""
import math, os, sys, time, json
import torch, torch.nn as nn, torch.nn.functional as F
from safetensors.torch import load_file
from probattn_tools.baselines import vqa as B

variant, updates, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0
torch.set_num_threads(int(os.environ.get("THREADS", "1")))
meta = json.load(open("data/vqa/sort-of-clevr/meta.json"))
raw = load_file("data/vqa/sort-of-clevr/data.safetensors")
data = {"types": meta["types"]}
for s in ("train", "val"):
    data[s] = {k: raw[f"{s}_{k}"] for k in ("image", "tokens", "answer", "type")}
data["val"] = {k: v[:3000] for k, v in data["val"].items()}
if os.environ.get("ORACLE"):
    state = torch.cat([F.one_hot(raw["aux_color"].flatten(1), 7).float(), F.one_hot(raw["aux_shape"].flatten(1), 3).float(),
                       raw["aux_center"].flatten(1, 2)], -1)
    views = [state, state, state]
else:
    feats = load_file("data/vqa/sort-of-clevr/features/e0e6757cb6d94ca7.safetensors")
    views = [feats[f"view{i}"] for i in range(3)]
hop, pos, count, rn = variant.startswith("hop"), "pos" in variant, "count" in variant, variant == "rn"
metric = variant.startswith("metric")
pairwise = variant.startswith("pairwise")
nearest = variant.startswith("nearest")
R, K = 2, 8


class Model(B.VqaModel):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        h, g, qd = 128, 2, 128
        if hop:
            self.hop_box = nn.Linear(h, h)
            self.hop_context = nn.Linear(g * h + qd, h)
            self.hop_hidden = nn.Linear(h, h)
            self.hop_logits = nn.Linear(h, 1)
            self.glimpse_proj = nn.Linear((g + 1) * h + (1 if count else 0), h)
        if rn:
            self.rn_a, self.rn_b, self.rn_q = nn.Linear(h, h), nn.Linear(h, h, bias=False), nn.Linear(qd, h, bias=False)
            self.rn_hidden = nn.Linear(h, h)
            self.glimpse_proj = nn.Linear((g + 1) * h, h)
        if metric:
            self.rel_box, self.rel_question = nn.Linear(h, h), nn.Linear(qd, h)
            self.rel_logits = nn.Linear(h, R)
            self.rel_metric = nn.Linear(h, R * K, bias=False)
            self.rel_scale = nn.Linear(qd, R)
            if "anchor" in variant:
                self.anchor_box, self.anchor_question, self.anchor_logits = nn.Linear(h, h), nn.Linear(qd, h), nn.Linear(h, 1)
            if "temp" in variant:
                self.rel_tau = nn.Parameter(torch.full((1,), math.log(10.0)))
            self.glimpse_proj = nn.Linear((g + R) * h + R, h)
        if pairwise:
            self.pair_metric = nn.Linear(h, 3 * K, bias=False)
            self.pair_key = nn.Linear(h, 3)
            self.pair_value = nn.Linear(h, 3 * h)
            self.pair_sign = nn.Parameter(torch.tensor([-1.0, 1.0, -1.0]))
            self.pair_tau = nn.Parameter(torch.zeros(3))
            self.pair_out = nn.Linear(3 * h + 3, h)
            self.pair_norm = nn.LayerNorm(3 * h + 3)
            if "zero" in variant:  # start as the identity on z: the glimpses learn first
                nn.init.zeros_(self.pair_out.weight); nn.init.zeros_(self.pair_out.bias)
        if nearest:
            width = 4 * h + 3
            self.pair_metric = nn.Linear(h, 3 * K, bias=False)
            if "mlp" in variant:
                self.pair_metric = nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 3 * K, bias=False))
            self.pair_key = nn.Linear(h, 3)
            self.pair_sign = nn.Parameter(torch.tensor([-1.0, 1.0, -1.0]))
            self.pair_tau = nn.Parameter(torch.zeros(3))
            self.att_box = nn.Linear(width, h)
            self.glimpse_proj = nn.Linear(g * width, h)
            if "read" in variant:
                self.read_obj, self.read_q, self.read_logit = nn.Linear(width, 128), nn.Linear(qd, 128), nn.Linear(128, 1)
                self.read_f = nn.Sequential(nn.Linear(width + qd, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, len(meta["answers"])))
        if pos:
            self.position = nn.Parameter(torch.zeros(views[0].shape[1], h))
        if "bow" in variant:
            self.bag = nn.Linear(self.embed.embedding_dim, qd)

    def forward(self, v0, v1, v2, tokens):
        boxes, _ = self.fusion(v0, v1, v2)
        if "nofusion" in variant:
            boxes = v0
        if "bow" in variant:
            m = tokens.ne(0).float().unsqueeze(2)
            q = torch.tanh(self.bag((self.embed(tokens) * m).sum(1) / m.sum(1).clamp(min=1)))
        else:
            out, _ = self.gru(self.embed(tokens))
            last = (tokens.ne(0).sum(1) - 1).clamp(min=0)
            q = out.gather(1, last.view(-1, 1, 1).expand(-1, 1, out.shape[2])).squeeze(1)
        z = self.box_proj(boxes)
        if pos:
            z = z + self.position
        if pairwise:
            n = z.shape[1]
            p = self.pair_metric(z).view(z.shape[0], n, 3, K)
            d = (p.unsqueeze(2) - p.unsqueeze(1)).pow(2).sum(-1)  # (B, N_i, N_j, 3)
            sc = (self.pair_tau.exp() * self.pair_sign) * d + self.pair_key(z).unsqueeze(1)
            eye = torch.eye(n, dtype=torch.bool).view(1, n, n, 1)
            w = torch.softmax(sc.masked_fill(eye, float("-inf")), 2)  # over j
            vals = self.pair_value(z).view(z.shape[0], n, 3, z.shape[2])
            summary = torch.einsum("bijr,bjrh->birh", w, vals).flatten(2)
            counts = torch.sigmoid(sc).masked_fill(eye, 0.0).sum(2) / n  # (B, N, 3)
            z = z + self.pair_out(self.pair_norm(torch.cat([summary, counts], -1)))
        if nearest:
            n = z.shape[1]
            p = self.pair_metric(z).view(z.shape[0], n, 3, K)
            d = (p.unsqueeze(2) - p.unsqueeze(1)).pow(2).sum(-1)  # (B, N_i, N_j, 3)
            sc = (self.pair_tau.exp() * self.pair_sign) * d + self.pair_key(z).unsqueeze(1)
            eye = torch.eye(n, dtype=torch.bool).view(1, n, n, 1)
            w = torch.softmax(sc.masked_fill(eye, float("-inf")), 2)
            summary = torch.einsum("bijr,bjh->birh", w, z).flatten(2)
            counts = torch.sigmoid(sc).masked_fill(eye, 0.0).sum(2) / n
            z = torch.cat([z, summary, counts], -1)
            if "read" in variant:
                a = torch.softmax(self.read_logit(F.relu(self.read_obj(z) * self.read_q(q).unsqueeze(1))), 1)
                return self.read_f(torch.cat([(a * z).sum(1), q], -1))
        joint = F.relu(self.att_box(z) * self.att_question(q).unsqueeze(1))
        att = torch.softmax(self.att_logits(F.dropout(joint, self.dropout, self.training)), 1)
        g = (att.transpose(1, 2) @ z).flatten(1)  # (B, G*H)
        parts = [g]
        if hop:
            context = self.hop_context(torch.cat([g, q], 1)).unsqueeze(1)  # (B, 1, H)
            s = self.hop_logits(F.relu(self.hop_hidden(F.relu(self.hop_box(z) + context)))).squeeze(2)  # (B, N)
            parts.append((torch.softmax(s, 1).unsqueeze(1) @ z).squeeze(1))
            if count:
                parts.append(torch.sigmoid(s).sum(1, keepdim=True))
        if metric:
            if "anchor" in variant:
                a_att = torch.softmax(self.anchor_logits(F.relu(self.anchor_box(z) * self.anchor_question(q).unsqueeze(1))), 1)
                anchor = a_att.transpose(1, 2) @ z
            else:
                anchor = (att[:, :, :1].transpose(1, 2) @ z)  # (B, 1, H): the first glimpse's box
            diff = self.rel_metric(z - anchor).view(z.shape[0], z.shape[1], R, K)
            dist = diff.pow(2).sum(-1)  # (B, N, R)
            if "temp" in variant:
                dist = dist * self.rel_tau.exp()
            top = self.rel_logits(F.relu(self.rel_box(z) * self.rel_question(q).unsqueeze(1)))  # (B, N, R)
            s = top + self.rel_scale(q).unsqueeze(1) * dist
            parts.append((torch.softmax(s, 1).transpose(1, 2) @ z).flatten(1))
            parts.append(torch.sigmoid(s).sum(1))
        if rn:
            a = (self.rn_a(z) + self.rn_q(q).unsqueeze(1)).unsqueeze(2)  # (B, N, 1, H)
            pairs = F.relu(a + self.rn_b(z).unsqueeze(1))  # (B, N, N, H)
            parts.append(F.relu(self.rn_hidden(pairs)).sum((1, 2)) / z.shape[1])
        v = F.relu(self.glimpse_proj(torch.cat(parts, 1)))
        h = F.relu(self.classifier1(F.dropout(v * F.relu(self.question_proj(q)), self.dropout, self.training)))
        return self.classifier2(F.dropout(h, self.dropout, self.training))


torch.manual_seed(seed)
model = Model(3, views[0].shape[-1], "softmax", len(meta["vocab"]), len(meta["answers"]), 128, 0, 2)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
tr = data["train"]
order = torch.randperm(len(tr["answer"]))
start = time.time()
for step in range(1, updates + 1):
    i = ((step - 1) * 64) % len(order)
    if i == 0 and step > 1:
        order = torch.randperm(len(tr["answer"]))
    idx = order[i:i + 64]
    model.train()
    loss = F.cross_entropy(model(*(v[tr["image"][idx]] for v in views), tr["tokens"][idx]), tr["answer"][idx])
    opt.zero_grad(); loss.backward(); opt.step()
    if step % 500 == 0:
        acc, by = B.evaluate(model, views, "val", data)
        print(variant, step, f"{time.time() - start:.0f}s", f"{acc:.3f}", [round(x, 2) for x in by], flush=True)

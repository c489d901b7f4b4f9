"""Does a second, relational hop give the head pairwise reasoning? python/baselines/vqa.py's model
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
sum_ij W_2 relu(W_1 relu(A z_i + B z_j + C q)), joined with the glimpses (no hop)."""
import os, sys, time, json
import torch, torch.nn as nn, torch.nn.functional as F
sys.path.insert(0, "python/baselines")
from safetensors.torch import load_file
import vqa as B

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
        if pos:
            self.position = nn.Parameter(torch.zeros(views[0].shape[1], h))

    def forward(self, v0, v1, v2, tokens):
        boxes, _ = self.fusion(v0, v1, v2)
        out, _ = self.gru(self.embed(tokens))
        last = (tokens.ne(0).sum(1) - 1).clamp(min=0)
        q = out.gather(1, last.view(-1, 1, 1).expand(-1, 1, out.shape[2])).squeeze(1)
        z = self.box_proj(boxes)
        if pos:
            z = z + self.position
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

"""Why does a reasoning layer stop the VQA head from learning? Variants of python/probattn_tools/baselines/vqa.py's
model on Sort-of-CLEVR, validation accuracy per type every 500 updates (selection on val only)."""
import sys, time, json
import torch, torch.nn as nn, torch.nn.functional as F
from safetensors.torch import load_file
from probattn_tools.baselines import vqa as B

variant, updates, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0
torch.set_num_threads(1)
meta = json.load(open("data/vqa/sort-of-clevr/meta.json"))
raw = load_file("data/vqa/sort-of-clevr/data.safetensors")
data = {"types": meta["types"]}
for s in ("train", "val"):
    data[s] = {k: raw[f"{s}_{k}"] for k in ("image", "tokens", "answer", "type")}
data["val"] = {k: v[:3000] for k, v in data["val"].items()}
feats = load_file("data/vqa/sort-of-clevr/features/e0e6757cb6d94ca7.safetensors")
views = [feats[f"view{i}"] for i in range(3)]

class PreNorm(nn.Module):
    def __init__(self, hidden, heads, dropout):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(hidden, heads, dropout=dropout, batch_first=True)
        self.linear1, self.linear2 = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.dropout = dropout
    def forward(self, x):
        h = self.norm1(x)
        x = x + F.dropout(self.self_attn(h, h, h, need_weights=False)[0], self.dropout, self.training)
        return x + F.dropout(self.linear2(F.relu(self.linear1(self.norm2(x)))), self.dropout, self.training)

class Model(B.VqaModel):
    def forward(self, v0, v1, v2, tokens):
        boxes, _ = self.fusion(v0, v1, v2)
        out, _ = self.gru(self.embed(tokens))
        last = (tokens.ne(0).sum(1) - 1).clamp(min=0)
        q = out.gather(1, last.view(-1, 1, 1).expand(-1, 1, out.shape[2])).squeeze(1)
        z0 = self.box_proj(boxes)
        z = z0
        if len(self.reasoning) > 0:
            z = z0 + self.box_question(q).unsqueeze(1)
            for layer in self.reasoning:
                z = layer(z)
            if variant in ("skip", "prenorm-skip"):
                z = z0 + z
        joint = F.relu(self.att_box(z) * self.att_question(q).unsqueeze(1))
        att = torch.softmax(self.att_logits(F.dropout(joint, self.dropout, self.training)), 1)
        v = F.relu(self.glimpse_proj((att.transpose(1, 2) @ z).flatten(1)))
        h = F.relu(self.classifier1(F.dropout(v * F.relu(self.question_proj(q)), self.dropout, self.training)))
        return self.classifier2(F.dropout(h, self.dropout, self.training))

torch.manual_seed(seed)
layers = 0 if variant == "L0" else 1
model = Model(3, views[0].shape[-1], "softmax", len(meta["vocab"]), len(meta["answers"]), 128, layers, 2)
if variant.startswith("prenorm"):
    model.reasoning = nn.ModuleList([PreNorm(128, 4, 0.1)])
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
warm = 1000 if variant == "warmup" else 0
tr = data["train"]
order = torch.randperm(len(tr["answer"]))
start = time.time()
for step in range(1, updates + 1):
    if warm:
        for g in opt.param_groups: g["lr"] = 1e-3 * min(1.0, step / warm)
    i = ((step - 1) * 64) % len(order)
    idx = order[i:i + 64]
    model.train()
    loss = F.cross_entropy(model(*(v[tr["image"][idx]] for v in views), tr["tokens"][idx]), tr["answer"][idx])
    opt.zero_grad(); loss.backward(); opt.step()
    if step % 500 == 0:
        acc, by = B.evaluate(model, views, "val", data)
        print(variant, step, f"{time.time() - start:.0f}s", f"{acc:.3f}", [round(x, 2) for x in by], flush=True)

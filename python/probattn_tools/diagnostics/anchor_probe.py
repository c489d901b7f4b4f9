"""Where do the metric head's attentions look on closest questions? Trains relational_hop.py VARIANT
for UPDATES updates, then on 500 validation closest questions prints the anchor attention's mass on the
object of colour c, the glimpses' mass on it, and each relational glimpse's mass on the true closest
object (from the label grid).

    ORACLE=1 python anchor_probe.py metric-anchor-temp 3000
"""
import sys, runpy, torch, torch.nn.functional as F
# train via the diagnostic, then look inside on closest questions
sys.argv = ["relational_hop.py", sys.argv[1], sys.argv[2], "0"]
g = runpy.run_path("python/probattn_tools/diagnostics/relational_hop.py", run_name="diag")
model, views, data, raw = g["model"], g["views"], g["data"], g["raw"]
model.eval()
va = data["val"]
col = raw["aux_color"].flatten(1); shp = raw["aux_shape"].flatten(1); cen = raw["aux_center"].flatten(1, 2)
colors = ["red", "green", "blue", "orange", "gray", "yellow"]
import json
meta = json.load(open("data/vqa/sort-of-clevr/meta.json"))
vocab = meta["vocab"]; inv = {i: w for i, w in enumerate(vocab)} if isinstance(vocab, list) else {v: k for k, v in vocab.items()}
store = {}
def hook_forward(self, v0, v1, v2, tokens):
    boxes, _ = self.fusion(v0, v1, v2)
    out, _ = self.gru(self.embed(tokens))
    last = (tokens.ne(0).sum(1) - 1).clamp(min=0)
    q = out.gather(1, last.view(-1, 1, 1).expand(-1, 1, out.shape[2])).squeeze(1)
    z = self.box_proj(boxes)
    joint = F.relu(self.att_box(z) * self.att_question(q).unsqueeze(1))
    att = torch.softmax(self.att_logits(joint), 1)
    if hasattr(self, "anchor_box"):
        a_att = torch.softmax(self.anchor_logits(F.relu(self.anchor_box(z) * self.anchor_question(q).unsqueeze(1))), 1)
    else:
        a_att = att[:, :, :1]
    anchor = a_att.transpose(1, 2) @ z
    R, K = g["R"], g["K"]
    dist = self.rel_metric(z - anchor).view(z.shape[0], z.shape[1], R, K).pow(2).sum(-1)
    if hasattr(self, "rel_tau"): dist = dist * self.rel_tau.exp()
    s = self.rel_logits(F.relu(self.rel_box(z) * self.rel_question(q).unsqueeze(1))) + self.rel_scale(q).unsqueeze(1) * dist
    store.update(att=att, a_att=a_att, rel=torch.softmax(s, 1), beta=self.rel_scale(q))
with torch.no_grad():
    idx = (va["type"] == 3).nonzero().flatten()[:500]
    img = va["image"][idx]
    hook_forward(model, *(v[img] for v in views), va["tokens"][idx])
    on_c, on_close, g_on_c, = [], [], []
    for n, i in enumerate(idx.tolist()):
        words = [inv[int(t)] for t in va["tokens"][i] if t != 0]
        k = colors.index([w for w in words if w in colors][0]) + 1
        im = int(va["image"][i])
        me = (col[im] == k).nonzero().flatten()
        if len(me) == 0: continue
        me = me[0]
        cells = (col[im] > 0).nonzero().flatten(); others = cells[cells != me]
        j = others[((cen[im, others] - cen[im, me]) ** 2).sum(1).argmin()]
        on_c.append(store["a_att"][n, me, 0].item())
        g_on_c.append(store["att"][n, me].tolist())
        on_close.append(store["rel"][n, j].tolist())
    t = torch.tensor
    print("anchor mass on c", t(on_c).mean().item(), "glimpse mass on c", t(g_on_c).mean(0).tolist(), "relational mass on the closest", t(on_close).mean(0).tolist())
    print("beta on closest", store["beta"].mean(0).tolist(), "tau", getattr(model, "rel_tau", None))

"""Reference values and comparisons for probattn, computed with python/probattn_tools/reference/formulas.py.

  cases      random `probattn attend` inputs plus their reference outputs and gradients
  reference  reference outputs (and gradients, given cotangents) for one input file
  compare    check a `probattn attend` output file against the reference, with tolerances
  mha-cases  random MultiHeadAttention cases: PyTorch state dicts, inputs, references
  gat-cases  small graphs and GAT layers of the PyTorch baseline, with references
  vqa-cases  multi-view VQA models of the PyTorch baseline (each fusion), with references
  svgd-cases random particle sets and the reference SVGD/SPOS direction
  score-cases additive (Bahdanau) and self-attentive (Lin et al.) scores and gradients
  demo-input the padded batch of the README's demo (demo.sh)

Input files use the names `probattn attend` reads: q, k, v (B, H, S, d), optional
key_padding_mask (B, S_k), query_padding_mask (B, S_q), attn_mask (broadcastable to
(B, H, S_q, S_k)), hybrid_logit (H,); masks bool or uint8, True = excluded. Optional cotangents
grad_output (B, H, S_q, d_v) and grad_weights (B, H, S_q, S_k) define the scalar
L = sum(output * grad_output) + sum(weights * grad_weights) whose gradients are reported.
"""

import argparse
import math
import os
import sys

import torch
from safetensors.torch import load_file, save_file

from probattn_tools.files import atomic_write_json
from probattn_tools.reference import formulas as ref
from probattn_tools.reference import variants

# The deterministic variants of the registry, with Sinkhorn's one-sweep limit (DNAS) beside its example.
VARIANTS = [n for v in variants.registry() if not v["stochastic"]
            for n in (["sinkhorn-1", v["example"]] if v["name"] == "sinkhorn-N" else [v["example"]])]
PRIOR_NAMES = ["prior.f1.weight", "prior.f1.bias", "prior.f2.weight", "prior.f2.bias"]
BAM_DEFAULTS = {"k": 1000.0, "sigma": 1.0, "prior_alpha": 1.0, "prior_beta": 1.0, "prior_mu": 0.0,
                "prior_sigma": 1.0, "base": "softmax"}


def reference_outputs(variant, tensors, causal=False, train=False, bam=None):
    """Outputs (and gradients when the cotangents are present) of one attend input. `bam` holds
    the BAM settings (BAM_DEFAULTS for the missing ones); `train` makes BAM sample with the
    input's `noise`."""
    q, k, v = (tensors[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    logit = tensors.get("hybrid_logit")
    if logit is not None:
        logit = logit.clone().requires_grad_(True)
    prior = {n: tensors[n].clone().requires_grad_(True) for n in PRIOR_NAMES if n in tensors}
    b, h, s_q, d = q.shape
    allowed = ref.allowed_mask(b, h, s_q, k.shape[2], tensors.get("key_padding_mask"),
                               tensors.get("query_padding_mask"), tensors.get("attn_mask"), causal)
    kl = None
    if variant in ref.BAM_VARIANTS:
        cfg = dict(BAM_DEFAULTS, **(bam or {}))
        z = q @ k.transpose(-2, -1) / math.sqrt(d)
        w, kl = ref.bam_weights(variant, z, allowed, k, tensors.get("noise"), train, cfg, prior, logit)
        out = w @ v
    else:
        out, w = ref.attention(variant, q, k, v, allowed, logit)
    result = {"output": out, "weights": w, "received_mass": ref.received_mass(w)}
    if kl is not None:
        result["kl"] = kl
    if "grad_output" in tensors and "grad_weights" in tensors:
        loss = (out * tensors["grad_output"]).sum() + (w * tensors["grad_weights"]).sum()
        if kl is not None:
            loss = loss + kl * tensors["grad_kl"]
        names = ["q", "k", "v"] + (["hybrid_logit"] if logit is not None else []) + list(prior)
        leaves = [q, k, v] + ([logit] if logit is not None else []) + list(prior.values())
        # Parameters the loss does not reach (the prior network in eval mode) get zero gradients.
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        for name, leaf, g in zip(names, leaves, grads):
            result["grad_" + name] = torch.zeros_like(leaf) if g is None else g
    return {n: t.detach().contiguous() for n, t in result.items()}


def random_mask_shape(gen, b, h, s_q, s_k):
    shapes = [(s_q, s_k), (1, 1, s_q, s_k), (b, 1, s_q, s_k), (b, h, s_q, s_k), (h, s_q, s_k),
              (1, s_k), (b, 1, 1, s_k)]
    return shapes[int(torch.randint(len(shapes), (1,), generator=gen))]


def make_case(gen, index, variant, dtype, extreme):
    """One random attend input. Masks include fully masked rows and columns."""
    def coin(p):
        return float(torch.rand((), generator=gen)) < p

    def ints(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    b, h, s_q, s_k = ints(1, 3), ints(1, 4), ints(1, 9), ints(1, 9)
    d = [1, 3, 8][index % 3]
    d_v = d if coin(0.5) else ints(1, 6)
    q = torch.randn(b, h, s_q, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, h, s_k, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, h, s_k, d_v, generator=gen, dtype=torch.float64)
    if extreme:
        # Rescale so the largest |score| is 1e4: weights become (nearly) one-hot.
        z_max = float((q @ k.transpose(-2, -1)).abs().max()) / math.sqrt(d)
        q = q * (1e4 / max(z_max, 1e-12))
    else:
        q = q * 3.0
    t = {"q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype)}
    mask_dtype = torch.bool if coin(0.5) else torch.uint8
    if coin(0.5):
        kp = torch.rand(b, s_k, generator=gen) < 0.3
        if b > 1 and coin(0.4):
            kp[0] = True  # one sequence with every key padded
        t["key_padding_mask"] = kp.to(mask_dtype)
    if coin(0.4):
        t["query_padding_mask"] = (torch.rand(b, s_q, generator=gen) < 0.3).to(mask_dtype)
    if coin(0.6):
        shape = random_mask_shape(gen, b, h, s_q, s_k)
        m = torch.rand(shape, generator=gen) < 0.3
        if shape[-2] == s_q:
            m[..., ints(0, s_q - 1), :] = True  # a fully masked row
        m[..., ints(0, s_k - 1)] = True  # a fully masked column
        t["attn_mask"] = m.to(mask_dtype)
    base = variant
    bam = None
    if variant in ref.BAM_VARIANTS:
        def choose(options):
            return options[int(torch.randint(len(options), (1,), generator=gen))]

        base = choose(["softmax", "softmax", "dnas", "hnas", "sinkhorn-2"])
        bam = {"k": choose([2.0, 10.0, 1000.0]), "sigma": choose([0.3, 1.0]), "prior_alpha": choose([0.5, 1.0]),
               "prior_beta": choose([1.0, 2.0]), "prior_mu": choose([0.0, -1.0]),
               "prior_sigma": choose([0.5, 1.0]), "base": base}
        if variant in ("bam-nokl", "bam-wf", "bam-wc"):
            t["noise"] = torch.rand(b, h, s_q, s_k, generator=gen, dtype=torch.float64).clamp(1e-12, 1 - 1e-12).to(dtype)
        else:
            t["noise"] = torch.randn(b, h, s_q, s_k, generator=gen, dtype=torch.float64).to(dtype)
        if variant in ("bam-wc", "bam-lc"):
            hidden = 5
            t["prior.f1.weight"] = torch.randn(h, hidden, d, generator=gen, dtype=torch.float64).to(dtype)
            t["prior.f1.bias"] = torch.randn(h, hidden, generator=gen, dtype=torch.float64).to(dtype)
            t["prior.f2.weight"] = torch.randn(h, hidden, generator=gen, dtype=torch.float64).to(dtype)
            t["prior.f2.bias"] = torch.randn(h, generator=gen, dtype=torch.float64).to(dtype)
        t["grad_kl"] = torch.randn((), generator=gen, dtype=torch.float64).to(dtype)
    if base == "hnas":
        t["hybrid_logit"] = (2 * torch.randn(h, generator=gen, dtype=torch.float64)).to(dtype)
    t["grad_output"] = torch.randn(b, h, s_q, d_v, generator=gen, dtype=torch.float64).to(dtype)
    t["grad_weights"] = torch.randn(b, h, s_q, s_k, generator=gen, dtype=torch.float64).to(dtype)
    causal = variant == "softmax" and coin(0.3)
    train = bam is not None and coin(0.8)
    return t, causal, train, bam


def cmd_cases(args):
    gen = torch.Generator().manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    manifest = []
    variants = VARIANTS + (list(ref.BAM_VARIANTS) if args.bam else [])
    for i in range(args.count):
        variant = variants[i % len(variants)]
        # float64 cases carry the 1e-10 claim, half of them at |score| up to 1e4; float32 cases
        # carry the 1e-5 claim at moderate scores (see tests/parity.rs for why).
        dtype = torch.float32 if i % 3 == 2 else torch.float64
        extreme = dtype == torch.float64 and (i // 3) % 2 == 1
        tensors, causal, train, bam = make_case(gen, i, variant, dtype, extreme)
        name = f"case-{i:03d}"
        save_file(tensors, os.path.join(args.out, name + ".safetensors"))
        expected = reference_outputs(variant, tensors, causal, train, bam)
        save_file(expected, os.path.join(args.out, name + ".ref.safetensors"))
        manifest.append({"name": name, "variant": variant, "causal": causal, "extreme": extreme,
                         "dtype": str(dtype).replace("torch.", ""), "train": train, "bam": bam})
    atomic_write_json(os.path.join(args.out, "cases.json"), manifest)


def bam_settings(args):
    """The BAM flags of reference/compare, spelled as `probattn attend` spells them."""
    return {"k": args.k, "sigma": args.sigma, "prior_alpha": args.prior_alpha, "prior_beta": args.prior_beta,
            "prior_mu": args.prior_mu, "prior_sigma": args.prior_sigma, "base": args.base}


def cmd_reference(args):
    tensors = load_file(args.input)
    save_file(reference_outputs(args.variant, tensors, args.causal, args.train, bam_settings(args)), args.output)


def cmd_compare(args):
    tensors = load_file(args.input)
    ours = load_file(args.output)
    expected = reference_outputs(args.variant, tensors, args.causal, args.train, bam_settings(args))
    dtype = tensors["q"].dtype
    tol = args.tol if args.tol is not None else (1e-10 if dtype == torch.float64 else 1e-5)
    worst = 0.0
    compared = ["output", "weights", "received_mass"] + (["kl"] if "kl" in expected else [])
    for name in compared:
        if name not in ours:
            print(f"{name}: missing from {args.output}")
            return 1
        if ours[name].dtype != dtype or ours[name].shape != expected[name].shape:
            print(f"{name}: {ours[name].dtype} {tuple(ours[name].shape)}, expected {dtype} {tuple(expected[name].shape)}")
            return 1
        err = float((ours[name].double() - expected[name].double()).abs().max()) if ours[name].numel() else 0.0
        worst = max(worst, err)
        print(f"{name:14s} max abs error {err:.3e}")
    ok = worst <= tol
    print(f"{'OK' if ok else 'FAIL'}: largest error {worst:.3e} (tolerance {tol:.0e}, {dtype})")
    return 0 if ok else 1


def cmd_score_cases(args):
    """Additive and self-attentive score parameters, inputs, scores and gradients."""
    gen = torch.Generator().manual_seed(args.seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    b, s_q, s_k, d_q, d_k, hidden, hops = 2, 3, 5, 4, 6, 7, 3
    additive = {"w_q.weight": randn(hidden, d_q), "w_k.weight": randn(hidden, d_k),
                "w_k.bias": randn(hidden), "v.weight": randn(1, hidden)}
    lin = {"w_s1.weight": randn(hidden, d_k), "w_s2.weight": randn(hops, hidden)}
    inputs = {"query": randn(b, s_q, d_q), "key": randn(b, s_k, d_k),
              "grad_additive": randn(b, 1, s_q, s_k), "grad_self_attentive": randn(b, 1, hops, s_k)}
    leaves = {n: t.clone().requires_grad_(True) for n, t in {**additive, **lin, **inputs}.items()}
    z_add = ref.additive_scores({n: leaves[n] for n in additive}, leaves["query"], leaves["key"])
    z_lin = ref.self_attentive_scores({n: leaves[n] for n in lin}, leaves["key"])
    loss = (z_add * inputs["grad_additive"]).sum() + (z_lin * inputs["grad_self_attentive"]).sum()
    names = list(additive) + list(lin) + ["query", "key"]
    grads = torch.autograd.grad(loss, [leaves[n] for n in names])
    os.makedirs(args.out, exist_ok=True)
    save_file({**{f"additive.{n}": t for n, t in additive.items()}, **{f"lin.{n}": t for n, t in lin.items()}},
              os.path.join(args.out, "scores.weights.safetensors"))
    save_file(inputs, os.path.join(args.out, "scores.safetensors"))
    result = {"additive": z_add.detach(), "self_attentive": z_lin.detach()}
    result.update({f"grad.{n}": g for n, g in zip(names, grads)})
    save_file(result, os.path.join(args.out, "scores.ref.safetensors"))


def cmd_svgd_cases(args):
    """Random particle sets (sets, n, D), gradients, SPOS noise and the reference direction."""
    gen = torch.Generator().manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    manifest = []
    for i in range(args.count):
        sets, n, d = 1 + i % 3, [1, 2, 3, 4, 7, 8][i % 6], [1, 6, 40][i % 3]
        theta = torch.randn(sets, n, d, generator=gen, dtype=torch.float64) * [0.05, 1.0, 3.0][i % 3]
        if i % 7 == 3:
            theta[:, 1:] = theta[:, :1]  # identical particles: median distance 0
        grad = torch.randn(sets, n, d, generator=gen, dtype=torch.float64)
        xi = torch.randn(sets, n, d, generator=gen, dtype=torch.float64)
        cfg = {"method": "spos" if i % 2 else "svgd", "alpha": [0.0, 0.01, 1.0, 5.0][i % 4],
               "stepsize": [0.01, 0.1, 1.0][i % 3], "beta": [1.0, 0.5][i % 2],
               "bandwidth": None if i % 5 else 0.7}
        direction = torch.stack([ref.svgd_direction(theta[s], grad[s], cfg["alpha"], cfg["stepsize"], cfg["method"],
                                                    cfg["beta"], xi[s], cfg["bandwidth"]) for s in range(sets)])
        name = f"svgd-{i:03d}"
        save_file({"theta": theta, "grad": grad, "xi": xi, "direction": direction},
                  os.path.join(args.out, name + ".safetensors"))
        manifest.append(dict(cfg, name=name))
    atomic_write_json(os.path.join(args.out, "cases.json"), manifest)


def cmd_gat_cases(args):
    """A small random graph, a GAT layer of python/probattn_tools/baselines/gat.py with random weights, and its
    eval-mode output and gradients (float64), for the Rust GatLayer to match."""
    from probattn_tools.baselines import gat as baseline

    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    manifest = []
    for i, (n, f_in, f_out, heads, concat) in enumerate([(7, 5, 3, 2, True), (9, 4, 6, 3, False), (5, 8, 2, 1, False)]):
        adjacency = (torch.rand(n, n) < 0.35) | torch.eye(n, dtype=torch.bool)
        dst, src = adjacency.nonzero().t()
        layer = baseline.GatLayer(f_in, f_out, heads, concat).double().eval()
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_()
        x = torch.randn(n, f_in, dtype=torch.float64, requires_grad=True)
        out = layer(x, dst, src, n, 0.6)
        cot = torch.randn_like(out)
        names = [name for name, _ in layer.named_parameters()]
        grads = torch.autograd.grad((out * cot).sum(), [x] + list(layer.parameters()))
        name = f"gat-{i:03d}"
        save_file({n_: p.detach().contiguous() for n_, p in layer.named_parameters()}, os.path.join(args.out, name + ".weights.safetensors"))
        save_file({"x": x.detach(), "edge_dst": dst.contiguous(), "edge_src": src.contiguous(), "cotangent": cot,
                   "output": out.detach(), "grad.x": grads[0], **{f"grad.{n_}": g for n_, g in zip(names, grads[1:])}},
                  os.path.join(args.out, name + ".safetensors"))
        manifest.append({"name": name, "nodes": n, "in": f_in, "out": f_out, "heads": heads, "concat": concat})
    atomic_write_json(os.path.join(args.out, "cases.json"), manifest)


def cmd_vqa_cases(args):
    """python/probattn_tools/baselines/vqa.py models (fusion none, softmax, dnas, hnas) with random weights, random
    views and questions, and their eval-mode logits and gradients (float64), for the Rust VqaModel
    to match."""
    from probattn_tools.baselines import vqa as baseline

    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    manifest = []
    shapes = [(3, 4, 6, 5, 8), (2, 5, 3, 7, 8), (4, 3, 3, 3, 12)]  # batch, regions of the three views, dim
    # The four fusions with 0, 1, 2, 0 post-norm reasoning layers, then DNAS with two pre-norm ones,
    # then the relational layer: 2 heads after UNAS, 3 heads after concatenated views and a pre-norm layer.
    # Then the LSTM and the bag-of-words question encoders (the rest use the GRU), and last the
    # primary's unfused boxes read by the head, added (primary_skip, after HNAS) and beside
    # (primary_beside, after UNAS), each with the relational layer.
    cases = [("none", False, 0, "gru"), ("softmax", False, 0, "gru"), ("dnas", False, 0, "gru"), ("hnas", False, 0, "gru"), ("dnas", True, 0, "gru"),
             ("softmax", False, 2, "gru"), ("none", True, 3, "gru"), ("hnas", False, 0, "lstm"), ("dnas", False, 2, "bow")]
    cases = [c + (False, False) for c in cases] + [("hnas", False, 2, "bow", True, False), ("softmax", False, 2, "bow", False, True)]
    for i, (fusion, prenorm, relational, encoder, skip, beside) in enumerate(cases):
        b, n0, n1, n2, dim = shapes[i % len(shapes)]
        vocab, answers, length = 11, 7, 5
        layers = (1 if relational else 2) if prenorm else i % 3 if not relational else 0
        model = baseline.VqaModel(3, dim, fusion, vocab, answers, hidden=16, layers=layers, glimpses=2, word_dim=6, question_dim=10,
                                  prenorm=prenorm, relational_heads=relational, metric_dim=3, question_encoder=encoder,
                                  primary_skip=skip, primary_beside=beside).double().eval()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.5)
        views = [torch.randn(b, n, dim, dtype=torch.float64, requires_grad=True) for n in (n0, n1, n2)]
        tokens = torch.randint(1, vocab, (b, length))
        for row in range(b):  # padding after a random number of words
            tokens[row, 1 + row % (length - 1) + 1 :] = 0
        logits = model(*views, tokens)
        cot = torch.randn_like(logits)
        names = [name for name, _ in model.named_parameters()]
        params = list(model.parameters())
        grads = torch.autograd.grad((logits * cot).sum(), views + params, allow_unused=True)  # box_question is unused without reasoning layers
        grads = [torch.zeros_like(x) if g is None else g for x, g in zip(views + params, grads)]
        name = f"vqa-{fusion}" + ("-prenorm" if prenorm else "") + (f"-relational{relational}" if relational else "") + (f"-{encoder}" if encoder != "gru" else "") + ("-skip" if skip else "") + ("-beside" if beside else "")
        save_file({n_: p.detach().contiguous() for n_, p in model.named_parameters()}, os.path.join(args.out, name + ".weights.safetensors"))
        tensors = {"tokens": tokens, "cotangent": cot, "logits": logits.detach()}
        tensors.update({f"view{v}": x.detach() for v, x in enumerate(views)})
        tensors.update({f"grad.view{v}": g for v, g in enumerate(grads[:3])})
        tensors.update({f"grad.{n_}": g for n_, g in zip(names, grads[3:])})
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(args.out, name + ".safetensors"))
        manifest.append({"name": name, "fusion": fusion, "regions": [n0, n1, n2], "dim": dim, "vocab": vocab, "answers": answers,
                         "hidden": 16, "reasoning_layers": layers, "reasoning_prenorm": prenorm, "glimpses": 2, "word_dim": 6, "question_dim": 10,
                         "relational_heads": relational, "relational_dim": 3, "question_encoder": encoder,
                         "primary_skip": skip, "primary_beside": beside})
    atomic_write_json(os.path.join(args.out, "cases.json"), manifest)


def cmd_demo_input(args):
    """A padded batch whose scores spread widely enough that softmax explains keys away."""
    gen = torch.Generator().manual_seed(args.seed)
    b, h, s, d = 2, 4, 12, 16
    q = 5.0 * torch.randn(b, h, s, d, generator=gen)
    k = 5.0 * torch.randn(b, h, s, d, generator=gen)
    v = torch.randn(b, h, s, d, generator=gen)
    key_padding = torch.zeros(b, s, dtype=torch.bool)
    key_padding[1, 9:] = True  # the second sequence has 9 tokens
    query_padding = key_padding.clone()
    save_file({"q": q, "k": k, "v": v, "key_padding_mask": key_padding, "query_padding_mask": query_padding,
               "hybrid_logit": torch.zeros(h)}, args.output)


def cmd_mha_cases(args):
    """nn.MultiheadAttention state dicts (HNAS adds hybrid_logit), inputs and references."""
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    manifest = []
    for i in range(args.count):
        variant = VARIANTS[i % len(VARIANTS)]
        heads = [1, 2, 4][i % 3]
        embed = heads * [2, 3, 4][(i // 3) % 3]
        kdim = vdim = embed
        if i % 4 == 3:
            kdim, vdim = embed + 1, embed + 2  # separate q/k/v projection weights
        bias = i % 5 != 4
        module = torch.nn.MultiheadAttention(embed, heads, bias=bias, kdim=kdim, vdim=vdim,
                                             batch_first=True).double()
        params = {n: p.detach().clone() for n, p in module.state_dict().items()}
        if variant == "hnas":
            params["hybrid_logit"] = torch.randn(heads, generator=gen, dtype=torch.float64)
        b, s_q, s_k = 2, 1 + i % 5, 2 + (i * 3) % 5
        self_attn = kdim == embed and i % 2 == 0
        query = torch.randn(b, s_q, embed, generator=gen, dtype=torch.float64)
        key = query if self_attn else torch.randn(b, s_k, kdim, generator=gen, dtype=torch.float64)
        value = query if self_attn else torch.randn(b, s_k, vdim, generator=gen, dtype=torch.float64)
        s_k = key.shape[1]
        inputs = {"query": query, "key": key, "value": value}
        masks = {}
        if i % 2 == 1:
            kp = torch.rand(b, s_k, generator=gen) < 0.4
            kp[:, 0] = False
            masks["key_padding_mask"] = kp
        if variant != "softmax" and i % 3 == 1:
            masks["query_padding_mask"] = torch.rand(b, s_q, generator=gen) < 0.4
        causal = variant == "softmax" and self_attn and i % 3 == 0
        grad_context = torch.randn(b, s_q, embed, generator=gen, dtype=torch.float64)
        leaves = {n: t.clone().requires_grad_(True) for n, t in list(params.items()) + list(inputs.items())}
        if self_attn:
            leaves["key"] = leaves["value"] = leaves["query"]
        context, _ = ref.multi_head_attention(
            {n: leaves[n] for n in params}, leaves["query"], leaves["key"], leaves["value"], heads,
            variant, causal=causal, **masks)
        grads = torch.autograd.grad((context * grad_context).sum(), [leaves[n] for n in params] + [leaves["query"]])
        result = {"context": context.detach()}
        result.update({f"grad.{n}": g for n, g in zip(list(params) + ["query"], grads)})
        if variant == "softmax" and not masks and not causal:
            # The reference itself against PyTorch's own module.
            torch_ctx, _ = module(query, key, value, need_weights=False)
            err = float((torch_ctx - context).detach().abs().max())
            assert err < 1e-12, f"reference MHA differs from nn.MultiheadAttention by {err}"
        name = f"mha-{i:03d}"
        save_file(params, os.path.join(args.out, name + ".weights.safetensors"))
        # Self-attention cases store only `query` (it is also the key and the value).
        stored = {"query": query} if self_attn else inputs
        data = dict(stored, grad_context=grad_context, **masks)
        save_file({n: t.contiguous() for n, t in data.items()}, os.path.join(args.out, name + ".safetensors"))
        save_file({n: t.contiguous() for n, t in result.items()}, os.path.join(args.out, name + ".ref.safetensors"))
        manifest.append({"name": name, "variant": variant, "heads": heads, "embed": embed, "kdim": kdim,
                         "vdim": vdim, "bias": bias, "causal": causal, "self_attention": self_attn})
    atomic_write_json(os.path.join(args.out, "cases.json"), manifest)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    def case_command(name, help, run, count=None):
        """A subcommand writing generated cases to --out from --seed (and --count of them)."""
        p = sub.add_parser(name, help=help)
        p.add_argument("--out", required=True)
        p.add_argument("--seed", type=int, default=0)
        if count is not None:
            p.add_argument("--count", type=int, default=count)
        p.set_defaults(run=run)
        return p

    case_command("cases", "random attend cases with references", cmd_cases, count=60).add_argument(
        "--bam", action="store_true", help="include the BAM variants")

    def attend_flags(p):
        p.add_argument("--variant", required=True)
        p.add_argument("--input", required=True, help="the file given to probattn attend --input")
        p.add_argument("--causal", action="store_true")
        p.add_argument("--train", action="store_true", help="BAM: sample with the input's noise")
        for flag, default in BAM_DEFAULTS.items():
            p.add_argument("--" + flag.replace("_", "-"), type=type(default), default=default)

    p = sub.add_parser("reference", help="reference outputs of one attend input file")
    attend_flags(p)
    p.add_argument("--output", required=True)
    p.set_defaults(run=cmd_reference)
    p = sub.add_parser("compare", help="check a probattn attend output against the reference")
    attend_flags(p)
    p.add_argument("--output", required=True, help="the file probattn attend --output wrote")
    p.add_argument("--tol", type=float, default=None, help="default: 1e-10 for float64, 1e-5 for float32")
    p.set_defaults(run=cmd_compare)
    case_command("mha-cases", "random MultiHeadAttention cases with references", cmd_mha_cases, count=20)
    case_command("score-cases", "additive and self-attentive score cases", cmd_score_cases)
    case_command("svgd-cases", "random particle sets with the reference SVGD/SPOS direction", cmd_svgd_cases, count=36)
    case_command("gat-cases", "GAT layers of python/probattn_tools/baselines/gat.py with references", cmd_gat_cases)
    case_command("vqa-cases", "VQA models of python/probattn_tools/baselines/vqa.py with references", cmd_vqa_cases)
    p = sub.add_parser("demo-input", help="the input of the README's attend demo")
    p.add_argument("--output", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=cmd_demo_input)
    args = parser.parse_args()
    sys.exit(args.run(args) or 0)


if __name__ == "__main__":
    main()

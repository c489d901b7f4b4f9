"""Checks the Triton kernels of the plans (`probattn_tools.kernels.plans`) against the reference
formulas (`probattn_tools.reference.formulas`, written from the papers): the output, the gradients
in q, k and v (and HNAS's gate logits) and the received mass, over plans (softmax, DNAS, HNAS,
Sinkhorn-N for N = 2, 3 and 5, another score scale), masks (key padding, query padding, boolean
patterns per head or broadcast, a row that sees nothing, causal), grouped key/value heads,
lengths that are not multiples of the blocks, head dimensions that are not powers of two, scores
far below 0 (where exp overflows past the last query or key of a block), Sinkhorn-N's dQ by atomic
adds and, with libtorch's deterministic algorithms asked for, from a stage of its own, and dtypes; and BAM's
sampling over the plans (`plans.bam_attention`): its draws against the CPU loop's record
(`counter_noise.json`), its output, KL part and gradients against the formulas given the same
draws.

    python -m probattn_tools.kernels.check                  # on the CPU, under Triton's interpreter
    python -m probattn_tools.kernels.check --device cuda    # on a GPU, compiled
    python -m probattn_tools.kernels.check --record FILE    # also the specializations launched (aot --set)
    python -m probattn_tools.kernels.check --key-tiles transposed   # the key pass's other form

The reference runs in float64 on the inputs as the kernel sees them (rounded to its dtype); each
dtype is held to its tolerance: float64 1e-10, float32 2e-5 (TF32 off), bfloat16 3e-2 and float16
4e-3 (scaled by the largest reference value). On the CPU the script sets TRITON_INTERPRET=1
itself before Triton is imported; Triton 3.6's interpreter needs numpy < 2.4 (loop bounds that are
run-time arguments) and multiplies bfloat16 matrices wrongly, so bfloat16 is checked on a GPU
only. Prints one line per case and exits 1 if any case fails.
"""

import argparse
import contextlib
import json
import math
import os
import sys
import time
import zlib
from pathlib import Path

import numpy

TOLERANCE = {"float64": 1e-10, "float32": 2e-5, "bfloat16": 3e-2, "float16": 4e-3}
# The largest difference allowed between the kernels' Weibull noise term of a float32 draw and
# log(−log(1 − u)) in float64 (bam._weibull32's bound).
WEIBULL_ERROR = 6e-6


def cases(quick, lower):
    """(name, sweeps, score_scale, (B, H, H_kv, S_q, S_k, d, d_v), masks, causal, bam). `lower`: the
    cases of a lower precision (the padded one per plan, and the causal one); `quick`: no
    rectangular, one-entry or pattern cases beyond the first plan's. `bam`: None, or BAM's
    sampling over the plan as (noise, noise scale, KL form or None, seed; None: ε given as a tensor)."""
    shapes = {"gqa": (2, 4, 2, 13, 11, 8, 5), "rect": (1, 2, 2, 7, 19, 16, 16), "one": (1, 1, 1, 1, 1, 4, 4)}
    out = []
    for sweeps, plan in ((0, "softmax"), (1, "dnas"), (1, "hnas"), (3, "sinkhorn-3")):
        if not lower:
            out.append((f"{plan} gqa unmasked", sweeps, 1.0, shapes["gqa"], (), False, None))
        out.append((f"{plan} gqa key+query padding, scale 0.5", sweeps, 0.5, shapes["gqa"], ("key", "query"), False, None))
        if not lower and (not quick or plan == "dnas"):
            out.append((f"{plan} gqa pattern per head, key padding", sweeps, 1.0, shapes["gqa"], ("pattern", "key"), False,
                        None))
            out.append((f"{plan} gqa pattern with dead tiles", sweeps, 1.0, shapes["gqa"], ("dead-tiles",), False, None))
            out.append((f"{plan} gqa additive mask, -inf entries", sweeps, 1.0, shapes["gqa"], ("additive", "key"), False,
                        None))
        if not quick and not lower:
            out.append((f"{plan} rect pattern broadcast over batch", sweeps, 1.0, shapes["rect"], ("pattern-2d",), False,
                        None))
            out.append((f"{plan} rect key padding", sweeps, 1.0, shapes["rect"], ("key",), False, None))
            out.append((f"{plan} one entry", sweeps, 1.0, shapes["one"], (), False, None))
    out.append(("softmax gqa causal, key padding", 0, 2.0, shapes["gqa"], ("key",), True, None))
    # Scores far below 0 (float64): what the passes compute past the last query or key must not
    # reach what they store (there exp(0 − c_j) is inf).
    if not lower:
        out += [(f"{plan} gqa scores far below 0", sweeps, 1.0, shapes["gqa"], ("far",), False, None)
                for sweeps, plan in ((0, "softmax"), (1, "dnas"))]
    # Sinkhorn-N for other N: the gradient kernel takes N at run time (N = 2: its loop over the
    # earlier sweeps runs once). With deterministic algorithms asked for ("deterministic"), dQ
    # comes from a stage of its own instead of atomic adds (Sinkhorn-N's), and softmax's from the
    # query pass instead of the key pass's atomic adds.
    if not lower:
        out.append(("sinkhorn-2 gqa key+query padding, deterministic", 2, 1.0, shapes["gqa"],
                    ("key", "query", "deterministic"), False, None))
        out.append(("softmax gqa key+query padding, deterministic", 0, 0.5, shapes["gqa"],
                    ("key", "query", "deterministic"), False, None))
    if not quick and not lower:
        out.append(("sinkhorn-5 gqa pattern per head, key padding", 5, 1.0, shapes["gqa"], ("pattern", "key"), False,
                    None))
        out.append(("softmax rect causal", 0, 1.0, shapes["rect"], (), True, None))
        # Head dimensions past 128: 256-wide blocks (the route's widest set).
        out.append(("dnas wide heads d 200, d_v 136, key padding", 1, 1.0, (1, 2, 1, 9, 13, 200, 136), ("key",), False,
                    None))
    # BAM over the plans: Weibull (k = 2) and Lognormal (σ = 0.7) draws, with and without a KL term,
    # a seed past 2^32 (both of its words in the hash).
    seed = 0x5DEECE66D_0B
    bam = [("dnas", 1, ("weibull", 0.5, "weibull", seed), ("key", "query")),
           ("softmax", 0, ("lognormal", 0.7, "lognormal", seed + 1), ("pattern", "key")),
           ("sinkhorn-3", 3, ("weibull", 0.5, "weibull", seed + 2), ("additive", "key")),
           ("dnas", 1, ("lognormal", 0.7, "lognormal", seed + 3), ("additive", "query")),
           ("softmax", 0, ("weibull", 0.5, None, seed + 4), ("key",)),
           ("sinkhorn-3", 3, ("lognormal", 0.7, "lognormal", seed + 5), ("key", "query")),
           ("hnas", 1, ("weibull", 0.5, "weibull", seed + 6), ("key", "query")),
           ("hnas", 1, ("lognormal", 0.7, "lognormal", seed + 7), ("additive", "key")),
           ("sinkhorn-2", 2, ("weibull", 0.5, "weibull", seed + 11), ("key",)),
           # Without a KL term over every base (bam-nokl, and Lognormal draws alone).
           ("dnas", 1, ("lognormal", 0.7, None, seed + 12), ("key",)),
           ("hnas", 1, ("weibull", 0.5, None, seed + 13), ("key", "query")),
           ("hnas", 1, ("lognormal", 0.7, None, seed + 14), ("query",)),
           ("sinkhorn-3", 3, ("lognormal", 0.7, None, seed + 15), ("key",)),
           ("sinkhorn-2", 2, ("weibull", 0.5, None, seed + 16), ("key", "query", "deterministic")),
           # Padded queries with noise and no KL term: DNAS's column weights reach their rows of dQ.
           ("dnas", 1, ("weibull", 0.5, None, seed + 17), ("key", "query")),
           # BAM over softmax with dQ from the query pass (deterministic algorithms asked for).
           ("softmax", 0, ("weibull", 0.5, "weibull", seed + 18), ("key", "query", "deterministic")),
           # The Weibull KL term over softmax with both paddings: its terms linear in the logits
           # come from sums over the sequence (bam.linear_kl), dQ's by atomics in 16 bits.
           ("softmax", 0, ("weibull", 0.5, "weibull", seed + 19), ("key", "query")),
           # The Lognormal KL term over softmax with both paddings: its sums, quadratic in the
           # logits, come from d × d sums over the sequence (bam.linear_kl), dQ by atomics in 16
           # bits, or from the query pass, which forms the term per entry, under deterministic
           # algorithms.
           ("softmax", 0, ("lognormal", 0.7, "lognormal", seed + 21), ("key", "query")),
           ("softmax", 0, ("lognormal", 0.7, "lognormal", seed + 22), ("key", "query", "deterministic"))]
    # ε given as a tensor (the library's noise=) instead of a seed.
    given = [("dnas", 1, ("weibull", 0.5, "weibull", None), ("key", "query")),
             ("softmax", 0, ("lognormal", 0.7, None, None), ("key",))]
    # Causal BAM over softmax (a decoder's self-attention), the KL term over the allowed entries only.
    causal = [("softmax", 0, ("weibull", 0.5, "weibull", seed + 8), ("key",)),
              ("softmax", 0, ("lognormal", 0.7, "lognormal", seed + 9), ("key", "query")),
              ("softmax", 0, ("weibull", 0.5, None, seed + 10), ("query",)),
              ("softmax", 0, ("weibull", 0.5, "weibull", seed + 20), ("key", "query"))]
    chosen = [(c, False) for c in (bam[:2] + given[:1] if quick else bam + given)]
    for (plan, sweeps, sampling, masks), is_causal in chosen + [(c, True) for c in causal[:1 if quick else 4]]:
        if lower and masks[0] in ("pattern", "additive"):
            continue
        kl = f"KL {sampling[2]}" if sampling[2] else "no KL"
        drawn = "" if sampling[3] is not None else ", given draws"
        out.append((f"bam-{sampling[0]} over {plan}, {kl}, {'+'.join(masks)}{drawn}{', causal' if is_causal else ''}",
                    sweeps, 1.0, shapes["gqa"], masks, is_causal, sampling))
    return out


def reference(torch, formulas, q, k, v, plan, scale, masks, logit=None):
    """Output and received mass from the formulas, in float64, keys and values repeated per group."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    allowed, z = reference_scores(torch, formulas, q, kk, scale, masks)
    w = formulas.normalize(plan, z, allowed, hybrid_logit=logit)
    return w @ vv, w.sum(-2)


def make_masks(torch, plans, masks_asked, causal, shape, gen, device):
    """The masks a case asks for, drawn from `gen`."""
    b, h, h_kv, s_q, s_k, d, dv = shape
    masks = plans.Masks(causal=causal)
    if "key" in masks_asked:
        kp = torch.zeros(b, s_k, dtype=torch.bool)
        kp[-1, s_k * 2 // 3:] = True
        masks.key_padding_mask = kp.to(device)
    if "query" in masks_asked:
        qp = torch.zeros(b, s_q, dtype=torch.bool)
        qp[0, s_q * 3 // 4:] = True
        masks.query_padding_mask = qp.to(device)
    if "pattern" in masks_asked:  # one pattern per (batch, head); row 0 of head 1 sees nothing
        pattern = torch.rand(b, h, s_q, s_k, generator=gen) < 0.6
        pattern[:, 1, 0] = False
        masks.allowed_mask = pattern.to(device)
    if "dead-tiles" in masks_asked:  # queries 0-7 see no key from 8 on: with 8 × 8 blocks, whole tiles skipped
        i, j = torch.arange(s_q)[:, None], torch.arange(s_k)[None, :]
        masks.allowed_mask = (~((i < 8) & (j >= 8))).to(device)
    if "additive" in masks_asked:  # an ALiBi-like bias per head, -inf on a band: (1, H, S_q, S_k)
        i, j = torch.arange(s_q)[:, None], torch.arange(s_k)[None, :]
        slopes = torch.tensor([0.5 ** (t + 1) for t in range(h)], dtype=torch.float64)[:, None, None]
        bias = -slopes * (i - j).abs()
        bias = bias.masked_fill((j - i > 6) | ((i == 2) & (j < 10)), float("-inf"))[None]
        masks.additive = bias.to(device)
    if "pattern-2d" in masks_asked:  # (S_q, S_k), broadcast over batch and heads
        masks.allowed_mask = (torch.rand(s_q, s_k, generator=gen) < 0.5).to(device)
    return masks


def run_case(torch, plans, formulas, case, dtype, device, config):
    name, sweeps, scale, (b, h, h_kv, s_q, s_k, d, dv), masks_asked, causal, bam = case
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    make = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(device)
    q, k, v = make(b, h, s_q, d), make(b, h_kv, s_k, d), make(b, h_kv, s_k, dv)
    if "far" in masks_asked:  # scores near −750 (float64's case): exp(−c_j) and exp(−r_i) overflow
        q[..., 0] -= 46.0
        k[..., 0] += 46.0
    masks = make_masks(torch, plans, masks_asked, causal, (b, h, h_kv, s_q, s_k, d, dv), gen, device)
    if bam is not None:
        return run_bam_case(torch, plans, formulas, name, sweeps, scale, (q, k, v), masks, bam, gen, config)
    cot = make(b, h, s_q, dv)
    plan = name.split()[0]
    stats = torch.float64 if dtype == torch.float64 else torch.float32
    logit = torch.randn(h, generator=gen, dtype=torch.float64).to(stats).to(device) if plan == "hnas" else None
    ins = [t.detach().requires_grad_(True) for t in (q, k, v)] + ([logit.detach().requires_grad_(True)] if plan == "hnas" else [])
    if plan == "hnas":
        out = plans.hybrid_attention(*ins, score_scale=scale, masks=masks, config=config)
    else:
        out = plans.attention(*ins, sweeps=sweeps, score_scale=scale, masks=masks, config=config)
    grads = torch.autograd.grad(out, ins, cot)
    ref_ins = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref_logit = logit.detach().double().requires_grad_(True) if plan == "hnas" else None
    ref_out, ref_mass = reference(torch, formulas, *ref_ins, plan, scale, masks, ref_logit)
    ref_grads = torch.autograd.grad(ref_out, ref_ins + ([ref_logit] if plan == "hnas" else []), cot.double())
    compared = [("output", out, ref_out), ("dq", grads[0], ref_grads[0]), ("dk", grads[1], ref_grads[1]),
                ("dv", grads[2], ref_grads[2])]
    if plan == "hnas":
        compared.append(("dlogit", grads[3], ref_grads[3]))
    compared.append(("mass", plans.received_mass(q, k, v, sweeps, scale, masks, config, hybrid_logit=logit), ref_mass))
    return relative_errors(compared)


def relative_errors(compared):
    """Per (name, ours, reference): the largest difference over max(1, the reference's largest entry)."""
    return {what: (ours.double() - theirs.detach()).abs().max().item() / max(1.0, theirs.detach().abs().max().item())
            for what, ours, theirs in compared}


def run_bam_case(torch, plans, formulas, name, sweeps, scale, inputs, masks, bam, gen, config):
    """BAM over a plan against `formulas.bam_weights` given the same draws: the output, the KL
    part T (`plans.Sampling`), the received mass, and the gradients of Σ out·G + Σ T·W in q, k, v
    and the prior's values. The draws come from the kernels' own generator (`plans.counter_noise`,
    checked bit for bit against the CPU loop's record by `check_draws`), or, without a seed, are
    given to the kernels as a tensor."""
    q, k, v = inputs
    noise, noise_scale, kl, seed = bam
    b, h, s_q, dv = q.shape[0], q.shape[1], q.shape[2], v.shape[-1]
    s_k, device, stats = k.shape[2], q.device, torch.float64 if q.dtype == torch.float64 else torch.float32
    if seed is None:
        draw = torch.rand if noise == "weibull" else torch.randn
        given = draw(b, h, s_q, s_k, generator=gen, dtype=torch.float64).to(stats).to(device)
        sampling = plans.Sampling(noise, noise_scale, kl=kl, draws=given)
    else:
        sampling = plans.Sampling(noise, noise_scale, seed, kl)
    # Weibull: a Gamma shape α_j > 0 per (head, key), broadcast over the batch; Lognormal: μ_p,j + σ²/2.
    a = torch.rand(1, h, 1, s_k, generator=gen, dtype=torch.float64) + 0.1 if kl == "weibull" else \
        torch.randn(b, h, 1, s_k, generator=gen, dtype=torch.float64) - math.log(s_k)
    a = a.to(stats).to(device)
    cot = torch.randn(b, h, s_q, dv, generator=gen, dtype=torch.float64).to(q.dtype).to(device)
    weight = torch.randn(b, h, generator=gen, dtype=torch.float64).to(device)
    base = name.split(" over ")[1].split(",")[0]
    logit = torch.randn(h, generator=gen, dtype=torch.float64).to(stats).to(device) if base == "hnas" else None
    ins = [t.detach().requires_grad_(True) for t in (q, k, v)] + ([a.detach().requires_grad_(True)] if kl else [])
    ins += [logit.detach().requires_grad_(True)] if logit is not None else []
    # The mass from the same call, as the fused route forms it: one key pass after the forward.
    out, part, mass = plans.bam_attention(*ins[:3], sampling, sweeps=sweeps, score_scale=scale,
                                          prior=ins[3] if kl else None, masks=masks, config=config,
                                          hybrid_logit=ins[-1] if logit is not None else None, received=True)
    loss = (out.double() * cot.double()).sum() + ((part.double() * weight).sum() if kl else 0.0)
    grads = torch.autograd.grad(loss, ins)

    eps = given.double() if seed is None else plans.counter_noise((b, h, s_q, s_k), seed, noise, stats,
                                                                  device=device).double()
    ref_ins = [t.detach().double().requires_grad_(True) for t in (q, k, v, a)]
    rq, rk, rv, ra = ref_ins
    rlogit = logit.detach().double().requires_grad_(True) if logit is not None else None
    group = h // k.shape[1]
    kk, vv = rk.repeat_interleave(group, 1), rv.repeat_interleave(group, 1)
    allowed, z = reference_scores(torch, formulas, rq, kk, scale, masks)
    cfg = {"k": 1 / noise_scale, "sigma": noise_scale, "base": base, "prior_mu": 0.0, "prior_sigma": 1.0}
    w, _ = formulas.bam_weights("bam-nokl" if noise == "weibull" else "bam-lf", z, allowed, kk, eps, True, cfg,
                                hybrid_logit=rlogit)
    ref_out = w @ vv
    log_pi = formulas.log_weights(base, z, allowed, hybrid_logit=rlogit)
    if kl == "weibull":
        ref_part = torch.where(allowed, ra * log_pi, 0.0).sum((2, 3))
    elif kl == "lognormal":
        ref_part = torch.where(allowed, (log_pi - ra) ** 2, 0.0).sum((2, 3))
    else:
        ref_part = torch.zeros(b, h, dtype=torch.float64, device=device)
    ref_loss = (ref_out * cot.double()).sum() + ((ref_part * weight).sum() if kl else 0.0)
    ref_grads = torch.autograd.grad(ref_loss, ref_ins[:3] + ([ra] if kl else []) + ([rlogit] if logit is not None else []))
    compared = [("output", out, ref_out), ("dq", grads[0], ref_grads[0]), ("dk", grads[1], ref_grads[1]),
                ("dv", grads[2], ref_grads[2]), ("mass", mass, w.sum(-2))]
    if kl:
        compared += [("T", part, ref_part), ("dprior", grads[3], ref_grads[3])]
    if logit is not None:
        compared.append(("dlogit", grads[-1], ref_grads[-1]))
    return relative_errors(compared)


def reference_scores(torch, formulas, q, kk, scale, masks):
    """The allowed entries and the scores z (with the additive mask), from the formulas."""
    b, h, s_q, d = q.shape
    s_k = kk.shape[2]
    excluded = None if masks.allowed_mask is None else ~masks.allowed_mask.expand(b, h, s_q, s_k)
    if masks.additive is not None:
        dead = torch.isinf(masks.additive).expand(b, h, s_q, s_k)
        excluded = dead if excluded is None else excluded | dead
    allowed = formulas.allowed_mask(b, h, s_q, s_k, key_padding_mask=masks.key_padding_mask,
                                    query_padding_mask=masks.query_padding_mask, attn_mask=excluded,
                                    causal=masks.causal, device=q.device)
    z = q @ kk.transpose(-2, -1) * (scale / math.sqrt(d))
    if masks.additive is not None:
        z = z + torch.where(torch.isinf(masks.additive), 0.0, masks.additive.double())
    return allowed, z


def check_draws(torch, plans, device):
    """The kernels' draws against the CPU loop's record (counter_noise.json, kept true by
    tests/counter_noise_fixture.rs): per slice, how many values are identical, and the largest
    difference in units of the last place. The uniform draws must be identical; the Lognormal
    ones are too in float32, while in float64 sqrt(2)·erfinv(2u − 1) rests on erf and exp,
    whose last bits differ between math libraries, so there they are held to 16 units. The slices
    lie below position 2^32, past it, and across a multiple of it (rows whose positions take two
    high words, as one tile of the kernels then does). Then every float32 Lognormal draw, 2^23 of
    them, against their definition in numpy (`normal32`), and the Weibull noise term of every
    float32 draw against float64's log(−log(1 − u))."""
    record = json.loads((Path(__file__).parent / "counter_noise.json").read_text())
    lines, problems = [], []
    for c in record["cases"]:
        precision = torch.float32 if c["precision"] == "float32" else torch.float64
        ours = plans.counter_noise(c["shape"], c["seed"], c["noise"], precision, rows=range(*c["rows"]), device=device)
        ours = ours.index_select(3, torch.tensor(c["columns"], device=device)).double().flatten().cpu()
        theirs = torch.tensor([int(x, 16) - (1 << 64 if int(x, 16) >> 63 else 0) for x in c["bits"]],
                              dtype=torch.int64).view(torch.float64)
        ulps = (ours.view(torch.int64) - theirs.view(torch.int64)).abs()
        same, worst = int((ulps == 0).sum()), int(ulps.max())
        allowed = 16 if (c["noise"], c["precision"]) == ("lognormal", "float64") else 0
        (b, h, s_q, s_k), (first, last) = c["shape"], c["rows"]
        # The high words of each (batch, head)'s first and last position in the slice's rows.
        words = [((bh * s_q + first) * s_k >> 32, ((bh * s_q + last) * s_k - 1) >> 32) for bh in range(b * h)]
        where = ("across 2^32" if any(lo != hi for lo, hi in words) else
                 "past 2^32" if any(hi > 0 for _, hi in words) else "below 2^32")
        line = (f"{c['noise']:9} {c['precision']} {where} "
                f"seed {c['seed']:#x}: {same}/{ulps.numel()} identical, largest difference {worst} ulp")
        lines.append(line)
        if worst > allowed:
            problems.append(line)
    # Every float32 draw, not a slice: the Lognormal ε of float32 draws is a fixed sequence of
    # float32 operations (normal32.py), which bam._normal32 must follow bit for bit for each of
    # the 2^23, on a GPU with its own fused multiply-adds.
    from probattn_tools.kernels.bam import normal_draws_differ

    # A block of 2^16 draws is one array for the interpreter; on a GPU, 1,024 a program.
    differ, first = normal_draws_differ(device, block=1 << 16 if device == "cpu" else 1 << 10)
    line = (f"lognormal float32, all {1 << 23} draws: {(1 << 23) - differ} identical to normal32's"
            + (f", first differing m {first}" if differ else ""))
    lines.append(line)
    if differ:
        problems.append(line)
    # Weibull's noise term of every float32 draw: the kernels take it from approximate log2s
    # (bam._weibull32), held to WEIBULL_ERROR of log(−log(1 − u)) in float64.
    from probattn_tools.kernels.bam import weibull_error

    worst, at = weibull_error(device, block=1 << 16 if device == "cpu" else 1 << 10)
    line = f"weibull float32, all {1 << 23} draws: noise term within {worst:.2e} of float64's (largest at m {at})"
    lines.append(line)
    if not worst <= WEIBULL_ERROR:
        problems.append(f"{line}, past {WEIBULL_ERROR:.0e}")
    return lines, problems


def bad_input_messages(torch, plans, device):
    """Each bad input raises ValueError naming what is wrong."""
    x = torch.randn(1, 2, 4, 8, device=device)
    problems = []
    for what, call, expect in [
        ("rank", lambda: plans.attention(x[0], x, x), "(B, H, S, d)"),
        ("heads", lambda: plans.attention(torch.randn(1, 3, 4, 8, device=device), x, x), "multiple of the key/value heads"),
        ("dtype", lambda: plans.attention(x, x.double(), x), "must share"),
        ("causal dnas", lambda: plans.attention(x, x, x, sweeps=1, masks=plans.Masks(causal=True)), "causal"),
        ("sweeps", lambda: plans.attention(x, x, x, sweeps=-1), "sweeps must be"),
        ("key block", lambda: plans.attention(x, x, x, sweeps=1, config=plans.Config(block_n=512)), "plans.KEY_BLOCK"),
        ("padding", lambda: plans.attention(x, x, x, masks=plans.Masks(key_padding_mask=torch.zeros(1, 5, dtype=torch.bool,
                                                                                                   device=device))),
         "key_padding_mask"),
        ("pattern dtype", lambda: plans.attention(x, x, x, masks=plans.Masks(allowed_mask=torch.zeros(4, 4, device=device))),
         "allowed_mask must be a boolean"),
        ("pattern shape", lambda: plans.attention(x, x, x, masks=plans.Masks(
            allowed_mask=torch.ones(3, 4, dtype=torch.bool, device=device))), "does not broadcast"),
        ("additive dtype", lambda: plans.attention(x, x, x, masks=plans.Masks(
            additive=torch.ones(4, 4, dtype=torch.bool, device=device))), "additive must be a floating-point"),
        ("additive NaN", lambda: plans.attention(x, x, x, masks=plans.Masks(
            additive=torch.full((4, 4), float("nan"), device=device))), "NaN"),
        ("additive grad", lambda: plans.attention(x, x, x, masks=plans.Masks(
            additive=torch.zeros(4, 4, device=device, requires_grad=True))), "no gradient"),
        ("seed", lambda: plans.Sampling("weibull", 0.1, 2 ** 64), "seed must be"),
        ("seed and draws", lambda: plans.Sampling("weibull", 0.1, 1, draws=x), "one of the two"),
        ("draws shape", lambda: plans.bam_attention(x, x, x, plans.Sampling("weibull", 0.1, draws=x[:, :, :1])),
         "draws have shape"),
        ("draws NaN", lambda: plans.bam_attention(x, x, x, plans.Sampling("weibull", 0.1, draws=torch.full(
            (x.shape[0], x.shape[1], x.shape[2], x.shape[2]), math.nan, dtype=x.dtype, device=device))),
         "draws hold a NaN"),
        ("noise kind", lambda: plans.Sampling("gumbel", 0.1, 1), "noise must be"),
        ("noise scale", lambda: plans.Sampling("lognormal", float("nan"), 1), "noise scale"),
        ("no prior", lambda: plans.bam_attention(x, x, x, plans.Sampling("weibull", 0.1, 1, "weibull")), "prior"),
        ("prior shape", lambda: plans.bam_attention(x, x, x, plans.Sampling("weibull", 0.1, 1, "weibull"),
                                                    prior=torch.ones(1, 2, 4, 4, device=device)), "per key"),
        ("prior NaN", lambda: plans.bam_attention(x, x, x, plans.Sampling("weibull", 0.1, 1, "weibull"),
                                                  prior=torch.full((4,), float("nan"), device=device)), "NaN"),
    ]:
        try:
            call()
            problems.append(f"{what}: no error")
        except ValueError as e:
            if expect not in str(e):
                problems.append(f"{what}: the message does not say {expect!r}: {e}")
    return problems


def run_cases(torch, plans, formulas, args, config):
    """Every case of `args`' dtypes against its tolerance, a line each: (failures, results)."""
    failures, results = [], []
    for dtype_name in args.dtypes.split(","):
        if dtype_name not in TOLERANCE:
            sys.exit(f"kernels.check: unknown dtype {dtype_name!r} (known: {', '.join(TOLERANCE)})")
        dtype = getattr(torch, dtype_name)
        if args.device == "cpu" and dtype_name == "bfloat16":
            # Triton 3.6's interpreter multiplies bfloat16 matrices wrongly in tl.dot (errors of
            # 1e10 on a 16 × 16 product), though it loads, converts and stores them right.
            print("skip bfloat16: Triton's interpreter gets tl.dot wrong in bfloat16; run it on a GPU (--device cuda)")
            continue
        for case in [c for c in cases(args.quick, dtype_name != "float64") if args.cases in c[0]]:
            start = time.time()
            with contextlib.ExitStack() as stack:
                if "far" in case[4]:
                    # Past the last query or key the passes compute inf and NaN on purpose (what lies
                    # there is never stored); the interpreter's numpy would warn of each.
                    stack.enter_context(numpy.errstate(over="ignore", invalid="ignore"))
                if "deterministic" in case[4]:
                    stack.enter_context(deterministic_algorithms(torch))
                errors = run_case(torch, plans, formulas, case, dtype, args.device, config)
            # every error against the tolerance: NaN fails (max() of a list holding NaN may skip it)
            ok = all(e <= TOLERANCE[dtype_name] for e in errors.values())
            results.append({"case": case[0], "dtype": dtype_name, "errors": errors, "ok": ok})
            line = ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
            print(f"{'ok  ' if ok else 'FAIL'} {dtype_name:8} {case[0]:42} {line} ({time.time() - start:.1f} s)", flush=True)
            if not ok:
                failures.append(f"{dtype_name} {case[0]}: {line}")
    return failures, results


@contextlib.contextmanager
def deterministic_algorithms(torch):
    """libtorch's deterministic algorithms asked for inside the block (`torch.use_deterministic_algorithms`),
    as they were after it."""
    before, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn)


def record_launches(plans, seen, path):
    """Writes the launched specializations to `path` and prints how many of them the default
    ahead-of-time set (`kernels.aot`) holds, naming the kernels of those it lacks."""
    from collections import Counter

    from probattn_tools.kernels import aot

    default = {aot.key(plans, name, constexprs) for name, constexprs in aot.specializations(plans, False)}
    launched = sorted(seen, key=repr)
    lacking = [k for k in launched if k not in default]
    Path(path).write_text(json.dumps({"launched": [{"kernel": name, "constexprs": dict(values)}
                                                   for name, values in launched]}, indent=1) + "\n")
    print(f"launched {len(launched)} specializations (in {path}); the default ahead-of-time set holds "
          f"{len(launched) - len(lacking)} of them; it lacks: " +
          (", ".join(f"{n} x{c}" for n, c in sorted(Counter(name for name, _ in lacking).items())) or "none"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (Triton's interpreter) or cuda")
    parser.add_argument("--dtypes", default="float64,float32,bfloat16,float16", help="comma-separated")
    parser.add_argument("--quick", action="store_true", help="fewer cases (what the test suite runs)")
    parser.add_argument("--block", type=int, default=None, help="block size (default: 8 on the CPU, 64 on a GPU)")
    parser.add_argument("--cases", default="", help="run only the cases whose name contains this text")
    parser.add_argument("--key-tiles", choices=("rows", "transposed"), default=None,
                        help="how the key pass forms its tiles: (queries x keys) or (keys x queries) "
                             "(default: the build's, settings.TRANSPOSE_KEYS)")
    parser.add_argument("--cases-only", action="store_true",
                        help="run the cases alone, without the draws' record and the bad-input messages (which "
                             "--block and --key-tiles do not change)")
    parser.add_argument("--json", help="write the errors per case to this file")
    parser.add_argument("--record", help="write the kernel specializations the cases launched to this file (what "
                                         "`kernels.aot --set` compiles), and say which the default ahead-of-time "
                                         "set lacks")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from probattn_tools.kernels import plans
    from probattn_tools.reference import formulas

    if args.device == "cpu":
        import numpy

        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("kernels.check: set TRITON_INTERPRET=1 before Triton is imported to run on the CPU")
        if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4):
            sys.exit(f"kernels.check: Triton's interpreter needs numpy < 2.4 (loop bounds given at run time), found "
                     f"{numpy.__version__}; ./download_libtorch.sh installs a fitting one")
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    block = args.block or (8 if args.device == "cpu" else 64)
    transpose = plans.TRANSPOSE_KEYS if args.key_tiles is None else args.key_tiles == "transposed"
    config = plans.Config(block_m=block, block_n=block, num_warps=1 if args.device == "cpu" else 4,
                          transpose_keys=transpose)
    with plans.launched() as seen:
        failures, results = run_cases(torch, plans, formulas, args, config)
    if args.record:
        record_launches(plans, seen, args.record)
    draws, problems = [], []
    if not args.cases_only:
        draws, problems = check_draws(torch, plans, args.device)
        for line in draws:
            print(f"draws {line}")
        problems += bad_input_messages(torch, plans, args.device)
    for p in problems:
        print("FAIL bad input", p)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "results": results, "draws": draws, "problems": problems}, f, indent=1)
    if failures or problems:
        print(f"{len(failures) + len(problems)} failure(s)")
        return 1
    print(f"all {len(results)} cases within tolerance" + ("" if args.cases_only else
                                                           "; draws as recorded; bad input named"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

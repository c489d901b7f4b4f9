"""Checks the Triton kernels of the plans (`probattn_tools.kernels.plans`) against the reference
formulas (`probattn_tools.reference.formulas`, written from the papers): the output, the gradients
in q, k and v (and HNAS's gate logits) and the received mass, over plans (softmax, DNAS, HNAS,
Sinkhorn-3, another score scale), masks (key padding, query padding, boolean patterns per head or
broadcast, a row that sees nothing, causal), grouped key/value
heads, lengths that are not multiples of the blocks, head dimensions that are not powers of two,
and dtypes.

    python -m probattn_tools.kernels.check                  # on the CPU, under Triton's interpreter
    python -m probattn_tools.kernels.check --device cuda    # on a GPU, compiled

The reference runs in float64 on the inputs as the kernel sees them (rounded to its dtype); each
dtype is held to its tolerance: float64 1e-10, float32 2e-5 (TF32 off), bfloat16 3e-2 and float16
4e-3 (scaled by the largest reference value). On the CPU the script sets TRITON_INTERPRET=1
itself before Triton is imported; Triton 3.6's interpreter needs numpy < 2.4 (loop bounds that are
run-time arguments) and multiplies bfloat16 matrices wrongly, so bfloat16 is checked on a GPU
only. Prints one line per case and exits 1 if any case fails.
"""

import argparse
import json
import math
import os
import sys
import time
import zlib

TOLERANCE = {"float64": 1e-10, "float32": 2e-5, "bfloat16": 3e-2, "float16": 4e-3}


def cases(quick, lower):
    """(name, sweeps, score_scale, (B, H, H_kv, S_q, S_k, d, d_v), masks, causal). `lower`: the
    cases of a lower precision (the padded one per plan, and the causal one); `quick`: no
    rectangular, one-entry or pattern cases beyond the first plan's."""
    shapes = {"gqa": (2, 4, 2, 13, 11, 8, 5), "rect": (1, 2, 2, 7, 19, 16, 16), "one": (1, 1, 1, 1, 1, 4, 4)}
    out = []
    for sweeps, plan in ((0, "softmax"), (1, "dnas"), (1, "hnas"), (3, "sinkhorn-3")):
        if not lower:
            out.append((f"{plan} gqa unmasked", sweeps, 1.0, shapes["gqa"], (), False))
        out.append((f"{plan} gqa key+query padding, scale 0.5", sweeps, 0.5, shapes["gqa"], ("key", "query"), False))
        if not lower and (not quick or plan == "dnas"):
            out.append((f"{plan} gqa pattern per head, key padding", sweeps, 1.0, shapes["gqa"], ("pattern", "key"), False))
            out.append((f"{plan} gqa pattern with dead tiles", sweeps, 1.0, shapes["gqa"], ("dead-tiles",), False))
            out.append((f"{plan} gqa additive mask, -inf entries", sweeps, 1.0, shapes["gqa"], ("additive", "key"), False))
        if not quick and not lower:
            out.append((f"{plan} rect pattern broadcast over batch", sweeps, 1.0, shapes["rect"], ("pattern-2d",), False))
            out.append((f"{plan} rect key padding", sweeps, 1.0, shapes["rect"], ("key",), False))
            out.append((f"{plan} one entry", sweeps, 1.0, shapes["one"], (), False))
    out.append(("softmax gqa causal, key padding", 0, 2.0, shapes["gqa"], ("key",), True))
    if not quick and not lower:
        out.append(("softmax rect causal", 0, 1.0, shapes["rect"], (), True))
    return out


def reference(torch, formulas, q, k, v, plan, scale, masks, logit=None):
    """Output and received mass from the formulas, in float64, keys and values repeated per group."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    b, h, s_q, d = q.shape
    excluded = None if masks.allowed_mask is None else ~masks.allowed_mask.expand(b, h, s_q, k.shape[2])
    if masks.additive is not None:  # -inf entries are excluded pairs; the rest adds to the scores
        dead = torch.isinf(masks.additive).expand(b, h, s_q, k.shape[2])
        excluded = dead if excluded is None else excluded | dead
    allowed = formulas.allowed_mask(b, h, s_q, k.shape[2], key_padding_mask=masks.key_padding_mask,
                                    query_padding_mask=masks.query_padding_mask, attn_mask=excluded,
                                    causal=masks.causal, device=q.device)
    z = q @ kk.transpose(-2, -1) * (scale / math.sqrt(d))
    if masks.additive is not None:
        z = z + torch.where(torch.isinf(masks.additive), 0.0, masks.additive.double())
    w = formulas.normalize(plan, z, allowed, hybrid_logit=logit)
    return w @ vv, w.sum(-2)


def run_case(torch, plans, formulas, case, dtype, device, config):
    name, sweeps, scale, (b, h, h_kv, s_q, s_k, d, dv), masks_asked, causal = case
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    make = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(device)
    q, k, v = make(b, h, s_q, d), make(b, h_kv, s_k, d), make(b, h_kv, s_k, dv)
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
    else:
        compared.append(("mass", plans.received_mass(q, k, v, sweeps, scale, masks, config), ref_mass))
    errors = {}
    for what, ours, theirs in compared:
        theirs = theirs.detach()
        err = (ours.double() - theirs).abs().max().item()
        errors[what] = err / max(1.0, theirs.abs().max().item())
    return errors


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
    ]:
        try:
            call()
            problems.append(f"{what}: no error")
        except ValueError as e:
            if expect not in str(e):
                problems.append(f"{what}: the message does not say {expect!r}: {e}")
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (Triton's interpreter) or cuda")
    parser.add_argument("--dtypes", default="float64,float32,bfloat16,float16", help="comma-separated")
    parser.add_argument("--quick", action="store_true", help="fewer cases (what the test suite runs)")
    parser.add_argument("--block", type=int, default=None, help="block size (default: 8 on the CPU, 64 on a GPU)")
    parser.add_argument("--cases", default="", help="run only the cases whose name contains this text")
    parser.add_argument("--json", help="write the errors per case to this file")
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
    config = plans.Config(block_m=block, block_n=block, num_warps=1 if args.device == "cpu" else 4)
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
            errors = run_case(torch, plans, formulas, case, dtype, args.device, config)
            worst = max(errors.values())
            ok = worst <= TOLERANCE[dtype_name]
            results.append({"case": case[0], "dtype": dtype_name, "errors": errors, "ok": ok})
            line = ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
            print(f"{'ok  ' if ok else 'FAIL'} {dtype_name:8} {case[0]:42} {line} ({time.time() - start:.1f} s)", flush=True)
            if not ok:
                failures.append(f"{dtype_name} {case[0]}: {line}")
    problems = bad_input_messages(torch, plans, args.device)
    for p in problems:
        print("FAIL bad input", p)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "results": results, "bad_input": problems}, f, indent=1)
    if failures or problems:
        print(f"{len(failures) + len(problems)} failure(s)")
        return 1
    print(f"all {len(results)} cases within tolerance; bad input named")
    return 0


if __name__ == "__main__":
    sys.exit(main())

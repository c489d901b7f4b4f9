"""The launches `plans.attention` makes for one call, forward then backward, as JSON: what the
library's fused CUDA route (probattn-sys/csrc/fused_cuda.cpp) must launch for the same call, which
its dry run describes in the same form. tests/fused_cuda.rs compares the two, launch by launch
(kernel, specialization, grid, every integer argument, every tensor's shape and dtype). The
inputs are float16 on the CPU, and the kernels are not run: each launch is recorded instead, since
the orchestration reads no value a kernel computes (only the inputs' and masks' own checks read
values); `--dtype float32` describes a float32 call. `--execute` runs them too, under Triton's interpreter.

    python -m probattn_tools.kernels.launches --shape 2,4,2,70,90,48,48 --sweeps 1 --key-padding --scale 0.3
    python -m probattn_tools.kernels.launches --shape 1,2,2,40,40,64,64 --sweeps 0 --scale 0.125 --noise weibull --seed 7
    python -m probattn_tools.kernels.launches --shape 1,2,1,70,70,64,64 --sweeps 3 --scale 0.125
    printf '%s\n' "--shape 1,1,1,8,8,16,16 --scale 1" "--shape 1,1,1,8,8,16,16 --scale 1 --causal" \
        | python -m probattn_tools.kernels.launches --batch      # many calls, one process, a JSON list

`--sweeps N` for N ≥ 2 is Sinkhorn-N; `--hybrid` is HNAS (`plans.hybrid_attention`, DNAS mixed
with softmax by a gate per head). With `--noise`, BAM's sampling over the plan (over HNAS with
`--hybrid`) with its KL term of the same kind, against a prior of shape (B, H, 1, S_k); the
backward then starts from the output and the KL part alike. `--no-kl` leaves the KL term out.
`--mass` adds the received mass's key passes after the forward's (with `--noise`, of BAM's sampled
weights). `--deterministic` asks for libtorch's deterministic algorithms during the call, under which
Sinkhorn-N's dQ takes a stage of its own instead of atomic adds.
"""

import argparse
import json
import os
import sys


_RUN = None  # plans._Call.launch as plans defines it


def parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", required=True, help="B,H,H_KV,S_Q,S_K,D,DV")
    parser.add_argument("--sweeps", type=int, default=0, help="0 softmax, 1 DNAS, N ≥ 2 Sinkhorn-N")
    parser.add_argument("--hybrid", action="store_true", help="HNAS: DNAS and softmax mixed by a gate per head")
    parser.add_argument("--scale", type=float, required=True, help="the factor of q·kᵀ")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--key-padding", action="store_true", help="pad the last key of the first batch")
    parser.add_argument("--query-padding", action="store_true", help="pad the first query of the last batch")
    parser.add_argument("--pattern", action="store_true", help="a boolean (S_q, S_k) pattern, broadcast over batch and "
                                                                "heads (True = takes part)")
    parser.add_argument("--additive", action="store_true", help="an additive (1, H, S_q, S_k) mask, some entries -inf")
    parser.add_argument("--noise", choices=("weibull", "lognormal"), help="BAM's sampling (with --hybrid over HNAS)")
    parser.add_argument("--no-kl", action="store_true", help="BAM's sampling without its KL term (bam-nokl)")
    parser.add_argument("--noise-scale", type=float, default=0.5, help="1/k or sigma")
    parser.add_argument("--seed", type=int, default=0, help="the draws' key")
    parser.add_argument("--mass", action="store_true", help="the received mass too")
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="float16",
                        help="q, k and v's dtype")
    parser.add_argument("--deterministic", action="store_true",
                        help="with libtorch's deterministic algorithms asked for (torch.use_deterministic_algorithms): "
                             "Sinkhorn-N's dQ in a stage of its own, not by atomic adds")
    parser.add_argument("--execute", action="store_true", help="also run the kernels, under Triton's interpreter")
    parser.add_argument("--config", default="64,64,4,2",
                        help="block_m,block_n,num_warps,num_stages: the embedded cubins' (their manifest says)")
    return parser


def main(argv=None):
    """One call's launches from the command line; with `--batch` alone, one call per line of
    standard input (each line that call's arguments), their launches as one JSON list: one
    process for many calls."""
    argv = sys.argv[1:] if argv is None else argv
    calls = [line.split() for line in sys.stdin.read().splitlines() if line.strip()] if argv == ["--batch"] else [argv]
    records = [launches(parser().parse_args(call)) for call in calls]
    print(json.dumps(records if argv == ["--batch"] else records[0]))
    return 0


def launches(args):
    """The launches of the call `args` describes, forward then backward."""
    try:
        b, h, h_kv, s_q, s_k, d, dv = (int(x) for x in args.shape.split(","))
    except ValueError:
        sys.exit(f"launches: --shape takes seven integers B,H,H_KV,S_Q,S_K,D,DV, got {args.shape!r}")
    try:
        block_m, block_n, num_warps, num_stages = (int(x) for x in args.config.split(","))
    except ValueError:
        sys.exit(f"launches: --config takes four integers block_m,block_n,num_warps,num_stages, got {args.config!r}")
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from probattn_tools.kernels import plans

    global _RUN
    if _RUN is None:
        _RUN = plans._Call.launch

    def record_only(call, kernel, grid, **extra):
        launch_args, grid, _, _ = call.prepared(kernel, grid, **extra)
        plans.LAUNCHES.append(plans._launch_record(kernel, grid, launch_args))
    plans._Call.launch = _RUN if args.execute else record_only

    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    q = torch.randn(b, h, s_q, d, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(b, h_kv, s_k, d, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(b, h_kv, s_k, dv, generator=gen, dtype=dtype, requires_grad=True)
    # The route reads key and query padding together: a call with one passes no padding for the
    # other, and BAM's kernels are all padded ones. Its masked kernels read the paddings, the
    # pattern and the additive mask together, each absent one as one neutral value broadcast.
    kpad = qpad = pattern = additive = None
    masked = args.pattern or args.additive
    if args.key_padding or args.query_padding or args.noise or masked:
        kpad, qpad = torch.zeros(b, s_k, dtype=torch.bool), torch.zeros(b, s_q, dtype=torch.bool)
        kpad[0, -1] = args.key_padding
        qpad[-1, 0] = args.query_padding
    if masked:
        pattern = torch.rand(s_q, s_k, generator=gen) < 0.7 if args.pattern else torch.ones(1, 1, 1, 1, dtype=torch.bool)
        additive = torch.zeros(1, 1, 1, 1)
        if args.additive:
            i, j = torch.arange(s_q)[:, None], torch.arange(s_k)[None, :]
            slopes = torch.tensor([0.5 ** (t + 1) for t in range(h)])[:, None, None]
            additive = (-slopes * (i - j).abs()).masked_fill(j - i > 6, float("-inf"))[None]
    masks = plans.Masks(key_padding_mask=kpad, query_padding_mask=qpad, allowed_mask=pattern, causal=args.causal,
                        additive=additive)
    config = plans.Config(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(args.deterministic)
    try:
        return _recorded(torch, plans, args, (q, k, v), masks, config, gen)
    finally:
        torch.use_deterministic_algorithms(before)


def _recorded(torch, plans, args, qkv, masks, config, gen):
    """The launches of one call and its backward, recorded (the prior and the gate drawn from `gen`)."""
    q, k, v = qkv
    (b, h, _, d), s_k = q.shape, k.shape[2]
    with plans.launches() as seen:
        if args.noise:
            prior = None if args.no_kl else torch.rand(b, h, 1, s_k, generator=gen, dtype=torch.float32,
                                                        requires_grad=True)
            logit = torch.randn(h, generator=gen, dtype=torch.float32, requires_grad=True) if args.hybrid else None
            sampling = plans.Sampling(args.noise, args.noise_scale, args.seed, kl=None if args.no_kl else args.noise)
            out, part, *_ = plans.bam_attention(q, k, v, sampling, sweeps=args.sweeps, score_scale=args.scale * d ** 0.5,
                                                prior=prior, masks=masks, config=config, hybrid_logit=logit,
                                                received=args.mass)
            if args.no_kl:
                out.backward(torch.ones_like(out))
            else:
                torch.autograd.backward([out, part], [torch.ones_like(out), torch.ones_like(part)])
        elif args.hybrid:
            logit = torch.randn(h, generator=gen, dtype=torch.float32, requires_grad=True)
            out = plans.hybrid_attention(q, k, v, logit, score_scale=args.scale * d ** 0.5, masks=masks, config=config,
                                         received=args.mass)
            out = out[0] if args.mass else out
            out.backward(torch.ones_like(out))
        else:
            out = plans.attention(q, k, v, sweeps=args.sweeps, score_scale=args.scale * d ** 0.5, masks=masks,
                                  config=config, received=args.mass)
            out = out[0] if args.mass else out
            out.backward(torch.ones_like(out))
    return seen


if __name__ == "__main__":
    sys.exit(main())

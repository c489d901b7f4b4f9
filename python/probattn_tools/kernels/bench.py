"""Times the Triton kernels of the plans on a GPU against what a PyTorch user would otherwise run,
in one process: SDPA (flash) softmax, compiled FlexAttention softmax, compiled FlexAttention DNAS
from two calls, and our softmax, DNAS and BAM (Weibull and Lognormal over softmax, with their KL
terms) kernels. Forward + backward, bfloat16 by default.

    python -m probattn_tools.kernels.bench --out results/cuda/DATE/kernels
    python -m probattn_tools.kernels.bench --shapes 8x1024,1x4096 --head-dim 64 --repeats 20

For each shape (B × S, H heads, head dimension d) it prints and writes (`bench.json`, with the
commit and whether the tree was dirty) the median and IQR of each implementation's time, its
TFLOP/s (attention's 4·B·H·S²·d forward and 10·B·H·S²·d backward flops: two and five products of
2·B·H·S²·d each; DNAS's extra column pass and correction products are not counted, so its TFLOP/s
compares with softmax's as a time does), its peak memory, and its time relative to SDPA's. Each implementation's output is first compared with SDPA's (softmax) or with DNAS from the
formulas (at S ≤ 4,096), and a mismatch is recorded instead of a time. FlexAttention's DNAS uses a
separate value tensor for its column call, `dynamic=False` and a raised recompile limit (with `q`
reused as that value, Dynamo recompiled past its limit and fell back to an unfused path).

`--key-tiles both` also times each chosen probattn implementation with its key pass formed the
other way round from the build's (`settings.TRANSPOSE_KEYS`), in the same run.

`--dq both` also times each chosen probattn implementation over softmax's base (softmax, BAM-WC,
BAM-LC) with dQ from a query pass of its own, as libtorch's deterministic algorithms ask for
(`+query-pass`), beside the default, whose key pass adds dQ by atomics.

`--profile` also runs one more forward + backward of each implementation under PyTorch's profiler
and records where its GPU time goes: each kernel's time and calls, the largest first (`kernels` in
the row, the first five printed), so that a slow plan shows which of its passes is slow.
"""

import argparse
import json
import math
import sys
from pathlib import Path


def implementations(torch, args):
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    from probattn_tools.kernels import plans

    torch._dynamo.config.recompile_limit = 64
    flex = torch.compile(flex_attention, dynamic=False)

    def flex_dnas(q, k, v):
        ones = torch.zeros_like(q)  # the column call's value: its output is discarded
        _, column_lse = flex(k, q, ones, return_lse=True)

        def minus_column_lse(score, b, h, q_idx, kv_idx):
            return score - column_lse[b, h, kv_idx]
        return flex(q, k, v, score_mod=minus_column_lse)

    def bam(noise, scale, config):
        # BAM over softmax with its KL term (BAM-WC: Weibull, k = 10; BAM-LC: Lognormal, σ = 1), the
        # prior's per-key values a given tensor (its network runs outside the kernels, O(S·d)); the
        # step's output is the attention output plus the KL part's gradient path.
        sampling = plans.Sampling(noise, scale, seed=1234, kl=noise)

        def run(q, k, v):
            a = torch.full((1, q.shape[1], 1, k.shape[2]), 1.0 / k.shape[2], device=q.device, requires_grad=True)
            out, part = plans.bam_attention(q, k, v, sampling, sweeps=0, prior=a, config=config)
            return out + part.sum().to(out.dtype) * 0  # one output: T's backward still runs
        return run

    def ours(transpose_keys):
        config = plans.Config(args.block_m, args.block_n, args.num_warps, args.num_stages,
                              transpose_keys=transpose_keys)
        return {
            "probattn-softmax": ("softmax", lambda q, k, v: plans.attention(q, k, v, sweeps=0, config=config)),
            "probattn-dnas": ("dnas", lambda q, k, v: plans.attention(q, k, v, sweeps=1, config=config)),
            "probattn-bam-wc": ("bam-weibull", bam("weibull", 0.1, config)),
            "probattn-bam-lc": ("bam-lognormal", bam("lognormal", 1.0, config)),
        }

    found = {
        "sdpa": ("softmax", lambda q, k, v: F.scaled_dot_product_attention(q, k, v)),
        "flex-softmax": ("softmax", lambda q, k, v: flex(q, k, v)),
        "flex-dnas": ("dnas", flex_dnas),
        **ours(plans.TRANSPOSE_KEYS),
    }
    # the key pass's other form (`settings.TRANSPOSE_KEYS`), for `--key-tiles both`
    other = OTHER_KEYS[plans.TRANSPOSE_KEYS]
    found.update({f"{name}{other}": impl for name, impl in ours(not plans.TRANSPOSE_KEYS).items()})
    return found


# The suffix of an implementation whose key pass takes the form the build leaves out, by the build's
# TRANSPOSE_KEYS.
OTHER_KEYS = {False: "+transposed-keys", True: "+row-keys"}


# The suffix of an implementation timed with dQ from a query pass of its own (`--dq both`).
QUERY_PASS = "+query-pass"


def deterministic(torch, step):
    """`step` with libtorch's deterministic algorithms asked for (warnings only, for the ops that
    have no deterministic form), under which softmax's base forms dQ in a query pass of its own."""
    def run():
        before, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            step()
        finally:
            torch.use_deterministic_algorithms(before, warn_only=warn)
    return run


def kernel_times(torch, step, device, top=12):
    """One call of `step` under PyTorch's profiler: {"total_ms", "kernels": [{"kernel", "calls", "ms"}]},
    the `top` kernels by their time on the device (on the CPU, the operators by their own time)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        step()
        sync()
    found = []
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", 0) if cuda else event.self_cpu_time_total
        if us > 0:
            found.append({"kernel": event.key, "calls": event.count, "ms": us / 1e3})
    found.sort(key=lambda r: -r["ms"])
    return {"total_ms": sum(r["ms"] for r in found), "kernels": found[:top]}


def check(torch, name, plan, fn, q, k, v):
    """Max error of fn's output against SDPA (softmax), the formulas' DNAS, or softmax over the
    scores plus BAM's noise term from the same draws, in float32."""
    import torch.nn.functional as F

    from probattn_tools.kernels import plans
    from probattn_tools.reference import formulas

    with torch.no_grad():
        out = fn(q, k, v).float()
        b, h, s, d = q.shape
        if plan == "softmax":
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        elif plan == "dnas":
            z = q.float() @ k.float().transpose(-2, -1) / math.sqrt(d)
            allowed = torch.ones(1, 1, s, s, dtype=torch.bool, device=q.device)
            ref = formulas.dnas_weights(z, allowed) @ v.float()
        else:
            noise = plan.split("-")[1]
            eps = plans.counter_noise((b, h, s, s), 1234, noise, torch.float32, device=q.device)
            n = torch.log(-torch.log1p(-eps)) * 0.1 if noise == "weibull" else eps
            z = q.float() @ k.float().transpose(-2, -1) / math.sqrt(d)
            ref = torch.softmax(z + n, -1) @ v.float()
    return (out - ref).abs().max().item()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8x1024,1x4096,1x16384,1x32768", help="B x S, comma-separated")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--block-m", type=int, default=64)
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--num-stages", type=int, default=2)
    parser.add_argument("--impls", default="sdpa,flex-softmax,flex-dnas,probattn-softmax,probattn-dnas,probattn-bam-wc,"
                        "probattn-bam-lc")
    parser.add_argument("--out", help="folder for bench.json (default: print only)")
    parser.add_argument("--profile", action="store_true", help="record each implementation's time kernel by kernel")
    parser.add_argument("--dq", choices=("atomic", "both"), default="atomic",
                        help="both: also softmax's base (probattn-softmax, -bam-wc, -bam-lc) with dQ from a query pass "
                             "of its own, under deterministic algorithms (+query-pass), in the same run")
    parser.add_argument("--key-tiles", choices=("build", "both"), default="build",
                        help="both: also each chosen probattn implementation with the key pass formed the other way "
                             "round from the build's (settings.TRANSPOSE_KEYS: (queries x keys) or (keys x queries)), "
                             "named with +transposed-keys or +row-keys, in the same run")
    args = parser.parse_args(argv)
    import torch

    from probattn_tools.baselines.bench import cuda_peak_during, error_line, time_interleaved
    from probattn_tools.baselines.precision_profile import scripts_provenance

    if not torch.cuda.is_available():
        sys.exit("kernels.bench: needs a CUDA GPU (the CPU check is `python -m probattn_tools.kernels.check`)")
    dtype = getattr(torch, args.dtype)
    impls = implementations(torch, args)
    chosen = args.impls.split(",")
    if args.key_tiles == "both":
        from probattn_tools.kernels import plans

        other = OTHER_KEYS[plans.TRANSPOSE_KEYS]
        chosen += [f"{n}{other}" for n in chosen if n.startswith("probattn-")]
    if args.dq == "both":
        chosen += [f"{n}{QUERY_PASS}" for n in chosen if n.startswith(("probattn-softmax", "probattn-bam"))]
    unknown = [n for n in chosen if n.removesuffix(QUERY_PASS) not in impls]
    if unknown:
        sys.exit(f"kernels.bench: unknown implementation(s) {unknown} (known: {', '.join(impls)})")
    rows = []
    for shape in args.shapes.split(","):
        b, s = (int(x) for x in shape.lower().split("x"))
        h, d = args.heads, args.head_dim
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=gen).requires_grad_(True) for _ in range(3))
        grad = torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=gen)
        flops = 14 * b * h * s * s * d  # forward two products, backward five, each 2·B·H·S²·d flops
        steps, names = [], []
        for name in chosen:
            plan, fn = impls[name.removesuffix(QUERY_PASS)]
            row = {"shape": f"{b}x{s}", "B": b, "S": s, "H": h, "d": d, "dtype": args.dtype, "impl": name, "plan": plan}
            try:
                if s <= 4096:
                    row["max_error"] = check(torch, name, plan, fn, q, k, v)
                step = lambda fn=fn: torch.autograd.backward(fn(q, k, v), grad)  # noqa: E731
                if name.endswith(QUERY_PASS):
                    step = deterministic(torch, step)
                step()
                row["peak_mib"] = cuda_peak_during(step) / 2**20
                steps.append(step)
                names.append(len(rows))
            except Exception as e:  # recorded, and the other implementations go on
                row["error"] = error_line(e)
            rows.append(row)
        for i, (med, iqr) in zip(names, time_interleaved(steps, args.repeats, torch.device("cuda"))):
            rows[i].update(ms=med, iqr_ms=iqr, tflops=flops / (med * 1e-3) / 1e12)
        if args.profile:
            for i, step in zip(names, steps):
                try:
                    rows[i]["profile"] = kernel_times(torch, step, torch.device("cuda"))
                except Exception as e:  # recorded; the times stand
                    rows[i]["profile"] = {"error": error_line(e)}
        sdpa = next((r["ms"] for r in rows if r["shape"] == f"{b}x{s}" and r["impl"] == "sdpa" and "ms" in r), None)
        for r in rows:
            if r["shape"] == f"{b}x{s}":
                if sdpa and "ms" in r:
                    r["vs_sdpa"] = r["ms"] / sdpa
                cells = (f"{r['ms']:8.2f} ms ± {r['iqr_ms']:.2f}, {r['tflops']:6.1f} TFLOP/s, {r['peak_mib']:8.1f} MiB, "
                         f"{r.get('vs_sdpa', float('nan')):.2f}× SDPA" if "ms" in r else r.get("error", ""))
                print(f"{r['shape']:>8} {r['impl']:18} {cells}  err {r.get('max_error', float('nan')):.1e}", flush=True)
                for kernel in r.get("profile", {}).get("kernels", [])[:5]:
                    print(f"{'':>10}{kernel['ms']:9.3f} ms  {kernel['calls']:3d}×  {kernel['kernel'][:90]}", flush=True)
                if "error" in r.get("profile", {}):
                    print(f"{'':>10}profile: {r['profile']['error']}", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        record = {"provenance": scripts_provenance(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "settings": vars(args), "rows": rows}
        tmp = out / "bench.json.tmp"
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(out / "bench.json")
        print(f"wrote {out / 'bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

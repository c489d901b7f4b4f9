"""Benchmarks of the probattn Python package (results/python/), each against its comparison in the
same run:

1. overhead (`--overhead`): `probattn.attention` called from Python against the same
   `probattn::attend` call from Rust (`probattn._native.rust_timing`, which runs it in this
   process and thread), B 1, H 8, d 64, S `--seq`, float32, one thread; forward alone and forward
   + backward, eager and memory-efficient; and PyTorch's SDPA called the same two ways, the floor.
   The two sides take turns, `--rounds` rounds of `--repeats` calls; the ratio is of the medians
   over all calls.
2. memory: one multi-head attention layer (E 512, H 8, B 1) with DNAS, forward + backward, at
   `--memory-seq` (default 4096): `probattn.nn.MultiheadAttention(memory_efficient=True)` against
   the pure-PyTorch module of python/probattn_tools (S x S weights). Peak bytes from probattn's
   counting CPU allocator (`--memory-lib`, libprobattn_memory.so beside the build), loaded into
   this process as `probattn bench` does, and the median time of interleaved calls; on CUDA the
   caching allocator's peak.
3. flex (CUDA, `--flex-seqs`): DNAS at length, B 1, H 8, d 64, forward + backward:
   `probattn.attention(..., variant="dnas", memory_efficient=True)` against DNAS composed from two
   compiled FlexAttention calls (the column log-sum-exp through `return_lse`, then a `score_mod`
   that subtracts it; probattn_tools.baselines.bench.dnas_flex), time and peak memory.
4. sdpa (`--sdpa-seqs`): softmax through `probattn.functional.scaled_dot_product_attention`
   against `torch.nn.functional.scaled_dot_product_attention` itself, B 1, H 8, d 64, float32,
   without a mask and causal, forward alone and forward + backward, calls taking turns
   (`--sdpa-repeats` each); the ratio of medians.

`--device cuda` runs them on the GPU.

    python python/probattn/benchmarks/bench.py --overhead \\
        --memory-lib target/release/build/probattn-sys-*/out/libprobattn_memory.so --out results/python

with `probattn` importable (installed, or on PYTHONPATH) and python/ on PYTHONPATH for the
reference module. Writes `bench.json` (with the code's version) and `README`-ready `bench.md`.
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
from _record import git_state, write_atomic  # this folder's, beside the script



def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def python_timing(call, s, repeats, device, seed=0):
    """The milliseconds of `call(q, k, v)` on `randn (1, 8, s, 64)` float32 inputs, forward alone
    (under no_grad) and forward + backward (`.sum().backward()`), each `repeats` times after two
    warm-up calls, as `_native.rust_timing` times the same call from Rust: the gradients are
    zeroed in place between calls, outside the timed region."""
    torch.manual_seed(seed)
    q, k, v = (torch.randn(1, 8, s, 64, device=device) for _ in range(3))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    forward, both = [], []
    for i in range(repeats + 2):
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            call(q, k, v)
        sync(device)
        f = 1e3 * (time.perf_counter() - start)
        start = time.perf_counter()
        call(qg, kg, vg).sum().backward()
        sync(device)
        fb = 1e3 * (time.perf_counter() - start)
        for t in (qg, kg, vg):
            t.grad.zero_()
        if i >= 2:
            forward.append(f)
            both.append(fb)
    return forward, both


def overhead(probattn, args):
    """Each call from Python against the same call from Rust, in this process and thread
    (`_native.rust_timing`), and PyTorch's own `scaled_dot_product_attention` timed the same two
    ways (`sdpa`: Python's `F.scaled_dot_product_attention` against tch's call of it), the cost any
    library pays for being called from Python. Every case and side takes its turn in each of
    `--rounds` rounds of `--repeats` calls (the machine's speed drifts over seconds; turns keep
    that drift out of the ratios), and each ratio is of the medians over all calls."""
    import torch.nn.functional as F

    def ours(variant, memory_efficient):
        tile = 256 if memory_efficient else None
        return lambda q, k, v: probattn.attention(q, k, v, variant=variant, memory_efficient=memory_efficient, tile=tile)

    cases = [(variant, me) for variant in ("softmax", "dnas") for me in (False, True)] + [("sdpa", False)]
    calls = {case: (F.scaled_dot_product_attention if case[0] == "sdpa" else ours(*case)) for case in cases}
    times = {case: (([], []), ([], [])) for case in cases}  # (python, rust), each (forward, forward_backward)
    for _ in range(args.rounds):
        for case in cases:
            variant, memory_efficient = case
            p = python_timing(calls[case], args.seq, args.repeats, args.device)
            r = probattn._native.rust_timing("softmax" if variant == "sdpa" else variant, args.seq,
                                             memory_efficient=memory_efficient, repeats=args.repeats,
                                             device=args.device.type, baseline=variant == "sdpa")
            for side, measured in zip(times[case], (p, r)):
                for i in range(2):
                    side[i].extend(measured[i])
    rows = []
    for (variant, memory_efficient), (py, rs) in times.items():
        for i, key in enumerate(("forward", "forward_backward")):
            a, b = statistics.median(py[i]), statistics.median(rs[i])
            rows.append({"variant": variant, "memory_efficient": memory_efficient, "pass": key, "python_ms": a,
                         "rust_ms": b, "ratio": a / b, "python_calls": py[i], "rust_calls": rs[i]})
            print(f"overhead {variant:8} {'memory-efficient' if memory_efficient else 'eager':16} {key:17} "
                  f"python {a:8.4f} ms  rust {b:8.4f} ms  ratio {a / b:.3f}", file=sys.stderr)
    return rows


def memory(probattn, args):
    from probattn_tools.baselines.bench import CpuCounter, cuda_peak_during, time_interleaved
    from probattn_tools.reference.mha import MultiheadAttention as Reference

    peak_during = cuda_peak_during if args.device.type == "cuda" else CpuCounter(args.memory_lib).peak_during
    torch.manual_seed(0)
    ours = probattn.nn.MultiheadAttention(512, 8, variant="dnas", batch_first=True, memory_efficient=True).to(args.device)
    ref = Reference(512, 8, variant="dnas", batch_first=True).to(args.device)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(1, args.memory_seq, 512, device=args.device, requires_grad=True)

    def step(module):
        def run():
            out = module(x, x, x, need_weights=False)[0]
            out.sum().backward()
            x.grad = None
            module.zero_grad(set_to_none=True)
        return run

    (t_ours, iqr_ours), (t_ref, iqr_ref) = time_interleaved([step(ours), step(ref)], args.memory_repeats, args.device)
    peak_ours, peak_ref = peak_during(step(ours)), peak_during(step(ref))
    row = {"variant": "dnas", "s": args.memory_seq, "embed_dim": 512, "heads": 8, "batch": 1,
           "probattn_ms": t_ours, "probattn_iqr_ms": iqr_ours, "reference_ms": t_ref, "reference_iqr_ms": iqr_ref,
           "probattn_peak_bytes": peak_ours, "reference_peak_bytes": peak_ref,
           "time_ratio": t_ours / t_ref, "memory_ratio": peak_ours / peak_ref}
    print(f"memory dnas S={args.memory_seq}: probattn {t_ours:.0f} ms, {peak_ours / 2**20:.0f} MiB; "
          f"pure PyTorch {t_ref:.0f} ms, {peak_ref / 2**20:.0f} MiB", file=sys.stderr)
    return row


def flex(probattn, args):
    """DNAS at each of `--flex-seqs` on CUDA, ours (memory-efficient) against FlexAttention's
    two-call composition, forward + backward; a side that runs out of memory or that Flex's
    compiler refuses is recorded as such, with its message."""
    from probattn_tools.baselines.bench import compiled_flex, cuda_peak_during, dnas_flex, error_line, time_interleaved

    rows = []
    for s in args.flex_seqs:
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 8, s, 64, device=args.device, requires_grad=True) for _ in range(3))

        def step(fn):
            def run():
                fn().sum().backward()
                for t in (q, k, v):
                    t.grad = None
            return run

        sides = {"probattn": step(lambda: probattn.attention(q, k, v, variant="dnas", memory_efficient=True, tile=256)),
                 "flex": step(lambda: dnas_flex(q, k, v, compiled_flex(q.device)))}
        row = {"variant": "dnas", "s": s, "heads": 8, "dim": 64, "batch": 1}
        for name, fn in sides.items():
            try:
                (median, iqr), = time_interleaved([fn], args.memory_repeats, args.device)
                row[name] = {"ms": median, "iqr_ms": iqr, "peak_bytes": cuda_peak_during(fn)}
            except Exception as e:  # out of memory, or Flex's compiler refusing: said, not fatal
                traceback.print_exc(file=sys.stderr)  # the log gets the whole traceback, the record one line
                for t in (q, k, v):
                    t.grad = None
                torch.cuda.empty_cache()
                row[name] = {"error": error_line(e)}
            print(f"flex dnas S={s}: {name} {row[name]}", file=sys.stderr, flush=True)
        if "ms" in row["probattn"] and "ms" in row["flex"]:
            row["time_ratio"] = row["probattn"]["ms"] / row["flex"]["ms"]
            row["memory_ratio"] = row["probattn"]["peak_bytes"] / row["flex"]["peak_bytes"]
        rows.append(row)
    return rows


def sdpa(probattn, args):
    """Softmax through the functional API against PyTorch's SDPA, the same inputs and arguments."""
    import torch.nn.functional as F
    from probattn_tools.baselines.bench import time_interleaved

    rows = []
    for s in args.sdpa_seqs:
        for causal in (False, True):
            torch.manual_seed(0)
            q, k, v = (torch.randn(1, 8, s, 64, device=args.device, requires_grad=True) for _ in range(3))

            def calls(fn):
                def forward():
                    with torch.no_grad():
                        fn(q, k, v, is_causal=causal)

                def forward_backward():
                    fn(q, k, v, is_causal=causal).sum().backward()
                    for t in (q, k, v):
                        t.grad = None
                return forward, forward_backward

            ours, theirs = calls(probattn.functional.scaled_dot_product_attention), calls(F.scaled_dot_product_attention)
            for i, name in enumerate(("forward", "forward_backward")):
                (a, a_iqr), (b, b_iqr) = time_interleaved([ours[i], theirs[i]], args.sdpa_repeats, args.device)
                rows.append({"s": s, "causal": causal, "pass": name, "probattn_ms": a, "probattn_iqr_ms": a_iqr,
                             "sdpa_ms": b, "sdpa_iqr_ms": b_iqr, "ratio": a / b})
                print(f"sdpa S={s:5} causal={causal!s:5} {name:17} probattn {a:7.3f} ms  torch {b:7.3f} ms  "
                      f"ratio {a / b:.3f}", file=sys.stderr)
    return rows


def markdown(result):
    where = "CUDA" if result["settings"].get("device") == "cuda" else "one thread"
    lines = []
    if result.get("overhead"):
        lines += ["Python call against the same call from Rust in one process (B 1, H 8, d 64, S %d, float32, %s; medians over %d rounds of %d calls, every case and side in turn; `sdpa`: PyTorch's own function timed the same two ways):" % (
            result["settings"]["seq"], where, result["settings"]["rounds"],
            result["settings"]["repeats"]), "",
            "| variant | path | pass | Python ms | Rust ms | Python / Rust | Python − Rust µs |", "|---|---|---|---|---|---|---|"]
    for r in result.get("overhead", []):
        lines.append(f"| {r['variant']} | {'memory-efficient' if r['memory_efficient'] else 'eager'} | {r['pass']} | {r['python_ms']:.4f} | {r['rust_ms']:.4f} | {r['ratio']:.3f} | {1e3 * (r['python_ms'] - r['rust_ms']):.1f} |")
    m = result.get("memory")
    if m:
        lines += ["", f"One DNAS layer, E 512, H 8, B 1, S {m['s']}, forward + backward, {where}:", "",
                  "| module | median ms | peak MiB |", "|---|---|---|",
                  f"| probattn.nn.MultiheadAttention (memory-efficient) | {m['probattn_ms']:.0f} | {m['probattn_peak_bytes'] / 2**20:.0f} |",
                  f"| pure PyTorch (probattn_tools.reference.mha) | {m['reference_ms']:.0f} | {m['reference_peak_bytes'] / 2**20:.0f} |",
                  f"| ratio | {m['time_ratio']:.3f} | {m['memory_ratio']:.3f} |"]
    if result.get("flex"):
        lines += ["", "DNAS, B 1, H 8, d 64, forward + backward, CUDA: probattn.attention (memory-efficient, tile 256) against two compiled FlexAttention calls:", "",
                  "| S | probattn ms | Flex ms | probattn / Flex | probattn peak MiB | Flex peak MiB | memory probattn / Flex |", "|---|---|---|---|---|---|---|"]
        cell = lambda side, key, scale: f"{side[key] / scale:.1f}" if key in side else side.get("error", "")[:60]  # noqa: E731
        for r in result["flex"]:
            ratios = f"{r['time_ratio']:.2f} | " if "time_ratio" in r else " | "
            mem = f"{r['memory_ratio']:.2f}" if "memory_ratio" in r else ""
            lines.append(f"| {r['s']} | {cell(r['probattn'], 'ms', 1)} | {cell(r['flex'], 'ms', 1)} | {ratios}"
                         f"{cell(r['probattn'], 'peak_bytes', 2**20)} | {cell(r['flex'], 'peak_bytes', 2**20)} | {mem} |")
        if result.get("flex_warmup_error"):
            lines += ["", f"FlexAttention's warm-up call (S = 128) failed before these: {result['flex_warmup_error']}"]
    if result.get("sdpa"):
        lines += ["", f"Softmax, B 1, H 8, d 64, float32, {where}: probattn.functional.scaled_dot_product_attention against "
                  f"torch's (median of {result['settings']['sdpa_repeats']} interleaved calls each):", "",
                  "| S | mask | pass | probattn ms | torch ms | probattn / torch |", "|---|---|---|---|---|---|"]
        for r in result["sdpa"]:
            lines.append(f"| {r['s']} | {'causal' if r['causal'] else 'none'} | {r['pass']} | {r['probattn_ms']:.3f} | "
                         f"{r['sdpa_ms']:.3f} | {r['ratio']:.3f} |")
    return "\n".join(lines).lstrip("\n") + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overhead", action="store_true", help="run the Python-against-Rust overhead benchmark")
    parser.add_argument("--memory-lib", help="libprobattn_memory.so (skip the memory benchmark without it)")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-seq", type=int, default=4096)
    parser.add_argument("--memory-repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--flex-seqs", default="4096,8192,16384,32768",
                        help="CUDA: lengths of the DNAS-against-FlexAttention comparison (empty to skip)")
    parser.add_argument("--sdpa-seqs", default="16,64,128,256,512",
                        help="lengths of the softmax-against-PyTorch's-SDPA comparison (empty to skip)")
    parser.add_argument("--sdpa-repeats", type=int, default=50)
    parser.add_argument("--skip-memory", action="store_true", help="skip the memory benchmark")
    parser.add_argument("--out", required=True, help="folder for bench.json and bench.md")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: CUDA is not available to this torch")
    settings = vars(args) | {"threads": 1, "torch": torch.__version__}
    args.device = torch.device(args.device)
    args.flex_seqs = [int(x) for x in args.flex_seqs.split(",") if x.strip()]
    args.sdpa_seqs = [int(x) for x in args.sdpa_seqs.split(",") if x.strip()]
    torch.set_num_threads(1)
    import probattn

    result = {"settings": settings, "provenance": git_state()}
    if args.overhead:
        result["overhead"] = overhead(probattn, args)
    if (args.memory_lib or args.device.type == "cuda") and not args.skip_memory:
        result["memory"] = memory(probattn, args)
    if args.device.type == "cuda" and args.flex_seqs:
        result["flex"] = flex(probattn, args)
        from probattn_tools.baselines.bench import FLEX
        if "warmup_error" in FLEX:
            result["flex_warmup_error"] = FLEX["warmup_error"]
    if args.sdpa_seqs:
        result["sdpa"] = sdpa(probattn, args)
    os.makedirs(args.out, exist_ok=True)
    for name, text in (("bench.json", json.dumps(result, indent=2) + "\n"), ("bench.md", markdown(result))):
        write_atomic(os.path.join(args.out, name), text)
    print(markdown(result))


if __name__ == "__main__":
    main()

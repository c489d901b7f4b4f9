"""The PyTorch side of `probattn bench`: forward+backward time of multi-head attention with each
normalizer, in PyTorch eager with the reference implementations (python/probattn_tools/reference/formulas.py), plus
PyTorch's scaled_dot_product_attention as the anchor for softmax. Prints a JSON list of
measurements shaped as bench.json's. `probattn bench` runs it; by hand:

    python -m probattn_tools.baselines.bench --device cpu --seq-lens 64,256 --repeats 3 --threads 2 \
        [--memory-lib target/release/build/probattn-*/out/libprobattn_memory.so]

On CUDA, when DNAS is measured, also DNAS composed from two compiled FlexAttention calls
(`dnas_flex`, impl "pytorch-flex"): what a PyTorch user would write for it without the S × S
matrix. PyTorch 2.11's FlexAttention has no backward on the CPU, so the CPU has no such row.
`--no-eager` leaves out the eager reference rows (they hold the S × S matrices), keeping SDPA and
the FlexAttention composition, for lengths no eager attention fits.

Peak memory: after the timed steps, one more step of each variant, untimed: the peak bytes it
allocated above what was held before it. On CUDA, torch.cuda's allocator statistics; on the CPU,
probattn's counting allocator (probattn-sys/csrc/memory.cpp, built beside the probattn binary), which
`--memory-lib` loads into this process with ctypes, so both sides of `probattn bench` count with
the same code; without it the CPU peak is left out (null).
"""

import argparse
import ctypes
import json
import math
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from probattn_tools.reference import formulas as ref
from probattn_tools.reference import variants as registry

B, H, E = 8, 8, 512


def attention_core(variant, q, k, v):
    """(B, H, S, d) -> (B, H, S, d) with the reference normalizers; BAM samples (training)."""
    if variant == "pytorch-sdpa":
        return F.scaled_dot_product_attention(q, k, v)
    if variant == "pytorch-flex-dnas":
        return dnas_flex(q, k, v, compiled_flex(q.device))
    z = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    allowed = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=q.device).expand_as(z)
    if variant in ref.BAM_VARIANTS:
        noise = torch.rand_like(z) if registry.noise(variant) == "weibull" else torch.randn_like(z)
        prior = BENCH_PRIOR.get(q.device)
        cfg = {"k": 1000.0, "sigma": 1.0, "prior_alpha": 1.0, "prior_beta": 1.0, "prior_mu": 0.0, "prior_sigma": 1.0, "base": "softmax"}
        w, kl = ref.bam_weights(variant, z, allowed, k, noise, True, cfg, prior)
        return w @ v, kl
    logit = HYBRID.get(q.device)
    return ref.normalize(variant, z, allowed, logit) @ v


BENCH_PRIOR, HYBRID = {}, {}


def dnas_flex(q, k, v, flex_attention):
    """DNAS (Ding et al. 2020) from two FlexAttention calls, no S × S matrix: the first, with the
    keys as queries and the queries as keys, returns each key's log-sum-exp over the queries
    (`return_lse`; its output is discarded); the second subtracts it in a `score_mod` before the
    row softmax, softmax_j(z_ij − log Σ_i' exp z_i'j), which is DNAS. FlexAttention differentiates
    through the returned log-sum-exp and the captured tensor, so the backward is DNAS's too.
    `flex_attention` is the function to call: compiled on CUDA, the eager one for a check."""
    _, column_lse = flex_attention(k, q, q, return_lse=True)

    def minus_column_lse(score, b, h, q_idx, kv_idx):
        return score - column_lse[b, h, kv_idx]
    return flex_attention(q, k, v, score_mod=minus_column_lse)


FLEX = {}
# The PyTorch rows that are not the eager reference: (variant, impl) in bench.json.
IMPLS = {"pytorch-sdpa": ("softmax", "pytorch-sdpa"), "pytorch-flex-dnas": ("dnas", "pytorch-flex")}


def error_line(e):
    """An exception as one line for a record: its type and its message's first line."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def compiled_flex(device=None):
    """`torch.compile(flex_attention)`, once per process. On CUDA its first use is a warm-up: DNAS
    forward and backward at S = 128, twice. In four CUDA processes the first compiled composition
    failed at whatever length came first (S = 1,024 or 4,096; the one message kept: `AttributeError:
    'NoneType' object has no attribute '__closure__'`) and every later length ran
    (results/cuda/2026-11-28/); the warm-up takes that first call out of the measured lengths. Its
    failure, if any, is written to stderr with the traceback and kept in FLEX["warmup_error"], and
    the measurements go on."""
    if "fn" not in FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        FLEX["fn"] = torch.compile(flex_attention)
        if device is not None and torch.device(device).type == "cuda":
            try:
                q, k, v = (torch.randn(1, 8, 128, 64, device=device, requires_grad=True) for _ in range(3))
                for _ in range(2):
                    dnas_flex(q, k, v, FLEX["fn"]).sum().backward()
            except Exception as e:  # said with its traceback, not fatal: the measured calls follow
                traceback.print_exc(file=sys.stderr)
                FLEX["warmup_error"] = error_line(e)
                print(f"FlexAttention's warm-up call failed ({FLEX['warmup_error']}); measuring after it", file=sys.stderr, flush=True)
    return FLEX["fn"]


class CpuCounter:
    """probattn's counting CPU allocator (libprobattn_memory.so), installed in this process."""

    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.lib.pa_cpu_memory_stats.argtypes = [ctypes.POINTER(ctypes.c_int64)] * 3
        for name in ("pa_cpu_memory_track", "pa_cpu_memory_stats", "pa_cpu_memory_reset_peak"):
            getattr(self.lib, name).restype = ctypes.c_void_p  # NULL or an error message
        self._check(self.lib.pa_cpu_memory_track(), "installing the counter")

    def _check(self, message, what):
        if message:
            sys.exit(f"error: {what}: {ctypes.string_at(message).decode()}")

    def stats(self):
        current, peak, tracking = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
        self._check(self.lib.pa_cpu_memory_stats(ctypes.byref(current), ctypes.byref(peak), ctypes.byref(tracking)), "reading the counter")
        if not tracking.value:
            sys.exit("error: the counting CPU allocator is not libtorch's CPU allocator in this process")
        return current.value, peak.value

    def peak_during(self, fn):
        self._check(self.lib.pa_cpu_memory_reset_peak(), "resetting the peak")
        before, _ = self.stats()
        fn()
        return self.stats()[1] - before


def cuda_peak_during(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def time_interleaved(fns, repeats, device):
    """Median and IQR (ms) of `repeats` calls of each of `fns` after two warm-up rounds; the calls
    take turns, so drift of a shared machine hits every one alike (as probattn bench does)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    times = [[] for _ in fns]
    for rnd in range(repeats + 2):
        for fn, t in zip(fns, times):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if rnd >= 2:
                t.append(1e3 * (time.perf_counter() - start))
    out = []
    for t in times:
        t.sort()
        q = lambda p: t[min(len(t) - 1, int(round(p * (len(t) - 1))))]  # noqa: E731
        out.append((q(0.5), q(0.75) - q(0.25)))
    return out


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seq-lens", required=True)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--variants", default=",".join(registry.benchmarked()),
                        help="comma-separated variants (default: the registry's benchmarked set)")
    parser.add_argument("--memory-lib", help="probattn's libprobattn_memory.so, to count CPU memory as probattn does")
    parser.add_argument("--batch", type=int, default=B, help="batch size B of the layer")
    parser.add_argument("--precision", choices=["f32", "tf32", "bf16"], default="f32",
                        help="tf32: float32 with CUDA's matrix products in TF32 for the whole run "
                             "(torch.backends.cuda.matmul.allow_tf32); bf16: the forward pass under "
                             "torch.autocast(device, torch.bfloat16), the backward after it")
    parser.add_argument("--no-eager", action="store_true",
                        help="leave out the eager reference rows: SDPA and, on CUDA, FlexAttention's DNAS only")
    return parser.parse_args()


def make_step(variant, x, params, precision):
    """One forward and backward of the layer on x (B, S, E) with `variant`'s attention."""
    b, s, _ = x.shape
    d = E // H

    def forward():
        w_q, w_k, w_v = params["in_proj_weight"].split(E)
        b_q, b_k, b_v = params["in_proj_bias"].split(E)
        split = lambda t: t.view(b, s, H, d).transpose(1, 2)  # noqa: E731
        # F.linear, as nn.Linear: under autocast the bias joins the product in bfloat16.
        q, k, v = split(F.linear(x, w_q, b_q)), split(F.linear(x, w_k, b_k)), split(F.linear(x, w_v, b_v))
        res = attention_core(variant, q, k, v)
        res, kl = res if isinstance(res, tuple) else (res, None)
        ctx = F.linear(res.transpose(1, 2).reshape(b, s, E), params["out_proj.weight"], params["out_proj.bias"])
        return ctx.float().sum() + (kl.float() if kl is not None else 0)

    def step():
        with torch.autocast(x.device.type, torch.bfloat16, enabled=precision == "bf16"):
            loss = forward()
        loss.backward()
    return step


def time_cuda_one_by_one(variants, x, params, args):
    """(median, IQR, peak) per variant on CUDA, one at a time, so one running out of memory leaves the
    others measured; None for one that ran out or that FlexAttention's compiler refused."""
    s, timed = x.shape[1], []
    for variant in variants:
        try:
            step = make_step(variant, x, params, args.precision)
            timed.append((*time_interleaved([step], args.repeats, x.device)[0], cuda_peak_during(step)))
        except torch.cuda.OutOfMemoryError as e:  # left out of the table, said on stderr
            x.grad = None
            torch.cuda.empty_cache()
            timed.append(None)
            print(f"pytorch {variant:12s} S={s:5d}: CUDA out of memory ({str(e).splitlines()[0]})", file=sys.stderr, flush=True)
        except Exception as e:  # FlexAttention's compiler refusing the composition: said, not fatal
            if variant != "pytorch-flex-dnas":
                raise
            x.grad = None
            timed.append(None)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            print(f"pytorch flex dnas S={s:5d}: FlexAttention failed ({type(e).__name__}: {first})", file=sys.stderr, flush=True)
    return timed


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"
    device = torch.device(args.device)
    counter = CpuCounter(args.memory_lib) if args.memory_lib and device.type == "cpu" else None
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True).to(device)
    params = {n: p for n, p in mha.named_parameters()}
    d = E // H
    BENCH_PRIOR[device] = {n: t.to(device).requires_grad_(True) for n, t in {
        "prior.f1.weight": torch.randn(H, 10, d) * math.sqrt(2 / d), "prior.f1.bias": torch.zeros(H, 10),
        "prior.f2.weight": torch.randn(H, 10) * math.sqrt(2 / 10), "prior.f2.bias": torch.zeros(H)}.items()}
    HYBRID[device] = torch.zeros(H, device=device, requires_grad=True)
    out = []
    for s in [int(x) for x in args.seq_lens.split(",")]:
        b = args.batch
        x = torch.randn(b, s, E, device=device, requires_grad=True)
        asked = args.variants.split(",")
        variants = ([] if args.no_eager else asked) + ["pytorch-sdpa"]
        if device.type == "cuda" and "dnas" in asked:
            variants.append("pytorch-flex-dnas")
        if device.type == "cuda":
            timed = time_cuda_one_by_one(variants, x, params, args)
        else:
            steps = [make_step(v, x, params, args.precision) for v in variants]
            timed = [(m, i, counter.peak_during(step) if counter else None)
                     for (m, i), step in zip(time_interleaved(steps, args.repeats, device), steps)]
        for variant, t in zip(variants, timed):
            if t is None:
                continue
            median, iqr, peak = t
            name, impl = IMPLS.get(variant, (variant, "pytorch"))
            out.append({"variant": name, "impl": impl,
                        "device": str(device), "batch": b, "heads": H, "embed": E, "seq_len": s,
                        "fwd_bwd_ms": median, "fwd_bwd_ms_iqr": iqr, "peak_mem_bytes": peak,
                        "precision": args.precision})
            peak_text = "" if peak is None else f", peak {peak / 2**20:8.1f} MiB"
            print(f"pytorch {impl:12s} {name:12s} S={s:5d}: {median:9.1f} ms{peak_text}", file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

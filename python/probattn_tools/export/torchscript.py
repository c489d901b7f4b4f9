"""Export PyTorch modules as TorchScript, with their state dict and example inputs, for
`probattn compare` and the interop tests.

    python -m probattn_tools.export.torchscript mha --embed-dim 16 --heads 4 --out M.pt \\
        [--batch-first] [--method script|trace] [--dtype float32|float64] [--seed 0] \\
        [--state-dict SD.safetensors] [--inputs IN.safetensors --batch 2 --tgt-len 5 --src-len 7 \\
         [--key-padding]] [--time-eager N]

    python -m probattn_tools.export.torchscript transformer --embed-dim 16 --heads 4 --layers 2 --ffn 32 \
        --out T.pt [--inputs IN.safetensors --key-padding ...]

    python -m probattn_tools.export.torchscript probattn-mha --variant dnas --embed-dim 16 --heads 4 --out P.pt ...

    python -m probattn_tools.export.torchscript gat --features 20 --classes 5 --nodes 30 --out G.pt --inputs IN.safetensors

`mha` is a plain `torch.nn.MultiheadAttention(embed_dim, heads, dropout=0, batch_first=...)`,
seeded. IN.safetensors holds its forward arguments by name, in the module's layout: `query`,
`key`, `value` and, with --key-padding, a boolean `key_padding_mask (N, S)` (True = ignored; each
sequence keeps at least one key). The state dict holds the module's parameters under PyTorch's
names. `probattn-mha` is python/probattn_tools/reference/mha.py's drop-in with `--variant softmax|dnas|hnas|
sinkhorn-N|bam-*` (HNAS's gate logits drawn from the seed, so u is not 0.5), same inputs as `mha`;
exported in eval mode, where BAM's weights are its base softmax's.
`transformer` is `torch.nn.Transformer(d_model, nhead, layers, layers, dim_feedforward,
dropout=0, batch_first=...)` (post-norm, ReLU, with its final encoder and decoder norms), scripted
only (tracing it would need keyword inputs); its inputs are `src (S, N, E)`, `tgt (T, N, E)` and,
with --key-padding, `src_key_padding_mask (N, S)` and `tgt_key_padding_mask (N, T)`; it is
called as a sequence-to-sequence model: `tgt_mask` causal, the source mask also the memory's.
`gat` is python/probattn_tools/baselines/gat.py's model (8 heads x 8 features, one output head) with seeded
Glorot weights; its inputs are dense features `x (N, F)` and a random graph with self-loops as
`dst`, `src` (int64 edge lists, messages flow src -> dst). `--time-eager N` prints, as JSON on stdout, the median milliseconds of N eager forward
calls on those inputs (the third column of the speed comparison, same threads as the caller).

    python -m probattn_tools.export.torchscript load-state-dict mha --embed-dim 16 --heads 4 --state-dict SD.safetensors

loads a state dict (one probattn exported, say) into a fresh module with
`load_state_dict(strict=True)` and fails on any missing, unexpected or misshapen name.

    python -m probattn_tools.export.torchscript check-bam

scripts python/probattn_tools/reference/mha.py's module with each BAM variant in float64, in training mode with a
fixed noise draw and random weights (prior included), and prints as JSON, per variant, the
largest absolute difference from python/probattn_tools/reference/formulas.py's `bam_weights` (the reference the Rust
library is tested against) in the weights, the output, the KL term and every gradient of
`sum(output * G) + KL`, and in eval mode the weights against the base softmax.

    python -m probattn_tools.export.torchscript buffers --out M.pt --expected B.safetensors [--method trace]

writes a module with buffers of several kinds (nested BatchNorm1d running statistics after a
training step and its int64 counter, a float64 buffer, a bool mask, a strided view of a larger
tensor, a buffer of a module inside a ModuleList) and its `named_buffers()` as PyTorch lists them,
for the test of `TorchScript::named_buffers`.

    python -m probattn_tools.export.torchscript other-formats --dir DIR

writes what is *not* TorchScript, for the error tests: `DIR/linear.pt2` (torch.export.save of a
Linear) and `DIR/state.pt` (torch.save of a state dict).

PyTorch 2.11 deprecates torch.jit.script and torch.jit.trace (it suggests torch.export, which
libtorch's C++ API cannot load); the deprecation warning is filtered here, and only here.
"""

import argparse
import json
import math
import statistics
import sys
import time
import warnings

import torch
from safetensors.torch import save_file

from probattn_tools.reference import variants as registry

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def mha_inputs(args, dtype):
    g = torch.Generator().manual_seed(args.seed + 1)
    e, n, l, s = args.embed_dim, args.batch, args.tgt_len, args.src_len

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    if args.batch_first:
        inputs = {"query": rand(n, l, e), "key": rand(n, s, e), "value": rand(n, s, e)}
    else:
        inputs = {"query": rand(l, n, e), "key": rand(s, n, e), "value": rand(s, n, e)}
    if args.key_padding:
        lengths = torch.randint(1, s + 1, (n,), generator=g)
        inputs["key_padding_mask"] = torch.arange(s)[None, :] >= lengths[:, None]
    return inputs


def transformer_inputs(args, dtype):
    g = torch.Generator().manual_seed(args.seed + 1)
    e, n, t, s = args.embed_dim, args.batch, args.tgt_len, args.src_len

    def rand(length):
        shape = (n, length, e) if args.batch_first else (length, n, e)
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    inputs = {"src": rand(s), "tgt": rand(t)}
    if args.key_padding:
        for name, length in (("src_key_padding_mask", s), ("tgt_key_padding_mask", t)):
            lengths = torch.randint(1, length + 1, (n,), generator=g)
            inputs[name] = torch.arange(length)[None, :] >= lengths[:, None]
    return inputs


def transformer_call(module, inputs):
    """nn.Transformer called as a seq2seq model: causal target mask, source mask on the memory."""
    t = inputs["tgt"].shape[1 if module.batch_first else 0]
    causal = torch.ones(t, t, dtype=torch.bool).triu(1)
    pad = inputs.get("src_key_padding_mask")
    return lambda: module(inputs["src"], inputs["tgt"], tgt_mask=causal, src_key_padding_mask=pad,
                          tgt_key_padding_mask=inputs.get("tgt_key_padding_mask"), memory_key_padding_mask=pad)


def build(args, dtype):
    torch.manual_seed(args.seed)
    if args.model == "mha":
        module = torch.nn.MultiheadAttention(args.embed_dim, args.heads, dropout=0.0, batch_first=args.batch_first)
    elif args.model == "probattn-mha":
        from probattn_tools.reference.mha import MultiheadAttention

        module = MultiheadAttention(args.embed_dim, args.heads, variant=args.variant, batch_first=args.batch_first)
        if module.hybrid_logit is not None:
            with torch.no_grad():
                module.hybrid_logit.copy_(torch.randn(args.heads))
    elif args.model == "gat":
        from probattn_tools.baselines import gat

        module = gat.Gat(args.features, args.classes, 1)
    else:
        module = torch.nn.Transformer(args.embed_dim, args.heads, args.layers, args.layers, args.ffn, dropout=0.0,
                                      batch_first=args.batch_first)
    return module.to(dtype).eval()


def export(module, example, method, out):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*torch.jit.*deprecated.*")
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        ts = torch.jit.script(module) if method == "script" else torch.jit.trace(module, example)
    ts.save(out)


def median_ms(fn, repeats, warmup_seconds=1.0):
    """Median milliseconds per call of `fn`, after warm-up calls for at least `warmup_seconds`
    (three at the least): the first calls of a fresh process run slow, and counting them would
    flatter whatever PyTorch is compared with."""
    with torch.no_grad():
        start, calls = time.perf_counter(), 0
        while calls < 3 or time.perf_counter() - start < warmup_seconds:
            fn()
            calls += 1
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def other_formats(folder):
    import os

    os.makedirs(folder, exist_ok=True)
    linear = torch.nn.Linear(4, 3)
    torch.export.save(torch.export.export(linear, (torch.randn(2, 4),)), os.path.join(folder, "linear.pt2"))
    torch.save(linear.state_dict(), os.path.join(folder, "state.pt"))


def load_state_dict(argv):
    from safetensors.torch import load_file

    p = argparse.ArgumentParser(prog="python -m probattn_tools.export.torchscript load-state-dict")
    p.add_argument("model", choices=["mha", "transformer"])
    p.add_argument("--embed-dim", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ffn", type=int, default=32)
    p.add_argument("--state-dict", required=True)
    args = p.parse_args(argv)
    state = load_file(args.state_dict)
    dtype = next(iter(state.values())).dtype
    args.batch_first, args.seed = False, 0
    module = build(args, dtype)
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as e:
        sys.exit(f"error: {args.state_dict}: {e}")
    print(f"{args.state_dict}: all {len(state)} tensors loaded (strict)")


class _Buffers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.blocks = torch.nn.ModuleList([torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4)])
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 4, dtype=torch.float64))
        self.register_buffer("keep", torch.tensor([True, False, True, True]))
        self.register_buffer("every_other", torch.arange(12.0).reshape(3, 4)[:, ::2])

    def forward(self, x):
        y = self.bn(self.lin(x)) * self.scale.float() * self.keep.float()
        for block in self.blocks:
            y = block(y)
        return y + self.every_other.sum()


def buffers_module(argv):
    p = argparse.ArgumentParser(prog="python -m probattn_tools.export.torchscript buffers")
    p.add_argument("--out", required=True)
    p.add_argument("--expected", required=True)
    p.add_argument("--method", choices=["script", "trace"], default="script")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    m = _Buffers()
    m.train()
    m(torch.randn(8, 3))  # running statistics move away from their initial values
    m.eval()
    export(m, (torch.randn(2, 3),), args.method, args.out)
    save_file({n: b.contiguous() for n, b in m.named_buffers()}, args.expected)


def check_bam():
    from probattn_tools.reference import formulas as R
    from probattn_tools.reference.mha import MultiheadAttention

    torch.manual_seed(0)
    b, l, s, e, h = 2, 4, 5, 8, 2
    cfg = dict(k=5.0, sigma=0.6, prior_alpha=0.7, prior_beta=1.3, prior_mu=-0.2, prior_sigma=0.8, base="softmax")
    report = {}
    for variant in R.BAM_VARIANTS:
        m = MultiheadAttention(e, h, variant=variant, batch_first=True, bam_k=cfg["k"], bam_sigma=cfg["sigma"],
                               prior_alpha=cfg["prior_alpha"], prior_beta=cfg["prior_beta"], prior_mu=cfg["prior_mu"],
                               prior_sigma=cfg["prior_sigma"], prior_hidden=3).double()
        with torch.no_grad():
            for t in m.parameters():
                t.copy_(torch.randn_like(t))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            warnings.filterwarnings("ignore", message=".*torch.jit.*deprecated.*")
            ts = torch.jit.script(m)
        x, y = torch.randn(b, l, e, dtype=torch.float64), torch.randn(b, s, e, dtype=torch.float64)
        pad = torch.tensor([[False] * s, [False, False, True, True, True]])
        weibull = registry.noise(variant) == "weibull"
        noise = torch.rand(b, h, l, s, dtype=torch.float64) if weibull else torch.randn(b, h, l, s, dtype=torch.float64)
        g = torch.randn(b, l, e, dtype=torch.float64)
        names = [n for n, _ in ts.named_parameters()]

        ts.train()
        out, w = ts(x, y, y, key_padding_mask=pad, average_attn_weights=False, noise=noise)
        kl = ts.kl
        ours_grads = torch.autograd.grad((out * g).sum() + (kl if kl is not None else 0.0), list(ts.parameters()))

        sd = {n: t.detach().clone().requires_grad_() for n, t in m.state_dict().items()}
        w_q, w_k, w_v = sd["in_proj_weight"].split(e)
        b_q, b_k, b_v = sd["in_proj_bias"].split(e)

        def heads(t, weight, bias, n):
            return (t @ weight.T + bias).reshape(b, n, h, e // h).transpose(1, 2)

        q, k, v = heads(x, w_q, b_q, l), heads(y, w_k, b_k, s), heads(y, w_v, b_v, s)
        allowed = R.allowed_mask(b, h, l, s, key_padding_mask=pad)
        z = q @ k.transpose(-2, -1) / math.sqrt(e // h)
        rw, rkl = R.bam_weights(variant, z, allowed, k, noise, True, cfg, prior=sd)
        rout = (rw @ v).transpose(1, 2).reshape(b, l, e) @ sd["out_proj.weight"].T + sd["out_proj.bias"]
        ref_grads = torch.autograd.grad((rout * g).sum() + (rkl if rkl is not None else 0.0), [sd[n] for n in names])

        ts.eval()
        _, w_eval = ts(x, y, y, key_padding_mask=pad, average_attn_weights=False)
        report[variant] = {
            "weights": (w - rw).abs().max().item(),
            "output": (out - rout).abs().max().item(),
            "kl": None if rkl is None else abs(kl.item() - rkl.item()),
            "kl_value": None if kl is None else kl.item(),
            "gradients": {n: (a - r).abs().max().item() for n, a, r in zip(names, ours_grads, ref_grads)},
            "eval_weights_vs_softmax": (w_eval - R.softmax_weights(z, allowed)).abs().max().item(),
            "eval_kl_is_none": ts.kl is None,
            "sampled_differs_from_mean": (w - w_eval).abs().max().item(),
        }
    print(json.dumps(report, indent=1))


def main():
    if sys.argv[1:2] == ["check-bam"]:
        return check_bam()
    if sys.argv[1:2] == ["buffers"]:
        return buffers_module(sys.argv[2:])
    if sys.argv[1:2] == ["load-state-dict"]:
        return load_state_dict(sys.argv[2:])
    if sys.argv[1:2] == ["other-formats"]:
        p = argparse.ArgumentParser(prog="python -m probattn_tools.export.torchscript other-formats")
        p.add_argument("--dir", required=True)
        return other_formats(p.parse_args(sys.argv[2:]).dir)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="model", required=True)
    sub.add_parser("mha", help="torch.nn.MultiheadAttention")
    p = sub.add_parser("probattn-mha", help="python/probattn_tools/reference/mha.py.MultiheadAttention")
    p.add_argument("--variant", default="dnas", help=f"one of the registry's: {registry.names()}")
    p = sub.add_parser("gat", help="python/probattn_tools/baselines/gat.py's Gat (scripted)")
    p.add_argument("--features", type=int, default=20)
    p.add_argument("--classes", type=int, default=5)
    p.add_argument("--nodes", type=int, default=30)
    p.add_argument("--degree", type=int, default=3, help="random in-edges per node, besides its self-loop")
    p = sub.add_parser("transformer", help="torch.nn.Transformer (scripted)")
    p.add_argument("--layers", type=int, default=2, help="encoder and decoder layers")
    p.add_argument("--ffn", type=int, default=32, help="dim_feedforward")
    for name, p in sub.choices.items():
        if name != "gat":
            p.add_argument("--embed-dim", type=int, required=True)
            p.add_argument("--heads", type=int, required=True)
        p.add_argument("--batch-first", action="store_true")
        p.add_argument("--batch", type=int, default=2)
        p.add_argument("--tgt-len", type=int, default=5)
        p.add_argument("--src-len", type=int, default=7)
        p.add_argument("--key-padding", action="store_true")
        p.add_argument("--out", required=True, help="TorchScript file to write")
        p.add_argument("--method", choices=["script", "trace"], default="script")
        p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--state-dict", help="also write the parameters as a safetensors state dict")
        p.add_argument("--inputs", help="also write example forward arguments (safetensors)")
        p.add_argument("--time-eager", type=int, default=0, metavar="N")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    if args.model != "gat" and args.embed_dim % args.heads:
        sys.exit(f"error: --heads {args.heads} does not divide --embed-dim {args.embed_dim}")
    module = build(args, dtype)
    if args.model == "gat":
        g = torch.Generator().manual_seed(args.seed + 1)
        n = args.nodes
        x = torch.randn(n, args.features, generator=g, dtype=torch.float64).to(dtype)
        src = torch.cat([torch.arange(n), torch.randint(0, n, (n * args.degree,), generator=g)])
        dst = torch.cat([torch.arange(n), torch.arange(n).repeat_interleave(args.degree)])
        inputs = {"x": x, "dst": dst, "src": src}
        example, call = (x, dst, src), (lambda: module(x, dst, src))
        if args.method == "trace":
            sys.exit("error: gat is exported with --method script only")
    elif args.model in ("mha", "probattn-mha"):
        inputs = mha_inputs(args, dtype)
        example = tuple(inputs[k] for k in ("query", "key", "value", "key_padding_mask") if k in inputs)
        call = lambda: module(*example)  # noqa: E731
    else:
        if args.method == "trace":
            sys.exit("error: transformer is exported with --method script only")
        inputs = transformer_inputs(args, dtype)
        example, call = None, transformer_call(module, inputs)
    export(module, example, args.method, args.out)
    if args.state_dict:
        save_file({k: v.contiguous() for k, v in module.state_dict().items()}, args.state_dict)
    if args.inputs:
        save_file({k: v.contiguous() for k, v in inputs.items()}, args.inputs)
    if args.time_eager:
        print(json.dumps({"eager_ms": median_ms(call, args.time_eager), "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()

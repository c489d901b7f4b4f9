"""The speed table of PyTorch interop: each model three ways on the same inputs and threads --
probattn's native model, the same weights as TorchScript called from Rust (`probattn compare`),
and PyTorch eager from Python -- median milliseconds per forward call (no gradient).

    python -m probattn_tools.baselines.interop_speed --probattn target/release/probattn --threads 2 --out results/interop

Models (float32, eval mode):
  mha          nn.MultiheadAttention(512, 8), N 16, L = S = 128, key padding; weights returned
               (PyTorch's default need_weights=True, so both sides materialize them)
  transformer  nn.Transformer(256, 4 heads, 3+3 layers, FFN 512), N 16, S = T = 30, padded
  translation  python/probattn_tools/baselines/translate.py's model with the small preset's sizes (3+3 layers,
               E 256, FFN 512, vocabulary 8,000; config from results/translate), N 64, S = T = 30
               token ids; seeded random weights (speed does not depend on training)
  gat          python/probattn_tools/baselines/gat.py's model on Cora's sizes (2,708 nodes, 1,433 dense features, 7
               classes) over a random graph of 13,264 edges with self-loops (Cora has 13,264)
Writes OUT/speed.json and OUT/speed.md; every number comes from this one run.

    python -m probattn_tools.baselines.interop_speed --pt2 --probattn target/release/probattn --threads 1 --out results/interop

`--pt2` compares instead one AOTInductor package (python/probattn_tools/export/pt2.py's export of the same
`mha` and `transformer` modules, compiled here, about a minute each) loaded two ways: from Rust
(`probattn compare --pt2`, libtorch's AOTIModelPackageLoader through probattn's C++ layer) and
from Python (`torch._inductor.aoti_load_package`), with the same input checks on
(AOTI_RUNTIME_CHECK_INPUTS=1, which probattn turns on). Each side times its package call
alternated with its other model (probattn's native model in Rust, PyTorch eager in Python): 3
warm-up calls each, then `--repeats` rounds of one call each, alternating which goes first, the
median reported. Writes OUT/pt2_speed.json and OUT/pt2_speed.md.

The script re-runs itself under the allocator setting the probattn binary uses (`--allocator
retain`: glibc keeps freed memory instead of unmapping it, MALLOC_MMAP_MAX_=0 and an unreachable
MALLOC_TRIM_THRESHOLD_, as src/runtime/allocator.rs gives its own children), so that PyTorch eager is timed
like for like: under glibc's defaults, eager nn.MultiheadAttention took 21 ms in some processes
and 30 ms in others on this machine, by where its large blocks happened to be mapped.
"""

import argparse
import copy
import json
import os
import subprocess
import sys

import torch
from safetensors.torch import save_file

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))  # the checkout
from probattn_tools.export.torchscript import export, median_ms
from probattn_tools.files import atomic_write_json, atomic_write_text
from probattn_tools.tables.common import markdown


def mha(out):
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(512, 8, dropout=0.0).eval()
    n, l, s = 16, 128, 128
    x = {"query": torch.randn(l, n, 512), "key": torch.randn(s, n, 512), "value": torch.randn(s, n, 512)}
    x["key_padding_mask"] = torch.arange(s)[None, :] >= torch.randint(s // 2, s + 1, (n,))[:, None]
    return m, x, lambda: m(x["query"], x["key"], x["value"], key_padding_mask=x["key_padding_mask"]), ["--native", "mha", "--heads", "8"]


def transformer(out):
    torch.manual_seed(0)
    m = torch.nn.Transformer(256, 4, 3, 3, 512, dropout=0.0).eval()
    n, s, t = 16, 30, 30
    x = {"src": torch.randn(s, n, 256), "tgt": torch.randn(t, n, 256)}
    x["src_key_padding_mask"] = torch.arange(s)[None, :] >= torch.randint(s // 2, s + 1, (n,))[:, None]
    x["tgt_key_padding_mask"] = torch.arange(t)[None, :] >= torch.randint(t // 2, t + 1, (n,))[:, None]
    causal = torch.ones(t, t, dtype=torch.bool).triu(1)
    call = lambda: m(x["src"], x["tgt"], tgt_mask=causal, src_key_padding_mask=x["src_key_padding_mask"],  # noqa: E731
                     tgt_key_padding_mask=x["tgt_key_padding_mask"], memory_key_padding_mask=x["src_key_padding_mask"])
    return m, x, call, ["--native", "transformer", "--heads", "4"]


def translation(out):
    from probattn_tools.baselines import translate as baseline

    with open(os.path.join(ROOT, "results", "translate", "multi30k-softmax-seed1", "config.json")) as f:
        cfg = json.load(f)
    torch.manual_seed(0)
    m = baseline.Seq2Seq(cfg).eval()
    n, s, t, v = 64, 30, 30, cfg["model"]["vocab"]
    x = {"src": torch.randint(4, v, (n, s)), "prev": torch.randint(4, v, (n, t))}
    x["prev"][:, 0] = baseline.EOS
    return m, x, lambda: m(x["src"], x["prev"]), ["--native", "translation", "--heads", str(cfg["model"]["transformer"]["heads"])]


def gat(out):
    from probattn_tools.baselines import gat as baseline

    torch.manual_seed(0)
    m = baseline.Gat(1433, 7, 1).eval()
    n = 2708
    g = torch.Generator().manual_seed(1)
    x = {"x": torch.randn(n, 1433, generator=g)}
    x["src"] = torch.cat([torch.arange(n), torch.randint(0, n, (13264 - n,), generator=g)])
    x["dst"] = torch.cat([torch.arange(n), torch.randint(0, n, (13264 - n,), generator=g)])
    return m, x, lambda: m(x["x"], x["dst"], x["src"]), ["--native", "gat"]


RETAIN = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "4611686018427387904", "AOTI_RUNTIME_CHECK_INPUTS": "1"}


def paired_median_ms(a, b, repeats):
    """Median milliseconds per call of `a` and of `b`, as probattn compare times its two sides:
    three warm-up calls each, then `repeats` rounds of one call each, alternating which goes first."""
    import statistics
    import time

    def timed(f):
        start = time.perf_counter()
        f()
        return 1e3 * (time.perf_counter() - start)

    with torch.no_grad():
        for _ in range(3):
            a()
            b()
        ta, tb = [], []
        for r in range(repeats):
            if r % 2 == 0:
                ta.append(timed(a))
                tb.append(timed(b))
            else:
                tb.append(timed(b))
                ta.append(timed(a))
    return statistics.median(ta), statistics.median(tb)


def pt2_rows(args):
    """Each model's package from Rust and from Python, one run."""
    from probattn_tools.export.pt2 import as_seq2seq, compile_package

    rows = []
    for name, build in (("mha", mha), ("transformer", transformer)):
        module, inputs, call, native = build(args.out)
        if name == "mha":
            order = ["query", "key", "value", "key_padding_mask"]
            exported, positional, keywords = module, tuple(inputs[k] for k in order[:3]), {"key_padding_mask": inputs[order[3]]}
        else:
            order = ["src", "tgt", "src_key_padding_mask", "tgt_key_padding_mask"]
            exported = as_seq2seq(copy.deepcopy(module))  # the eager call keeps nn.Transformer's forward
            positional, keywords = (inputs["src"], inputs["tgt"]), {k: inputs[k] for k in order[2:]}
        package, st = os.path.join(args.out, f"{name}.pt2"), os.path.join(args.out, f"{name}.inputs.safetensors")
        with torch.no_grad():
            compile_package(exported, positional, keywords, order, package)
        save_file({k: v.contiguous() for k, v in inputs.items()}, st)
        loaded = torch._inductor.aoti_load_package(package)
        python_ms, eager_ms = paired_median_ms(lambda: loaded(*positional, **keywords), call, args.repeats)
        res = subprocess.run([args.probattn, "compare", "--pt2", package, "--inputs", st, "--json", "--threads", str(args.threads),
                              "--repeats", str(args.repeats)] + native, capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"probattn compare --pt2 failed on {name}: {res.stderr}")
        c = json.loads(res.stdout)
        rows.append({"model": name, "rust_pt2_ms": c["torchscript_ms"], "python_pt2_ms": python_ms, "native_ms": c["native_ms"],
                     "eager_ms": eager_ms, "max_rel_diff": max(o["max_rel_diff"] for o in c["outputs"]), "threads": args.threads})
        for f in (package, st):
            os.remove(f)
        print(f"{name}: package from Rust {c['torchscript_ms']:.3f} ms, from Python {python_ms:.3f} ms", file=sys.stderr)
    write_record(args, "pt2_speed", rows,
                 ["model", ".pt2 from Rust (ms)", ".pt2 from Python (ms)", "Rust / Python", "probattn native (ms)",
                  "PyTorch eager (ms)", "max rel diff (package vs native)"],
                 lambda r: [r["model"], f"{r['rust_pt2_ms']:.3f}", f"{r['python_pt2_ms']:.3f}",
                            f"{r['rust_pt2_ms'] / r['python_pt2_ms']:.3f}", f"{r['native_ms']:.3f}", f"{r['eager_ms']:.3f}",
                            f"{r['max_rel_diff']:.1e}"])


def write_record(args, stem, rows, header, cells):
    """Writes OUT/STEM.json (the rows, with torch's version, threads and repeats) and OUT/STEM.md
    (a markdown table, `cells(row)` giving a row's cells), and prints the table."""
    atomic_write_json(os.path.join(args.out, stem + ".json"),
                      {"torch": torch.__version__, "threads": args.threads, "repeats": args.repeats, "rows": rows})
    table = markdown(header, [cells(r) for r in rows])
    atomic_write_text(os.path.join(args.out, stem + ".md"), table + "\n")
    print(table)


def main():
    if any(os.environ.get(k) != v for k, v in RETAIN.items()):
        os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, **RETAIN})
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probattn", default="target/release/probattn")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", required=True)
    parser.add_argument("--pt2", action="store_true", help="the .pt2 package from Rust and from Python instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    if args.pt2:
        return pt2_rows(args)
    rows = []
    for name, build in (("mha", mha), ("transformer", transformer), ("translation", translation), ("gat", gat)):
        module, inputs, call, native = build(args.out)
        pt, st = os.path.join(args.out, f"{name}.pt"), os.path.join(args.out, f"{name}.inputs.safetensors")
        export(module, None, "script", pt)
        save_file({k: v.contiguous() for k, v in inputs.items()}, st)
        eager = median_ms(call, args.repeats)
        res = subprocess.run([args.probattn, "compare", "--torchscript", pt, "--inputs", st, "--json", "--threads", str(args.threads),
                              "--repeats", str(args.repeats)] + native, capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"probattn compare failed on {name}: {res.stderr}")
        c = json.loads(res.stdout)
        rows.append({"model": name, "native_ms": c["native_ms"], "torchscript_ms": c["torchscript_ms"], "eager_ms": eager,
                     "max_rel_diff": max(o["max_rel_diff"] for o in c["outputs"]), "threads": args.threads})
        os.remove(pt)
        os.remove(st)
        print(f"{name}: native {c['native_ms']:.3f} ms, TorchScript {c['torchscript_ms']:.3f} ms, eager {eager:.3f} ms", file=sys.stderr)
    write_record(args, "speed", rows,
                 ["model", "probattn native (ms)", "TorchScript from Rust (ms)", "PyTorch eager (ms)", "native / TorchScript",
                  "native / eager", "max rel diff"],
                 lambda r: [r["model"], f"{r['native_ms']:.3f}", f"{r['torchscript_ms']:.3f}", f"{r['eager_ms']:.3f}",
                            f"{r['native_ms'] / r['torchscript_ms']:.2f}", f"{r['native_ms'] / r['eager_ms']:.2f}",
                            f"{r['max_rel_diff']:.1e}"])


if __name__ == "__main__":
    main()

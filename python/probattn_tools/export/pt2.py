"""Export PyTorch modules as AOTInductor packages (`.pt2`), with their state dict and example
inputs, for `probattn compare --pt2` and the interop tests.

    python -m probattn_tools.export.pt2 mha --embed-dim 16 --heads 4 --out M.pt2 \\
        [--batch-first] [--dtype float32|float64] [--seed 0] [--device cpu|cuda] \\
        [--state-dict SD.safetensors] [--inputs IN.safetensors --batch 2 --tgt-len 5 --src-len 7 \\
         [--key-padding]] [--time-eager N]

    python -m probattn_tools.export.pt2 transformer --embed-dim 16 --heads 4 --layers 2 --ffn 32 --out T.pt2 ...

    python -m probattn_tools.export.pt2 probattn-mha --variant dnas --embed-dim 16 --heads 4 --out P.pt2 ...

The modules and their inputs are python/probattn_tools/export/torchscript.py's (same seeds, same names), so a
`.pt2` and a TorchScript file made with the same flags hold the same weights. Each is exported
with `torch.export.export` on the example inputs and compiled with
`torch._inductor.aoti_compile_and_package` (a C++ compiler runs: about 35 s for a small module on
a 2-core CPU). The exported program takes its inputs in the order it was called with:

- `mha` / `probattn-mha`: `query, key, value` and, with --key-padding, `key_padding_mask` (passed
  as a keyword, as PyTorch users call it); outputs `(attn_output, attn_weights)` (weights averaged
  over heads, as `nn.MultiheadAttention` returns them).
- `transformer`: `src, tgt` and, with --key-padding, `src_key_padding_mask, tgt_key_padding_mask`;
  called as a sequence-to-sequence model (causal target mask built inside, the source mask also
  the memory's), output `(T, N, E)`.

The shapes are fixed at export (no dynamic dimensions): the package runs on inputs of the example's
shapes, and `probattn compare --pt2` reads them from the --inputs file. `--device cuda` compiles for
the GPU (it needs one where it is compiled); such a package refuses to load on a CPU-only machine.

`--outputs OUT.safetensors` also writes the eager module's outputs on the example inputs
(`output`, and `weights` for attention), the reference the package is tested against.

    python -m probattn_tools.export.pt2 retarget --package M.pt2 [--device-key cuda] [--drop-inputs] --out M2.pt2

writes, for the error tests, a copy of a package with its metadata changed: `--device-key` says
it was compiled for another device (`AOTI_DEVICE_KEY`), as a package compiled on a GPU says
`cuda` (with no GPU at hand to compile one, this is how a CPU-only test meets a CUDA package);
`--drop-inputs` removes the input names this script records, as a package made elsewhere lacks
them, so that only the compiled model's own checks stand between a wrong input and the kernels.

    python -m probattn_tools.export.pt2 time --package M.pt2 --inputs IN.safetensors --order query,key,value \
        [--repeats N] [--device cpu]

loads a package with `torch._inductor.aoti_load_package` and prints, as JSON, the median
milliseconds per call on the inputs (after a second of warm-up calls) and the load time: the
Python side of the interop speed comparison (python/probattn_tools/baselines/interop_speed.py --pt2).
"""

import argparse
import json
import os
import shutil
import sys
import time

import torch
from safetensors.torch import load_file, save_file

from probattn_tools.export import torchscript as ets  # the same modules and inputs
from probattn_tools.reference import variants as registry


class _Seq2Seq(torch.nn.Transformer):
    """nn.Transformer called as a sequence-to-sequence model, with the causal mask built inside.
    A subclass rather than a wrapper, so its weights keep nn.Transformer's state_dict names.

    Two of nn.Transformer's eval-mode shortcuts look at the data, which torch.export cannot
    trace: the encoder's nested-tensor path (it inspects the padding mask) is turned off, and the
    target mask is declared causal (`tgt_is_causal=True`) instead of being compared with a causal
    mask at run time. Neither changes what is computed."""

    def forward(self, src, tgt, src_key_padding_mask=None, tgt_key_padding_mask=None):
        t = tgt.shape[1 if self.batch_first else 0]
        causal = torch.ones(t, t, dtype=torch.bool, device=tgt.device).triu(1)
        return super().forward(src, tgt, tgt_mask=causal, tgt_is_causal=True, src_key_padding_mask=src_key_padding_mask,
                               tgt_key_padding_mask=tgt_key_padding_mask, memory_key_padding_mask=src_key_padding_mask)


def as_seq2seq(module):
    """The nn.Transformer `module` (its weights untouched) as a _Seq2Seq."""
    module.__class__ = _Seq2Seq
    module.encoder.enable_nested_tensor = False
    return module.eval()


def example_call(args, module, inputs):
    """(module to export, positional args, keyword args, every input's name), in the order the
    package takes them."""
    if args.model in ("mha", "probattn-mha"):
        positional = tuple(inputs[k] for k in ("query", "key", "value"))
        keywords = {"key_padding_mask": inputs["key_padding_mask"]} if "key_padding_mask" in inputs else {}
        return module, positional, keywords, ["query", "key", "value"] + list(keywords)
    positional = (inputs["src"], inputs["tgt"])
    keywords = {k: inputs[k] for k in ("src_key_padding_mask", "tgt_key_padding_mask") if k in inputs}
    return as_seq2seq(module), positional, keywords, ["src", "tgt"] + list(keywords)


DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.bool: "bool", torch.int64: "int64"}


def compile_package(module, positional, keywords, names, out):
    """torch.export + AOTInductor, written to `out` through a temporary folder (no half-written
    package is left if the compiler fails). The inputs' names, dtypes and shapes go into the
    package's metadata under `probattn.inputs`, where probattn checks them before a call."""
    program = torch.export.export(module, positional, keywords)
    example = list(positional) + list(keywords.values())
    specs = [{"name": n, "dtype": DTYPE_NAMES.get(t.dtype, str(t.dtype)), "shape": list(t.shape)} for n, t in zip(names, example)]
    folder = os.path.join(os.path.dirname(os.path.abspath(out)), f".{os.path.basename(out)}.partial")
    os.makedirs(folder, exist_ok=True)
    partial = os.path.join(folder, os.path.basename(out))  # the archive's root folder is named after the file
    try:
        torch._inductor.aoti_compile_and_package(
            program, package_path=partial, inductor_configs={"aot_inductor.metadata": {"probattn.inputs": json.dumps(specs)}})
        os.replace(partial, out)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def time_package(argv):
    p = argparse.ArgumentParser(prog="python -m probattn_tools.export.pt2 time")
    p.add_argument("--package", required=True)
    p.add_argument("--inputs", required=True, help="safetensors with the inputs, in the package's order")
    p.add_argument("--order", required=True, help="comma-separated input names, in the package's order")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    tensors = load_file(args.inputs)
    xs = [tensors[n].to(args.device) for n in args.order.split(",")]
    start = time.perf_counter()
    package = torch._inductor.aoti_load_package(args.package)
    load_ms = 1e3 * (time.perf_counter() - start)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def call():
        package(*xs)
        sync()

    print(json.dumps({"call_ms": ets.median_ms(call, args.repeats), "load_ms": load_ms,
                      "threads": torch.get_num_threads()}))


def retarget(argv):
    import zipfile

    p = argparse.ArgumentParser(prog="python -m probattn_tools.export.pt2 retarget")
    p.add_argument("--package", required=True)
    p.add_argument("--device-key")
    p.add_argument("--drop-inputs", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    with zipfile.ZipFile(args.package) as src, zipfile.ZipFile(args.out, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("_metadata.json"):
                meta = json.loads(data)
                if args.device_key:
                    meta["AOTI_DEVICE_KEY"] = args.device_key
                if args.drop_inputs:
                    meta.pop("probattn.inputs", None)
                data = json.dumps(meta).encode()
            dst.writestr(item, data)


def main():
    if sys.argv[1:2] == ["time"]:
        return time_package(sys.argv[2:])
    if sys.argv[1:2] == ["retarget"]:
        return retarget(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="model", required=True)
    sub.add_parser("mha", help="torch.nn.MultiheadAttention")
    p = sub.add_parser("probattn-mha", help="python/probattn_tools/reference/mha.py.MultiheadAttention")
    p.add_argument("--variant", default="dnas", help=f"one of the registry's: {registry.names()}")
    p = sub.add_parser("transformer", help="torch.nn.Transformer as a seq2seq model")
    p.add_argument("--layers", type=int, default=2, help="encoder and decoder layers")
    p.add_argument("--ffn", type=int, default=32, help="dim_feedforward")
    for p in sub.choices.values():
        p.add_argument("--embed-dim", type=int, required=True)
        p.add_argument("--heads", type=int, required=True)
        p.add_argument("--batch-first", action="store_true")
        p.add_argument("--batch", type=int, default=2)
        p.add_argument("--tgt-len", type=int, default=5)
        p.add_argument("--src-len", type=int, default=7)
        p.add_argument("--key-padding", action="store_true")
        p.add_argument("--out", required=True, help=".pt2 package to write")
        p.add_argument("--dtype", choices=sorted(ets.DTYPES), default="float32")
        p.add_argument("--device", default="cpu", help="cpu or cuda: the device the package is compiled for")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--state-dict", help="also write the parameters as a safetensors state dict")
        p.add_argument("--inputs", help="also write the example inputs (safetensors, by argument name)")
        p.add_argument("--outputs", help="also write the eager module's outputs on them (safetensors)")
        p.add_argument("--time-eager", type=int, default=0, metavar="N")
    args = parser.parse_args()
    if args.embed_dim % args.heads:
        sys.exit(f"error: --heads {args.heads} does not divide --embed-dim {args.embed_dim}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("error: --device cuda needs a GPU where the package is compiled")
    dtype = ets.DTYPES[args.dtype]
    module = ets.build(args, dtype)
    inputs = ets.mha_inputs(args, dtype) if args.model != "transformer" else ets.transformer_inputs(args, dtype)
    module = module.to(args.device)
    on_device = {k: v.to(args.device) for k, v in inputs.items()}
    exported, positional, keywords, names = example_call(args, module, on_device)
    with torch.no_grad():
        compile_package(exported, positional, keywords, names, args.out)
    if args.state_dict:
        save_file({k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}, args.state_dict)
    if args.inputs:
        save_file({k: v.contiguous() for k, v in inputs.items()}, args.inputs)
    if args.outputs:
        with torch.no_grad():
            out = exported(*positional, **keywords)
        out = out if isinstance(out, tuple) else (out,)
        save_file({n: t.detach().cpu().contiguous() for n, t in zip(("output", "weights"), out) if t is not None}, args.outputs)
    if args.time_eager:
        call = lambda: exported(*positional, **keywords)  # noqa: E731
        print(json.dumps({"eager_ms": ets.median_ms(call, args.time_eager), "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()

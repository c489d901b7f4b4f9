"""What PyTorch's `scaled_dot_product_attention` gives a query that no key may attend, backend by
backend: the check that decides whether probattn's softmax may take SDPA's kernels on a device
under masks that can empty a row. probattn's own answer for such a row is a zero output and zero
gradients (docs/formulas.md); SDPA's CPU kernel in torch 2.11 gives the same. On CUDA (an H200,
results/cuda/2026-11-29/) the math and memory-efficient kernels give the same too, but cuDNN's,
which SDPA may choose in bfloat16 and float16, gives a nonzero output and gradient under a
boolean mask, so probattn keeps the eager form on CUDA under masks that can empty a row.

For each backend SDPA has (the math fallback, FlashAttention's, the memory-efficient kernel,
cuDNN's, each forced with `torch.nn.attention.sdpa_kernel`; one the device lacks, or that takes no
mask, as CUDA's FlashAttention, is recorded with its refusal),
each floating dtype and each way of emptying a row (a boolean mask whose row is all False, an
additive mask whose row is all -inf, a boolean key padding broadcast over the queries that pads
every key of one batch), it runs forward and backward on B 2, H 2, L 5, S 7, d 8 and records:
whether the backend ran at all (its refusal, named), whether the empty row's output is exactly 0,
NaN or something else, whether any gradient holds NaN, and whether the empty row's query gradient
is exactly 0; and the largest difference of the other rows from the math backend in float64.

    python -m probattn_tools.baselines.sdpa_empty_rows --device cuda --out results/cuda/DATE/sdpa-empty-rows

Writes OUT/empty_rows.json (with the torch version and the device) and prints a table.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from probattn_tools.files import atomic_write_text

BACKENDS = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
B, H, L, S, D = 2, 2, 5, 7, 8
EMPTY_ROW = 3  # the query of batch 0 that no key may attend (all of batch 1's for the padding mask)


def masks(device, dtype):
    """{name: (attn_mask, the (batch, query) entries it leaves without keys)}."""
    allowed = torch.ones(B, 1, L, S, dtype=torch.bool, device=device)
    allowed[:, :, :, 0] = False
    allowed[0, :, EMPTY_ROW, :] = False
    additive = torch.zeros(B, 1, L, S, dtype=dtype, device=device)
    additive[0, :, EMPTY_ROW, :] = float("-inf")
    padding = torch.ones(B, 1, 1, S, dtype=torch.bool, device=device)
    padding[1] = False
    return {"boolean row": (allowed, [(0, EMPTY_ROW)]),
            "additive -inf row": (additive, [(0, EMPTY_ROW)]),
            "key padding of a whole batch": (padding, [(1, i) for i in range(L)])}


def run(backend, q, k, v, mask, grad):
    """(output, dq, dk, dv) under `backend`, or the refusal's message."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    try:
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            out.backward(grad)
    except RuntimeError as e:  # a backend that does not take these inputs says so
        return str(e).strip().splitlines()[0][:200]
    return out.detach(), q.grad, k.grad, v.grad


def row_state(t):
    if torch.isnan(t).any():
        return "nan"
    return "zero" if (t == 0).all() else "nonzero"


def check(device, dtypes):
    rows = []
    torch.manual_seed(0)
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        base = [torch.randn(B, H, n, D, dtype=torch.float64, device=device) for n in (L, S, S)]
        grad64 = torch.randn(B, H, L, D, dtype=torch.float64, device=device)
        for mask_name, (mask64, empty) in masks(device, torch.float64).items():
            mask = mask64.to(dtype) if mask64.is_floating_point() else mask64
            reference = run(SDPBackend.MATH, *base, mask64, grad64)
            keep = torch.ones(B, L, dtype=torch.bool, device=device)
            for b, i in empty:
                keep[b, i] = False
            for backend_name, backend in BACKENDS.items():
                row = {"dtype": dtype_name, "mask": mask_name, "backend": backend_name}
                got = run(backend, *(t.to(dtype) for t in base), mask, grad64.to(dtype))
                if isinstance(got, str):
                    row["refused"] = got
                else:
                    out, dq, dk, dv = got
                    row["empty_output"] = "; ".join(sorted({row_state(out[b, :, i]) for b, i in empty}))
                    row["empty_dq"] = "; ".join(sorted({row_state(dq[b, :, i]) for b, i in empty}))
                    row["any_grad_nan"] = bool(any(torch.isnan(g).any() for g in (dq, dk, dv)))
                    if not isinstance(reference, str):
                        other = keep[:, None, :, None].expand_as(out)
                        row["other_rows_max_diff"] = float((out.double() - reference[0])[other].abs().max())
                rows.append(row)
                print(f"{dtype_name:9} {mask_name:29} {backend_name:9} " + (
                    f"refused: {row['refused'][:60]}" if "refused" in row else
                    f"empty row: output {row['empty_output']}, dq {row['empty_dq']}, NaN in a gradient "
                    f"{row['any_grad_nan']}, other rows off by {row.get('other_rows_max_diff', float('nan')):.1e}"),
                    flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16,float64", help="comma-separated")
    parser.add_argument("--out", help="folder for empty_rows.json (none: print only)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("sdpa_empty_rows: --device cuda, but this torch sees no CUDA device")
    unknown = [d for d in args.dtypes.split(",") if d not in DTYPES]
    if unknown:
        sys.exit(f"sdpa_empty_rows: unknown dtypes {unknown} (known: {', '.join(DTYPES)})")
    device = torch.device(args.device)
    rows = check(device, args.dtypes.split(","))
    if args.out:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        record = {"torch": torch.__version__, "device": name, "shape": [B, H, L, S, D], "rows": rows}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(args.out) / "empty_rows.json", json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

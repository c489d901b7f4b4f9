"""PyTorch's side of the Transformer step's memory (results/bench/precision/transformer-step-memory/).

The stack `probattn bench` trains in its SVGD row, built from torch.nn: 6+6 post-norm layers,
E 512, 4 heads, FFN 1024, dropout 0.3, attention dropout 0, no final norms; 32 × 32 random source
and target embeddings; one Adam step (β 0.9/0.98, ε 1e-8, weight decay 1e-4) on the mean square
of the output, as probattn's. After two warm-up steps, one more step's peak above its start is
counted by probattn's counting CPU allocator (libprobattn_memory.so, the one `probattn bench`
uses), in float32 and under torch.autocast("cpu", torch.bfloat16).

    python -m probattn_tools.baselines.step_memory --memory-lib PATH [--threads 1] [--out FILE.json]
"""

import argparse
import json
import sys

import torch

from probattn_tools.baselines.bench import CpuCounter
from probattn_tools.files import atomic_write_json


def stack():
    model = torch.nn.Transformer(
        d_model=512, nhead=4, num_encoder_layers=6, num_decoder_layers=6, dim_feedforward=1024, dropout=0.3, batch_first=True
    )
    model.encoder.norm = None  # probattn's preset has no final norms (final_norm: false)
    model.decoder.norm = None
    for module in model.modules():
        if isinstance(module, torch.nn.MultiheadAttention):
            module.dropout = 0.0  # attention dropout 0, as probattn's preset
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-lib", required=True, help="libprobattn_memory.so, from probattn's build (target/release/build/probattn-sys-*/out/)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="write the peaks here as JSON")
    args = parser.parse_args(argv)
    counter = CpuCounter(args.memory_lib)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = stack()
    adam = torch.optim.Adam(model.parameters(), lr=5e-4, betas=(0.9, 0.98), eps=1e-8, weight_decay=1e-4)
    src, tgt = torch.randn(32, 32, 512), torch.randn(32, 32, 512)

    def step(bf16):
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            out = model(src, tgt)
        adam.zero_grad(set_to_none=False)
        out.float().square().mean().backward()
        adam.step()

    peaks = {}
    for name, bf16 in (("f32", False), ("bf16", True)):
        for _ in range(2):
            step(bf16)
        peaks[name] = counter.peak_during(lambda: step(bf16))
        print(f"{name}: a step peaks {peaks[name] / 2**20:.1f} MiB above its start", file=sys.stderr)
    record = {"step_peak_bytes": peaks, "threads": args.threads, "torch": torch.__version__}
    if args.out:
        atomic_write_json(args.out, record, indent=2)
    print(json.dumps(record))


if __name__ == "__main__":
    main()

"""What a backward pass started from Python costs the next forward call: the forward call alone
(under no_grad), timed in a loop where nothing else runs, and the same call timed where each one
follows a forward + backward pass from Python (`.sum().backward()`), as in training. PyTorch's own
`scaled_dot_product_attention` beside probattn's softmax and DNAS through the functional API; B 1,
H 8, d 64, float32, one thread. Cases and modes take turns, `--rounds` rounds of `--repeats`
calls; each number is the median over rounds of each round's median, in µs.

    PYTHONPATH=<package folder> python python/probattn/benchmarks/after_backward.py [--seq 16]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import probattn

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, args.seq, 64) for _ in range(3))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    calls = {"torch sdpa": F.scaled_dot_product_attention,
             "probattn softmax": lambda q, k, v: probattn.attention(q, k, v),
             "probattn dnas": lambda q, k, v: probattn.attention(q, k, v, variant="dnas")}

    def round_median(call, backward):
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            with torch.no_grad():
                call(q, k, v)
            times.append(time.perf_counter() - start)
            if backward:
                call(qg, kg, vg).sum().backward()
                for t in (qg, kg, vg):
                    t.grad.zero_()
        return 1e6 * statistics.median(times)

    rounds = {(name, b): [] for name in calls for b in (False, True)}
    for _ in range(args.rounds):
        for name, call in calls.items():
            for backward in (False, True):
                rounds[(name, backward)].append(round_median(call, backward))
    print(f"| call (S = {args.seq}) | forward alone µs | forward after a backward µs | difference µs |")
    print("|---|---|---|---|")
    for name in calls:
        a, b = statistics.median(rounds[(name, False)]), statistics.median(rounds[(name, True)])
        print(f"| {name} | {a:.1f} | {b:.1f} | {b - a:+.1f} |")


if __name__ == "__main__":
    main()

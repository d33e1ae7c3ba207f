"""What reading a logits row costs against computing it, at a real vocabulary and several widths.

    .venv/bin/python scripts/head_vs_normalisation.py [--vocab 151936] [--hidden 256,1024,4096] [--rows 32]

A decoder that reads a row needs its argmax (``row_argmax``) and, for a probability, its log-sum-exp
(``row_logsumexp``): one pass over the vocabulary each, whatever the model's width. Computing the row
(the output head, ``hidden x vocab`` multiply-adds) grows with the width. For each hidden size this
times, on ``--rows`` rows, the head's matrix product, ``row_argmax`` and ``row_logsumexp`` (median of
``--repeats`` after one warm-up) and prints the reading's share of head + reading. The tiny models are
256 wide; Qwen3-0.6B is 1,024, an 8B model 4,096. One torch thread, float32, on the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from refusion.core.probs import row_argmax, row_logsumexp


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", default="256,1024,4096")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    print(f"| hidden | head ms | row_argmax ms | row_logsumexp ms | reading's share |\n|---|---|---|---|---|")
    for hidden in map(int, a.hidden.split(",")):
        weight = torch.randn(a.vocab, hidden, generator=g) / hidden ** 0.5  # [V, H]
        states = torch.randn(a.rows, hidden, generator=g)  # [R, H]
        logits = states @ weight.T  # [R, V]
        head = median_ms(lambda: states @ weight.T, a.repeats)
        argmax = median_ms(lambda: row_argmax(logits), a.repeats)
        lse = median_ms(lambda: row_logsumexp(logits), a.repeats)
        share = (argmax + lse) / (head + argmax + lse)
        print(f"| {hidden} | {head:.2f} | {argmax:.2f} | {lse:.2f} | {100 * share:.1f}% |", flush=True)
        del weight


if __name__ == "__main__":
    main()

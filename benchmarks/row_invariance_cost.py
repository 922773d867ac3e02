"""What row-invariant norms and attention rows cost: plain decoding and the block-cost curve, before and after, in one
run.

0.18.0 made every op of the exact route row-invariant by construction (`backends/numerics.py`): norms reduce
chunks of exactly 16 rows, and attention takes each query row as a contiguous copy. Before, a norm reduced the
whole block and attention read a strided view of the row, which CUDA rounded apart from the row alone. This
benchmark times, on the same backend and the same weights, interleaved: plain one-token decoding and scoring
blocks of 1..16 tokens, with the ops as they are ("after") and as 0.17.0 ran them ("before": the backend's norm
swapped back, the row copy skipped). The last line of stdout is one JSON document.

    python benchmarks/row_invariance_cost.py --dtypes fp32 bf16
    python benchmarks/row_invariance_cost.py --device cuda --dtypes bf16 --shape qwen2.5-1.5b
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import draftlab.backends.attention as attention
from draftlab.backends import FastLlamaBackend
from draftlab.backends.numerics import rms_norm
from draftlab.backends.routes import cpu_flags
from draftlab.checks.exactness import DTYPES, random_model, shapes_named
from draftlab.decoding.step import Block

PROMPT = [(31 * i + 7) % 4096 for i in range(64)]


def timed(backend: FastLlamaBackend, n: int, device: str) -> float:
    """Seconds to score a block of n tokens after the prompt (rolled back after)."""
    backend.rollback(len(PROMPT))
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    backend.score_block(Block.chain(PROMPT[:n]))
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def measure(backend: FastLlamaBackend, device: str, rounds: int) -> dict[str, dict[int, float]]:
    """Median seconds per block size, before and after, the two interleaved in every round."""
    ops = {"after": (backend._norm, attention.attention_row),  # noqa: SLF001 (the ops under test)
           "before": (rms_norm, lambda query: query)}
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in range(1, 17)} for name in ops}
    backend.reset()
    backend.score(PROMPT, last_only=True)
    for r in range(rounds + 1):
        for name in (list(ops) if r % 2 else list(ops)[::-1]):
            backend._norm, attention.attention_row = ops[name]  # noqa: SLF001
            for n in range(1, 17):
                seconds = timed(backend, n, device)
                if r:  # the first round warms up
                    times[name][n].append(seconds)
    backend._norm, attention.attention_row = ops["after"]  # noqa: SLF001
    return {name: {n: statistics.median(v) for n, v in sizes.items()} for name, sizes in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m", help="random weights in this model's shape (every layer)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    flags = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))))
    print(f"{args.shape} (random weights, every layer) on {args.device}; host CPU flags: {flags}; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads")
    shape, results = shapes_named([args.shape])[0], {}
    for dtype in args.dtypes:
        backend = FastLlamaBackend(random_model(shape, DTYPES[dtype], args.device, layers=shape.depth), args.device,
                                   capacity=256)
        curve = measure(backend, args.device, args.rounds)
        results[dtype] = {"route": backend.numerics, **curve}
        for name in ("before", "after"):
            ratios = " ".join(f"{curve[name][n] / curve[name][1]:.2f}" for n in (2, 4, 8, 16))
            print(f"{dtype} {backend.numerics} {name:>6}: one token {1000 * curve[name][1]:.2f} ms "
                  f"({1 / curve[name][1]:.1f} tok/s); blocks of 2/4/8/16 cost {ratios} x one token")
        print(f"{dtype}: after / before, one token {curve['after'][1] / curve['before'][1]:.3f}x, block of 8 "
              f"{curve['after'][8] / curve['before'][8]:.3f}x, of 16 {curve['after'][16] / curve['before'][16]:.3f}x")
    print(json.dumps({"shape": args.shape, "device": args.device, "host_flags": flags, "results": results}))


if __name__ == "__main__":
    main()

"""What a draft's passes cost in each dtype: one token, a short catch-up block, a prompt prefill.

A draft's rounding never reaches the output, so it may run in another dtype than its target
(`model:NAME@bf16`). This times the passes a model draft makes while drafting, in the fast backend
(not batch-invariant, as drafts run), per dtype, in interleaved rounds (the machine's drift hits
every dtype alike), and for bf16/fp16 on CPUs without native support also with the prefill's
upcast products turned off (`UpcastLinear` vs plain `F.linear`). It prints medians in ms and the
ratio to the first dtype, then the command that reproduces them.

    python benchmarks/draft_dtype.py --model qwen2.5-coder-0.5b --dtypes fp32 bf16
    python benchmarks/draft_dtype.py --model smollm2-135m --dtypes fp32 bf16 --prompt-tokens 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from draftlab.backends import FastLlamaBackend
from draftlab.models import load_model

PASSES = {"1 token": 1, "2-token catch-up": 2, "3-token block": 3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--prompt-tokens", type=int, default=120, help="length of the prefill timed")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    backends = build_backends(args.model, args.dtypes)
    prompt = list(range(1000, 1000 + args.prompt_tokens))
    timings: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for name, backend in backends.items():
            for label, seconds in time_passes(backend, prompt).items():
                timings.setdefault((name, label), []).append(seconds)
    print(f"model={args.model} threads={torch.get_num_threads()} prompt={args.prompt_tokens} tokens, "
          f"median of {args.rounds} interleaved rounds, ms (ratio to {next(iter(backends))})")
    labels = [*PASSES, f"{args.prompt_tokens}-token prefill"]
    first = next(iter(backends))
    print(f"{'draft':<22}" + "".join(f"{label:>26}" for label in labels))
    for name in backends:
        cells = []
        for label in labels:
            ms = 1000 * statistics.median(timings[(name, label)])
            ratio = ms / (1000 * statistics.median(timings[(first, label)]))
            cells.append(f"{ms:>16.1f} ({ratio:.2f}x)")
        print(f"{name:<22}" + "".join(f"{c:>26}" for c in cells))
    print("reproduce: python " + " ".join(sys.argv))


def build_backends(model: str, dtypes: list[str]) -> dict:
    """One draft backend per dtype; emulated low precision also without its upcast prefill products."""
    backends = {}
    for dtype in dtypes:
        loaded = load_model(model, dtype=dtype)
        backend = FastLlamaBackend(loaded.model, batch_invariant=False)
        backends[dtype] = backend
        if backend.upcast:
            backends[f"{dtype} (no upcast)"] = FastLlamaBackend(loaded.model, batch_invariant=False, upcast=False)
    return backends


def time_passes(backend, prompt: list[int]) -> dict[str, float]:
    """Seconds of a prefill of `prompt`, then of each pass in PASSES after it (rolled back after each)."""
    backend.reset()
    start = time.perf_counter()
    backend.score(prompt, last_only=True)
    out = {f"{len(prompt)}-token prefill": time.perf_counter() - start}
    for label, n in PASSES.items():
        start = time.perf_counter()
        backend.score(prompt[:n], last_only=True)
        out[label] = time.perf_counter() - start
        backend.rollback(len(prompt))
    return out


if __name__ == "__main__":
    main()

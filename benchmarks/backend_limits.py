"""How close the fast backend runs to the machine's limits, per dtype, in one run.

Prints, for each dtype (and for the fast backend with and without batch-invariant
scoring):
- the weight bytes read per token and the measured read bandwidth, hence the
  bandwidth limit on plain decoding (tok/s);
- autoregressive decoding tok/s and its share of that limit;
- the block-cost curve: scoring 1..16 tokens in one pass, relative to one token
  (the number the throughput model and the choice of K depend on), with block
  products taken by `F.linear` ("linear") and as weight @ x^T ("weight-major",
  the fast backend's default for fp32 on CPUs);
- the share of block rows bitwise identical to scoring their token alone;
- llama.cpp plain decoding of the GGUF files given with --llama-gguf (for the
  issue's comparison: F32 and F16 conversions of the target), when
  llama-cpp-python is installed (a benchmark-only extra, not in CI).

Timings are medians of interleaved rounds, so drift hits every block size alike.

    python benchmarks/backend_limits.py --dtypes fp32 bf16 --tokens 48
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from draftlab.backends import FastLlamaBackend
from draftlab.models import auto_dtype, load_model
from draftlab.step import Block

PROMPT = [1, 504, 3458, 282, 4125, 28, 357, 253, 2641, 30, 378, 1028, 314, 253, 1789, 2295] * 4  # 64 tokens


@dataclass
class Mode:
    """One way of running the target: a dtype, whether block scoring is batch-invariant, its row chunk, and
    whether blocks' products are weight-major."""

    dtype: str
    invariant: bool
    rows: int | None = None  # invariant products' row chunk (None: the backend's choice for this hardware)
    weight_major: bool = False

    @property
    def label(self) -> str:
        if self.invariant:
            return f"{self.dtype} invariant/{self.rows}"
        return f"{self.dtype} {'weight-major' if self.weight_major else 'linear'}"


def read_bandwidth(gib: float = 0.5, repeats: int = 5) -> float:
    """Bytes per second this machine reads, from summing a large fp32 tensor."""
    data = torch.ones(int(gib * 2**30) // 4)
    data.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / min(times)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights read to decode one token: every parameter once, except the embedding table's other rows."""
    seen: dict[int, torch.Tensor] = {p.data_ptr(): p for p in model.parameters()}
    embed = model.get_input_embeddings().weight
    tied = embed.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    total = sum(p.numel() * p.element_size() for p in seen.values())
    return total if tied else total - embed.numel() * embed.element_size()


def decode_seconds(backend: FastLlamaBackend, tokens: int) -> float:
    """Median seconds per token of plain one-token decoding after the prompt."""
    backend.reset()
    backend.score(PROMPT)
    times = []
    token = PROMPT[-1]
    for _ in range(tokens):
        start = time.perf_counter()
        token = int(backend.score([token], last_only=True)[0].argmax())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def block_curve(backend: FastLlamaBackend, sizes: list[int], rounds: int) -> dict[int, float]:
    """Median seconds to score a chain block of each size after the prompt, sizes rotated each round."""
    backend.reset()
    backend.score(PROMPT)
    start_len = backend.cache_len
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(rounds):
        for n in sizes[r % len(sizes):] + sizes[: r % len(sizes)]:
            start = time.perf_counter()
            backend.score_block(Block.chain(PROMPT[:n]))
            times[n].append(time.perf_counter() - start)
            backend.rollback(start_len)
    return {n: statistics.median(ts) for n, ts in times.items()}


def identical_rows(backend: FastLlamaBackend, sizes: list[int]) -> float:
    """Share of block rows bitwise equal to scoring their token alone after the same prefix."""
    same = total = 0
    tokens = PROMPT[16:32]
    backend.reset()
    backend.score(PROMPT[:16])
    alone = torch.cat([backend.score([t]) for t in tokens])  # [16, V]
    for n in sizes:
        backend.rollback(16)
        block = backend.score_block(Block.chain(tokens[:n])).logits  # [n, V]
        same += int((block == alone[:n]).all(dim=1).sum())
        total += n
    return same / total


def llama_cpp_seconds(gguf: str, tokens: int) -> float | str:
    """Median seconds per token of llama.cpp decoding one token at a time after the prompt, or why not measured."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return "not measured: llama-cpp-python is not installed (pip install llama-cpp-python)"
    llm = Llama(model_path=gguf, n_threads=torch.get_num_threads(), n_ctx=512, verbose=False)
    llm.eval(PROMPT)
    times = []
    for _ in range(tokens):
        start = time.perf_counter()
        llm.eval([PROMPT[-1]])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--tokens", type=int, default=48, help="decoded tokens per autoregressive measurement")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the block-cost curve")
    parser.add_argument("--max-block", type=int, default=16)
    parser.add_argument("--llama-gguf", nargs="*", default=[],
                        help="GGUF files (e.g. F32 and F16 conversions of the target) to decode with llama.cpp")
    args = parser.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    sizes = list(range(1, args.max_block + 1))
    bandwidth = read_bandwidth()
    auto, why = auto_dtype("cpu")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; read bandwidth {bandwidth / 1e9:.1f} GB/s; "
          f"auto dtype here: {auto} ({why})")
    rows = []
    for dtype in args.dtypes:
        target = load_model(args.target, dtype=dtype)
        per_token = weight_bytes(target.model)
        limit = bandwidth / per_token
        for mode in (Mode(dtype, False), Mode(dtype, False, weight_major=True), Mode(dtype, True, 1),
                     Mode(dtype, True, 16)):
            backend = FastLlamaBackend(target.model, batch_invariant=mode.invariant, invariant_rows=mode.rows,
                                       weight_major=mode.weight_major)
            seconds = decode_seconds(backend, args.tokens)
            curve = block_curve(backend, sizes, args.rounds)
            same = identical_rows(backend, sizes[1:])
            rows.append((mode, per_token, limit, seconds, curve, same))
    print(f"\n{'mode':<19}{'MB/token':>9}{'limit tok/s':>12}{'AR tok/s':>9}{'% limit':>8}{'same rows':>10}  "
          "block cost / one token (n = " + " ".join(str(n) for n in sizes) + ")")
    for mode, per_token, limit, seconds, curve, same in rows:
        ratios = " ".join(f"{curve[n] / curve[1]:.2f}" for n in sizes)
        print(f"{mode.label:<19}{per_token / 1e6:>9.0f}{limit:>12.1f}{1 / seconds:>9.1f}{100 / seconds / limit:>7.0f}%"
              f"{100 * same:>9.0f}%  {ratios}")
    fastest = max(rows, key=lambda r: 1 / r[3])
    print(f"\nfastest plain decoding: {fastest[0].label} at {1 / fastest[3]:.1f} tok/s")
    for gguf in args.llama_gguf:
        seconds = llama_cpp_seconds(gguf, args.tokens)
        if isinstance(seconds, str):
            print(f"llama.cpp {gguf}: {seconds}")
        else:
            print(f"llama.cpp {gguf}: {1 / seconds:.1f} tok/s; fastest draftlab plain decoding / llama.cpp = "
                  f"{seconds / fastest[3]:.2f}x")
    if not args.llama_gguf:
        print("llama.cpp: not measured (give --llama-gguf FILE...; needs pip install llama-cpp-python)")
    print("reproduce: python benchmarks/backend_limits.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()

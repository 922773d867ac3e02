"""draftlab's exact llama.cpp kernels against llama.cpp's stock kernels, per weight type, in one run.

Per weight type of the target (the shipped file and each type derived from it with llama.cpp's quantizer):
- draftlab's exact route (the libraries scripts/build-llama-cpp.sh patches, `LlamaCppBackend`): one row's time
  after a cached prefix, blocks of 2/4/8/16 rows as multiples of it, whether every row of every block is bitwise
  the same row scored alone, and prefill tok/s;
- llama.cpp's stock kernels (the same build's unpatched ggml-cpu, `$cache/llama.cpp/*/stock`, built on demand, loaded through
  LLAMA_CPP_LIB_PATH; repack on, tiled matmul at its default, flash attention off): llama-cpp-python's own decode
  step (`Llama.eval` of one token) and prefill tok/s of the same file, and draftlab's engine on those kernels (the
  same loop as the exact route's: the kernels alone differ), whose rows are compared with single rows too.
Each side runs in a child process of its own (ggml reads its kernels and switches once), one after the other, for
each weight type in turn. Prints the host's CPU flags, one table, and one JSON document as the last line.
With `--libs DIR ...`, the exact side alone on each directory of llama.cpp libraries (a build of other patches;
`installed`: the libraries llama-cpp-python loads itself), one child process each in turn, `--repeat` times: a patch
against the build before it, in one run, the machine's drift shared by both.

    python benchmarks/exact_kernels.py
    python benchmarks/exact_kernels.py --types shipped Q4_0 Q8_0 BF16 --rounds 9
    python benchmarks/exact_kernels.py --target qwen2.5-coder-1.5b --types Q4_0_PURE --turns 3
    python benchmarks/exact_kernels.py --types BF16 --libs OLD_BUILD/lib installed --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BLOCKS = (1, 2, 4, 8, 16)
CHECKED = (2, 3, 4, 5, 8, 12, 16)  # block sizes whose rows are compared with single rows
SHIPPED = "shipped"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--types", nargs="+", default=[SHIPPED, "Q4_0", "Q8_0"])
    parser.add_argument("--prefix", type=int, default=300, help="cached tokens before the timed blocks")
    parser.add_argument("--prefill", type=int, default=1024, help="tokens of the timed prefill")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--libs", nargs="+", metavar="DIR", help="the exact side on each library directory in turn "
                        "('installed': llama-cpp-python's own)")
    parser.add_argument("--repeat", type=int, default=3, help="turns of --libs")
    parser.add_argument("--turns", type=int, default=1, help="turns of the exact and the stock side, alternating "
                        "(medians: a drifting machine's speed shared by both)")
    parser.add_argument("--child", choices=("exact", "stock"), help=argparse.SUPPRESS)
    parser.add_argument("--gguf", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args)))
        return
    if args.libs:
        rows = [compare_libs(args, kind) for kind in args.types]
        print_libs_table(rows)
        print(json.dumps({"host_flags": host_flags(), "target": args.target, "libs": rows}))
        return
    rows = [measure_type(args, kind) for kind in args.types]
    print_table(rows)
    print(json.dumps({"host_flags": host_flags(), "target": args.target, "rows": rows}))


def type_path(args, kind: str) -> Path:
    """The GGUF of one weight type of the target (derived once, cached)."""
    from draftlab.models import gguf_path

    return gguf_path(args.target if kind == SHIPPED else f"{args.target}@{kind}")


def measure_type(args, kind: str) -> dict:
    """Both sides of one weight type, each in its own process, `--turns` times in alternation (medians)."""
    path = type_path(args, kind)
    row = {"type": kind, "file": path.name, "size_mb": round(path.stat().st_size / 1e6), "turns": args.turns}
    runs: dict[str, list[dict]] = {"exact": [], "stock": []}
    for _ in range(args.turns):
        for side in runs:
            runs[side].append(run_side(args, side, path))
    for side, done in runs.items():
        failed = [run for run in done if "error" in run]
        row[side] = failed[0] if failed else merge_loops(done) if side == "exact" else merge_stock(done)
    return row


def median(values) -> float:
    return round(statistics.median(values), 2)


def merge_loops(done: list[dict]) -> dict:
    """One engine loop's turns as one: medians of its times, its rows compared and differing summed."""
    return {"kernels": done[0]["kernels"], "rows_compared": sum(run["rows_compared"] for run in done),
            "rows_differing": sum(run["rows_differing"] for run in done),
            "one_row_ms": median(run["one_row_ms"] for run in done),
            "block_x": {str(n): median(run["block_x"][str(n)] for run in done) for n in BLOCKS},
            "prefill_tok_s": median(run["prefill_tok_s"] for run in done)}


def merge_stock(done: list[dict]) -> dict:
    """The stock side's turns as one (its engine loop and llama-cpp-python's own step and prefill)."""
    return {"loop": merge_loops([run["loop"] for run in done]), "system_info": done[0]["system_info"],
            "step_ms": median(run["step_ms"] for run in done),
            "prefill_tok_s": median(run["prefill_tok_s"] for run in done)}


def compare_libs(args, kind: str) -> dict:
    """The exact side of one weight type on each of `args.libs`, in turns: medians of one row and of each block."""
    path = type_path(args, kind)
    runs: dict[str, list[dict]] = {lib: [] for lib in args.libs}
    for _ in range(args.repeat):
        for lib in args.libs:
            runs[lib].append(run_side(args, "exact", path, None if lib == "installed" else lib))
    return {"type": kind, "file": path.name, "sides": [summarize_runs(lib, done) for lib, done in runs.items()]}


def summarize_runs(lib: str, done: list[dict]) -> dict:
    """One library's medians over its turns (or the first error)."""
    failed = [run["error"] for run in done if "error" in run]
    if failed:
        return {"lib": lib, "error": failed[0]}
    return {"lib": lib, "turns": len(done), "rows_compared": sum(run["rows_compared"] for run in done),
            "rows_differing": sum(run["rows_differing"] for run in done),
            "one_row_ms": round(statistics.median(run["one_row_ms"] for run in done), 2),
            "block_ms": {str(n): round(statistics.median(run["one_row_ms"] * run["block_x"][str(n)] for run in done), 2)
                         for n in BLOCKS}}


def stock_build() -> str:
    """llama.cpp's stock ggml-cpu beside draftlab's build (scripts/build-llama-cpp.sh --stock: ~25 s once, cached):
    its directory."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "build-llama-cpp.sh"
    done = subprocess.run(["bash", str(script), "--stock", sys.executable], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"exact_kernels: llama.cpp's stock ggml-cpu did not build: {done.stderr.strip()[-300:]}")
    return done.stdout.strip().splitlines()[-1]


def run_side(args, side: str, path: Path, lib: str | None = None) -> dict:
    """One child process (on the libraries in `lib` where given): its JSON line, or the reason it gave none."""
    env = dict(os.environ)
    if lib is not None:
        env["LLAMA_CPP_LIB_PATH"] = lib
    if side == "stock":
        env["LLAMA_CPP_LIB_PATH"] = stock_build()
        env.pop("GGML_CPU_TILED_MM", None)
    command = [sys.executable, __file__, "--child", side, "--gguf", str(path), "--prefix", str(args.prefix),
               "--prefill", str(args.prefill), "--rounds", str(args.rounds)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_child(args) -> dict:
    """The measurements of one side in this process."""
    path = Path(args.gguf)
    prefix = [100 + (i * 37) % 20000 for i in range(args.prefix)]
    prompt = [100 + (i * 53) % 20000 for i in range(args.prefill)]
    loop = loop_side(path, prefix, prompt, args.rounds)
    return loop if args.child == "exact" else {"loop": loop, **stock_side(path, prefix, prompt, args.rounds)}


def loop_side(path: Path, prefix: list[int], prompt: list[int], rounds: int) -> dict:
    """draftlab's llama.cpp engine (`LlamaCppBackend`) on the loaded kernels: block costs, row exactness, prefill."""
    import torch

    from draftlab.backends.gguf import LlamaCppModel, describe_gguf
    from draftlab.backends.llamacpp import LlamaCppBackend
    from draftlab.files.assets import cache_dir

    model = LlamaCppModel.load(path, describe_gguf(path, cache_dir()))
    backend = LlamaCppBackend(model)
    backend.score(prefix, last_only=True)
    tokens, alone = [120], []
    for _ in range(max(CHECKED)):
        alone.append(backend.score(tokens[-1:])[0])  # [V]
        tokens.append(int(alone[-1].argmax()))
    differing = 0
    for n in CHECKED:
        backend.rollback(len(prefix))
        block = backend.score(tokens[:n])  # [n, V]
        differing += sum(not torch.equal(block[i], alone[i]) for i in range(n))

    def block_time(n: int) -> float:
        backend.rollback(len(prefix))
        start = time.perf_counter()
        backend.score(tokens[:n])
        return time.perf_counter() - start

    blocks = timed(block_time, rounds)

    def prefill_time() -> float:
        backend.reset()
        start = time.perf_counter()
        backend.score(prompt, last_only=True)
        return time.perf_counter() - start

    prefill = statistics.median(prefill_time() for _ in range(3))
    return {"kernels": backend.numerics, "rows_compared": sum(CHECKED), "rows_differing": differing,
            "one_row_ms": round(1000 * blocks[1], 2), "block_x": {str(n): round(blocks[n] / blocks[1], 2) for n in BLOCKS},
            "prefill_tok_s": round(len(prompt) / prefill, 1)}


def stock_side(path: Path, prefix: list[int], prompt: list[int], rounds: int) -> dict:
    """llama-cpp-python's own `Llama` on llama.cpp's stock kernels: one decode step, prefill."""
    import llama_cpp

    from draftlab.backends.gguf import threads

    llm = llama_cpp.Llama(str(path), n_ctx=max(len(prompt), len(prefix) + 64) + 16, n_batch=512, n_threads=threads(),
                          n_threads_batch=threads(), flash_attn=False, verbose=False)

    def step_time(_: int) -> float:
        llm.n_tokens = len(prefix)
        llm._ctx.kv_cache_seq_rm(0, len(prefix), -1)
        start = time.perf_counter()
        llm.eval([120])
        return time.perf_counter() - start

    llm.eval(prefix)
    step = statistics.median(step_time(0) for _ in range(rounds * 4))

    def prefill_time() -> float:
        llm.reset()
        llm._ctx.kv_cache_clear()
        start = time.perf_counter()
        llm.eval(prompt)
        return time.perf_counter() - start

    prefill = statistics.median(prefill_time() for _ in range(3))
    return {"system_info": llama_cpp.llama_print_system_info().decode(), "step_ms": round(1000 * step, 2),
            "prefill_tok_s": round(len(prompt) / prefill, 1)}


def timed(run, rounds: int) -> dict[int, float]:
    """Median seconds of `run(n)` per block size, the sizes interleaved round by round (one warm-up round)."""
    times: dict[int, list[float]] = {n: [] for n in BLOCKS}
    for r in range(rounds + 1):
        for n in BLOCKS:
            seconds = run(n)
            if r:
                times[n].append(seconds)
    return {n: statistics.median(v) for n, v in times.items()}


def host_flags() -> list[str]:
    from draftlab.backends.routes import cpu_flags

    return sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))


def print_table(rows: list[dict]) -> None:
    print(f"host: {os.cpu_count()} CPU(s), flags {' '.join(host_flags())}")
    print(f"{'type':<11}{'kernels':<8}{'rows':>8}{'row ms':>8}" + "".join(f"{'x' + str(n):>7}" for n in BLOCKS[1:])
          + f"{'prefill':>9}  llama-cpp-python, stock: step ms, prefill")
    for row in rows:
        exact, stock = row["exact"], row["stock"]
        if "error" in exact or "error" in stock:
            print(f"{row['type']:<11}failed: {exact.get('error') or stock.get('error')}")
            continue
        for name, side in (("exact", exact), ("stock", stock["loop"])):
            tail = (f"  {stock['step_ms']:.2f} ({exact['one_row_ms'] / stock['step_ms']:.2f}x), "
                    f"{stock['prefill_tok_s']:.0f}" if name == "exact" else "")
            print(f"{row['type'] if name == 'exact' else '':<11}{name:<8}"
                  f"{side['rows_compared'] - side['rows_differing']:>4}/{side['rows_compared']:<3}{side['one_row_ms']:>8.2f}"
                  + "".join(f"{side['block_x'][str(n)]:>7.2f}" for n in BLOCKS[1:]) + f"{side['prefill_tok_s']:>9.0f}"
                  + tail)
    print("draftlab's engine on its exact kernels, then on llama.cpp's stock ones; rows: rows of blocks of 2-16 bitwise "
          "equal to the same rows alone; xN: a block of N rows as a multiple of one row; prefill: tok/s; last: "
          "llama-cpp-python's own step on the stock kernels (and the exact row's multiple of it) and prefill")


def print_libs_table(rows: list[dict]) -> None:
    print(f"host: {os.cpu_count()} CPU(s), flags {' '.join(host_flags())}")
    print(f"{'type':<11}{'rows':>10}  " + "".join(f"{'ms x' + str(n):>9}" for n in BLOCKS) + "  libraries")
    for row in rows:
        for side in row["sides"]:
            if "error" in side:
                print(f"{row['type']:<11}failed on {side['lib']}: {side['error']}")
                continue
            print(f"{row['type']:<11}{side['rows_compared'] - side['rows_differing']:>5}/{side['rows_compared']:<4}  "
                  + "".join(f"{side['block_ms'][str(n)]:>9.2f}" for n in BLOCKS) + f"  {side['lib']}")
    print("the exact side on each library directory in turn; rows: rows of blocks bitwise equal to the same rows alone; "
          "ms xN: the median time of a block of N rows")


if __name__ == "__main__":
    main()

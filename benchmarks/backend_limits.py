"""How close the fast backend runs to the machine's limits, per dtype and route, in one run.

Prints, for each dtype and each route of the fast backend (`draftlab.backends.routes`: the exact routes
exact-linear/R and exact-wm/R, and the unchunked `linear` and `weight-major` products):
- the weight bytes read per token and the measured read bandwidth, hence the
  bandwidth limit on plain decoding (tok/s);
- plain decoding tok/s and its share of that limit;
- the block-cost curve: scoring 1..16 tokens in one pass, relative to one token
  (the number the throughput model and the choice of K depend on);
- the share of block rows bitwise identical to scoring their token alone;
then the prefill time of a long prompt per dtype, the route `auto` chooses on this host and why, the
fastest plain decoding, and llama.cpp plain decoding of the GGUF files given with --llama-gguf when
llama-cpp-python is installed.

`--devices cuda cpu` measures a GPU and this machine's CPU in the same run (each row names its device; the route
`auto` chooses is timed on each device). `--shape NAME` runs random weights in a real model's shape (every layer,
its vocabulary: true costs, no download), e.g. `--shape qwen2.5-7b --devices cuda --dtypes bf16`; HF `generate`
runs beside draftlab on the same weights. The last line of stdout is one JSON document.

Timings are medians of interleaved rounds, so drift hits every block size alike.

    python benchmarks/backend_limits.py --dtypes fp32 bf16 --tokens 48
    python benchmarks/backend_limits.py --devices cuda cpu --dtypes bf16 --routes linear exact-linear/16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from types import SimpleNamespace

import torch

from draftlab.backends import FastLlamaBackend
from draftlab.backends.routes import KINDS, Route, choose_for, cpu_flags, cpu_model, exact_routes, gpu_name
from draftlab.backends.static_step import StaticStep
from draftlab.checks.exactness import DTYPES, SHAPES, random_model, shapes_named
from draftlab.errors import DraftlabError
from draftlab.models import load_model
from draftlab.decoding.step import Block

PROMPT = [1, 504, 3458, 282, 4125, 28, 357, 253, 2641, 30, 378, 1028, 314, 253, 1789, 2295] * 4  # 64 tokens


def read_bandwidth(device: str, gib: float = 0.5, repeats: int = 5) -> float:
    """Bytes per second this device reads, from summing a large fp32 tensor."""
    data = torch.ones(int(gib * 2**30) // 4, device=device)
    float(data.sum())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        float(data.sum())  # float(): waits for a GPU's kernel
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / min(times)


def describe(device: str, bandwidth: float) -> str:
    """The device's name, and for the CPU its flags and threads."""
    if device.startswith("cuda"):
        return f"{gpu_name(device)}; torch {torch.__version__}; read bandwidth {bandwidth / 1e9:.0f} GB/s"
    flags = " ".join(sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16"}))
    return (f"{cpu_model() or 'unknown CPU'} ({flags or 'no AVX flags'}); torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads; read bandwidth {bandwidth / 1e9:.1f} GB/s")


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


def prefill_seconds(model, device: str, tokens: int, repeats: int = 3) -> float:
    """Median seconds to prefill a `tokens`-long prompt (every row cached, the last row's logits)."""
    backend = FastLlamaBackend(model, device, capacity=tokens + 8)
    prompt = (PROMPT * (tokens // len(PROMPT) + 1))[:tokens]
    times = []
    for _ in range(repeats + 1):
        backend.reset()
        start = time.perf_counter()
        backend.score(prompt, last_only=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--shape", help="random weights in a named model's shape instead of --target (every layer, "
                                        "real vocabulary; no download): " + ", ".join(SHAPES))
    parser.add_argument("--devices", nargs="+", default=["cpu"], help="cpu, cuda, or both (measured in one run)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--tokens", type=int, default=48, help="decoded tokens per plain decoding measurement")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the block-cost curve")
    parser.add_argument("--max-block", type=int, default=16)
    parser.add_argument("--routes", nargs="*", default=None,
                        help="route names to measure (e.g. linear exact-wm/4); default: every route")
    parser.add_argument("--steps", nargs="+", default=["auto"],
                        help="how exact routes run their blocks: auto (the device's default), off (eager), rows, "
                             "block (static passes, attention by rows or in one call), graphs, graphs-block (the "
                             "same replayed as CUDA graphs)")
    parser.add_argument("--prefill-tokens", type=int, default=1344, help="length of the prompt whose prefill is timed")
    parser.add_argument("--llama-gguf", nargs="*", default=[],
                        help="GGUF files (e.g. F32 and F16 conversions of the target) to decode with llama.cpp")
    args = parser.parse_args()
    sizes = list(range(1, args.max_block + 1))
    rows, prefills, hf_times = [], {}, {}
    for device in args.devices:
        print(f"{device}: {describe(device, read_bandwidth(device))}")
        rows += measure_device(args, device, sizes, prefills, hf_times)
    print(f"\n{'device':<7}{'route':<22}{'step':<13}{'MB/token':>9}{'limit tok/s':>12}{'AR tok/s':>9}{'% limit':>8}"
          f"{'same rows':>10}  block cost / one token (n = " + " ".join(str(n) for n in sizes) + ")")
    for device, route, per_token, limit, seconds, curve, same, step in rows:
        ratios = " ".join(f"{curve[n] / curve[1]:.2f}" for n in sizes)
        print(f"{device:<7}{route.label:<22}{step:<13}{per_token / 1e6:>9.0f}{limit:>12.1f}{1 / seconds:>9.1f}"
              f"{100 / seconds / limit:>7.0f}%{100 * same:>9.0f}%  {ratios}")
    print(f"\nprefill of a {args.prefill_tokens}-token prompt: " + ", ".join(
        f"{device} {dtype} {s:.3f} s" for (device, dtype), s in prefills.items()))
    for device in args.devices:
        summarize_device(args, device, [r[1:7] for r in rows if r[0] == device and r[7] == args.steps[0]])
    for (device, dtype), seconds in hf_times.items():
        print(f"{device} {dtype}: HF generate (eager, plain) {1 / seconds:.1f} tok/s")
    for gguf in args.llama_gguf:
        seconds = llama_cpp_seconds(gguf, args.tokens)
        fastest = min(r[4] for r in rows if r[0] == "cpu") if "cpu" in args.devices else None
        if isinstance(seconds, str):
            print(f"llama.cpp {gguf}: {seconds}")
        else:
            print(f"llama.cpp {gguf}: {1 / seconds:.1f} tok/s" + (
                f"; fastest draftlab CPU plain decoding / llama.cpp = {seconds / fastest:.2f}x" if fastest else ""))
    if not args.llama_gguf:
        print("llama.cpp: not measured (give --llama-gguf FILE...; needs pip install llama-cpp-python)")
    print("reproduce: python benchmarks/backend_limits.py " + " ".join(sys.argv[1:]))
    print(json.dumps({"model": args.shape or args.target, "random_weights": bool(args.shape), "rows": [
        {"device": device, "route": route.label, "step": step, "bytes_per_token": per_token, "limit_tokens_per_s": limit,
         "tokens_per_s": 1 / seconds, "share_of_limit": 1 / seconds / limit,
         "block_cost": {n: curve[n] / curve[1] for n in sizes}, "identical_rows": same}
        for device, route, per_token, limit, seconds, curve, same, step in rows],
        "hf_generate_tokens_per_s": {f"{d} {t}": 1 / s for (d, t), s in hf_times.items()},
        "prefill_s": {f"{d} {t}": s for (d, t), s in prefills.items()}}))


def measure_device(args, device: str, sizes: list[int], prefills: dict, hf_times: dict) -> list[tuple]:
    """(device, route, bytes/token, bandwidth limit, s/token, block curve, identical share) per dtype and route;
    the prefill and HF `generate`'s plain decoding per dtype."""
    bandwidth = read_bandwidth(device)
    rows = []
    for dtype in args.dtypes:
        target = model_of(args, dtype, device)
        per_token = weight_bytes(target.model)
        hf_times[(device, dtype)] = hf_generate_seconds(target.model, device, args.tokens)
        for route in [Route(dtype, kind, 0) for kind in KINDS] + exact_routes(dtype):
            if args.routes and route.label.split(" ", 1)[1] not in args.routes:
                continue
            for step in args.steps if route.exact else ["off"]:
                try:
                    rows.append((device, route, per_token, bandwidth / per_token,
                                 *measure_step(target.model, device, route, step, sizes, args), step))
                except (RuntimeError, DraftlabError) as exc:  # one step's failure (a kernel's refusal) must not lose the others
                    print(f"{device} {route.label} step {step}: failed: {str(exc).splitlines()[0]}", flush=True)
        prefills[(device, dtype)] = prefill_seconds(target.model, device, args.prefill_tokens)
        del target
    return rows


def measure_step(model, device: str, route: Route, step: str, sizes: list[int], args) -> tuple[float, dict, float]:
    """Seconds per plain token, the block-cost curve and the share of identical rows of a route run as `step`."""
    backend = FastLlamaBackend(model, device, route=route, step="auto" if step == "auto" else StaticStep.parse(step))
    seconds = decode_seconds(backend, args.tokens)
    return seconds, block_curve(backend, sizes, args.rounds), identical_rows(backend, sizes[1:])


def model_of(args, dtype: str, device: str):
    """The target, or random weights in --shape's shape (every layer, its vocabulary)."""
    if not args.shape:
        return load_model(args.target, dtype=dtype, device=device)
    shape = shapes_named([args.shape])[0]
    return SimpleNamespace(model=random_model(shape, DTYPES[dtype], device, layers=shape.depth))


def hf_generate_seconds(model, device: str, tokens: int) -> float:
    """Seconds per token of HF `generate` (greedy, eager, its own cache) after the prompt, first call untimed."""
    ids = torch.tensor([[t % model.config.vocab_size for t in PROMPT]], device=device)
    settings = dict(do_sample=False, min_new_tokens=tokens, max_new_tokens=tokens, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **{**settings, "min_new_tokens": 2, "max_new_tokens": 2})
        start = time.perf_counter()
        model.generate(ids, **settings)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / tokens


def summarize_device(args, device: str, rows: list[tuple]) -> None:
    """The route auto chooses on the device, the fastest plain decoding, and the chosen route's block of 8."""
    config = model_of(args, args.dtypes[0], "meta").model.config
    choice = choose_for(config, device)
    print(f"{device}: auto chooses {choice.describe()}")
    exact = [r for r in rows if r[0].exact]
    fastest = min(rows, key=lambda r: r[3])
    fastest_exact = min(exact, key=lambda r: r[3]) if exact else fastest
    print(f"{device}: fastest plain decoding {fastest[0].label} at {1 / fastest[3]:.1f} tok/s; fastest exact "
          f"{fastest_exact[0].label} at {1 / fastest_exact[3]:.1f} tok/s")
    chosen = next((r for r in rows if r[0] == choice.route), None)
    if chosen is not None:
        curve = chosen[4]
        print(f"{device}: auto's route measured here: {1 / chosen[3]:.1f} tok/s plain "
              f"({fastest_exact[3] / chosen[3]:.2f}x the fastest exact); block of 4 = {curve[4] / curve[1]:.2f}x, "
              f"of 8 = {curve[8] / curve[1]:.2f}x one token" if 8 in curve else "")


if __name__ == "__main__":
    main()

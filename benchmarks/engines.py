"""Engines side by side on the same prompts and token counts, in one run: llama-cpp-python's own `generate` (plain,
and with its prompt lookup), draftlab on the llama.cpp backend (plain on llama.cpp's default kernels, plain and
speculative on the exact kernels) and draftlab on its torch backend (plain, in the route this host runs fastest).

Every method runs back to back on each prompt (machine drift hits all alike). Prints tok/s per dataset, each
method against the fastest plain decoding measured (any engine), outputs identical to the method's own engine's
plain decoding, and the block-cost curve (seconds of a block of n over one token) of each backend. The last line
of stdout is one JSON document.

    python benchmarks/engines.py --target smollm2-135m --datasets humaneval code-edit --limit 4 --ks 3 8
    python benchmarks/engines.py --target qwen2.5-coder-1.5b --drafters ngram model:qwen2.5-coder-0.5b --no-torch
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections import defaultdict

from draftlab.api import SpeculativeDecoder, encode_prompt, eos_ids, prompt_ids
from draftlab.backends.routes import cpu_flags, cpu_model
from draftlab.files.datasets import load_prompts
from draftlab.contenders.llama_cpp_python import LlamaCppPeer
from draftlab.measure import EncodedPrompt, RunSettings, run_once
from draftlab.models import gguf_path, load_model
from draftlab.contenders.plain import default_kernels
from draftlab.perf.calibrate import time_blocks

PLAIN = ("llama-cpp-python generate", "draftlab llama.cpp plain (repack)", "draftlab llama.cpp plain (exact)",
         "draftlab torch plain")
REFERENCE = {"llama-cpp-python lookup": "llama-cpp-python generate", "draftlab llama.cpp": "draftlab llama.cpp "
             "plain (exact)", "draftlab llama.cpp plain (repack)": "draftlab llama.cpp plain (exact)"}


def methods(args) -> dict:
    """Method name -> generate(prompt_ids) -> (tokens, seconds)."""
    exact = load_model(args.target, backend="llamacpp")
    eos = eos_ids(exact)
    peer = LlamaCppPeer(gguf_path(args.target))
    plain_exact = SpeculativeDecoder.from_names(exact, drafter="none", k=1)
    runs = {"llama-cpp-python generate": ours(peer.contender(eos, 0), args),
            "draftlab llama.cpp plain (repack)": ours(default_kernels(plain_exact), args),
            "draftlab llama.cpp plain (exact)": ours(plain_exact, args)}
    for k in args.ks:
        runs[f"llama-cpp-python lookup K={k}"] = ours(peer.contender(eos, k), args)
        for drafter in args.drafters:
            decoder = SpeculativeDecoder.from_names(exact, drafter=drafter, k=k)
            runs[f"draftlab llama.cpp {drafter} K={k}"] = ours(decoder, args)
    if not args.no_torch:
        runs["draftlab torch plain"] = ours(SpeculativeDecoder.from_names(args.target, drafter="none", k=1), args)
    return runs, exact


def ours(contender, args):
    """generate(prompt_ids) -> (tokens, seconds), timed by the measurement loop."""
    def run(ids):
        record = run_once("run", contender, EncodedPrompt("", "", ids), RunSettings(args.max_new_tokens))
        return record.token_ids, record.stats.wall_s
    return run


def reference_of(name: str) -> str:
    """The plain decoding of the method's own engine, whose output it must equal."""
    for prefix, reference in REFERENCE.items():
        if name.startswith(prefix) and name != reference:
            return reference
    return name


def block_curves(args, exact) -> dict:
    """Seconds of a block of n tokens over one token's, per backend."""
    context = encode_prompt(exact.tokenizer, "Write a Python function that merges two sorted lists.")
    backends = {"llama.cpp exact": SpeculativeDecoder.from_names(exact, drafter="none", k=1)}
    backends["llama.cpp repack"] = default_kernels(backends["llama.cpp exact"])
    if not args.no_torch:
        backends["torch"] = SpeculativeDecoder.from_names(args.target, drafter="none", k=1)
    curves = {}
    for name, decoder in backends.items():
        times = time_blocks(decoder.target_backend, context, [1, 2, 4, 8, 16], args.repeats).median_s
        curves[name] = {"one_token_ms": times[1] * 1000, **{str(n): times[n] / times[1] for n in (2, 4, 8, 16)}}
    return curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m", help="a GGUF: short name or path")
    parser.add_argument("--drafters", nargs="+", default=["ngram"], help="draftlab drafters on llama.cpp")
    parser.add_argument("--ks", nargs="+", type=int, default=[3, 8])
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "code-edit"])
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=7, help="rounds of block timings")
    parser.add_argument("--no-torch", action="store_true", help="leave out draftlab's torch backend (slow for 1B+)")
    args = parser.parse_args()
    runs, exact = methods(args)
    first = load_prompts(args.datasets[0], 1)[0]
    for run in runs.values():  # untimed: first calls pay one-off costs
        run(prompt_ids(exact.tokenizer, first))
    totals = defaultdict(lambda: [0, 0.0])  # (dataset, method) -> tokens, seconds
    outputs = defaultdict(list)  # (dataset, method) -> token lists
    for dataset in args.datasets:
        prompts = load_prompts(dataset, args.limit)
        for prompt in prompts:
            ids = prompt_ids(exact.tokenizer, prompt)
            for name, run in runs.items():
                tokens, seconds = run(ids)
                totals[(dataset, name)][0] += len(tokens)
                totals[(dataset, name)][1] += seconds
                outputs[(dataset, name)].append(tokens)
            print(f"  {dataset} {prompt.id} done", file=sys.stderr)
    report = summarize(args, runs, totals, outputs)
    report["block_cost"] = block_curves(args, exact)
    print_report(report)
    print(json.dumps(report))


def summarize(args, runs, totals, outputs) -> dict:
    out = {"command": "python " + " ".join(sys.argv), "host": cpu_model(), "cpu_flags": sorted(
        cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16"}), "python": platform.python_version(),
        "numerics": load_model(args.target, backend="llamacpp").model.kernels(), "datasets": {}}
    for dataset in args.datasets:
        speed = {name: totals[(dataset, name)][0] / totals[(dataset, name)][1] for name in runs}
        fastest = max((n for n in runs if n in PLAIN), key=speed.get)
        out["datasets"][dataset] = {"fastest_plain": fastest, "methods": {
            name: {"tokens_per_s": speed[name], "vs_fastest_plain": speed[name] / speed[fastest],
                   "identical": sum(a == b for a, b in zip(outputs[(dataset, name)],
                                                           outputs[(dataset, reference_of(name))])),
                   "prompts": len(outputs[(dataset, name)]), "reference": reference_of(name)}
            for name in runs}}
    return out


def print_report(report: dict) -> None:
    print(f"host: {report['host']} ({' '.join(report['cpu_flags'])}); llama.cpp: {report['numerics']}")
    for dataset, result in report["datasets"].items():
        print(f"\n{dataset} (fastest plain: {result['fastest_plain']})")
        print(f"{'method':<48}{'tok/s':>8}{'vs fastest plain':>18}{'identical':>11}")
        for name, m in result["methods"].items():
            print(f"{name:<48}{m['tokens_per_s']:>8.1f}{m['vs_fastest_plain']:>17.2f}x"
                  f"{m['identical']:>7}/{m['prompts']}")
    print("\nblock of n tokens, x one token's time")
    for name, curve in report["block_cost"].items():
        print(f"  {name:<18} one token {curve['one_token_ms']:.1f} ms; " +
              " ".join(f"{n}: {curve[n]:.2f}" for n in ("2", "4", "8", "16")))
    print(f"\n{report['command']}")


if __name__ == "__main__":
    main()

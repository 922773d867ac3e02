"""Suffix decoding against n-gram lookup at each K, the peers' prompt lookup and plain decoding, per workload.

Per workload (a prompt set, taken in order: a stream of requests) every method runs back to back on each prompt
(machine drift hits all alike). Suffix decoding runs warm (one cache over the workload's requests, from empty:
request i has the responses of requests 0..i-1) and cold (`responses=0`: the request's own text only). Plain
decoding runs in every mode draftlab has on the host (its own route, the host's other dtypes and llama.cpp's
default kernels where the model is a GGUF), so each speedup is also stated against the fastest of them. The peers:
HF's `prompt_lookup_num_tokens` (torch targets) or llama-cpp-python's `LlamaPromptLookupDecoding` (llama.cpp), at
each K. Greedy; outputs are compared with the method's own engine's plain decoding. For the stream workloads the
tokens per step over the last `--last` requests compare warm and cold. The last line of stdout is one JSON document.

    python benchmarks/suffix.py --target smollm2-135m --workloads code-edit:20 humaneval:8 --ks 2 4 8
    python benchmarks/suffix.py --target qwen2.5-coder-1.5b --backend llamacpp --workloads code-edit:10
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import defaultdict

from draftlab.api import SpeculativeDecoder, build_drafter, eos_ids, prompt_ids
from draftlab.backends.routes import cpu_flags, cpu_model
from draftlab.files.datasets import load_prompts
from draftlab.contenders.hf import HFAssist, HFGenerate
from draftlab.measure import EncodedPrompt, RunSettings, run_once
from draftlab.measure.loop import prefill_once
from draftlab.contenders.plain import host_plain
from draftlab.contenders.llama_cpp_python import LlamaCppPeer
from draftlab.models import gguf_path, load_model
from draftlab.decoding.policy import FixedK
from draftlab.decoding.sampling import SamplingConfig

GREEDY = SamplingConfig()


def build_methods(args, target) -> tuple[dict, dict]:
    """Name -> fresh-per-workload factory of run(ids) -> (tokens, seconds, steps or None); name -> reference name."""
    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1)
    own = "plain (draftlab)"
    factories = {own: lambda: ours(plain, args)}
    for label, decoder in host_plain(plain).items():
        factories[f"plain ({label})"] = lambda decoder=decoder: ours(decoder, args)
    eos = eos_ids(target)
    if target.engine.runs_gguf:
        peer, peer_plain = LlamaCppPeer(gguf_path(args.target)), "plain (llama-cpp-python)"
        factories[peer_plain] = lambda: ours(peer.contender(eos, 0), args)
        for k in args.peer_ks or args.ks:
            factories[f"lookup llama-cpp-python K={k}"] = lambda k=k: ours(peer.contender(eos, k), args)
    elif not args.no_hf:
        peer_plain = "plain (HF generate)"
        factories[peer_plain] = lambda: ours(HFGenerate(target, eos), args)
        for k in args.peer_ks or args.ks:
            factories[f"lookup HF K={k}"] = lambda k=k: ours(HFGenerate(target, eos, HFAssist(k, ngram_max=3)), args)
    for k in args.ks:
        factories[f"ngram K={k}"] = lambda k=k: ours(speculative(plain, "ngram", k), args)
    for number, spec in enumerate(args.suffix):
        prefix = "suffix" if number == 0 else spec
        for k in args.suffix_ks:
            for name, variant in ((f"{prefix} warm", spec), (f"{prefix} cold", cold(spec))):
                factories[f"{name} K={k}"] = lambda variant=variant, k=k: ours(speculative(plain, variant, k), args)
    references = {name: (peer_plain if name.startswith("lookup") else own) for name in factories}
    return factories, references


def speculative(plain: SpeculativeDecoder, spec: str, k: int) -> SpeculativeDecoder:
    """A new drafter (a new suffix cache) on the plain decoder's target backend, at K."""
    return plain.with_drafter(build_drafter(spec, plain.target, plain.backend).drafter).with_policy(FixedK(k))


def cold(spec: str) -> str:
    """The same suffix options with no responses held across requests."""
    return spec + ("," if ":" in spec else ":") + "responses=0"


def ours(contender, args):
    """run(prompt_ids) -> (tokens, seconds, steps or None: a peer reports none), timed by the measurement loop: the
    prompt prefilled and timed apart first (`prefill_once`), then the decode from it, their sum the seconds. Every
    method pays its prompt's prefill once. (Before 0.29.0 the runs were timed whole: llama-cpp-python's plain
    `generate`, run first on each prompt, paid the prompt's prefill, and its prompt lookup, on the same instance,
    reused that cached prompt and timed its decode alone; on the Qwen 1.5B's code edits that made the lookup at K=8
    2.18x (AVX-512 host) and 3.03x (AVX2 host) its plain decoding, where timed apart it is 1.36x.)"""
    def run(ids):
        prompt = EncodedPrompt("", "", ids)
        prefill = prefill_once([contender], prompt).get(contender.prefill_key)
        record = run_once("run", contender, prompt, RunSettings(args.max_new_tokens),
                          prefill.seconds if prefill else None)
        return record.token_ids, record.stats.wall_s, record.stats.steps if contender.times_prefill else None
    return run


def measure(args, target, factories, references, workload: str, limit: int) -> dict:
    """Every method on every prompt of one workload, in stream order; totals and per-prompt steps."""
    prompts = load_prompts(workload, limit)
    runs = {name: make() for name, make in factories.items()}  # a new suffix cache per workload
    first = prompt_ids(target.tokenizer, prompts[0])
    for name, factory in factories.items():  # warm-up on throwaway runners: no cache learns the first answer
        factory()(first[:64])
    totals = defaultdict(lambda: {"tokens": 0, "seconds": 0.0, "steps": [], "identical": 0})
    for prompt in prompts:
        ids = prompt_ids(target.tokenizer, prompt)
        outputs = {}
        for name, run in runs.items():
            tokens, seconds, steps = run(ids)
            outputs[name] = tokens
            total = totals[name]
            total["tokens"] += len(tokens)
            total["seconds"] += seconds
            total["steps"].append((len(tokens), steps))
        for name in runs:
            totals[name]["identical"] += outputs[name] == outputs[references[name]]
    return {"prompts": len(prompts), "methods": {name: summarize(t) for name, t in totals.items()},
            "last": last_steps(totals, args.last)}


def summarize(total: dict) -> dict:
    steps = [s for _, s in total["steps"] if s is not None]
    tokens = sum(n for n, s in total["steps"] if s is not None)
    return {"tokens_per_s": total["tokens"] / total["seconds"], "tokens": total["tokens"],
            "tokens_per_step": tokens / sum(steps) if steps else None, "identical": total["identical"]}


def last_steps(totals: dict, last: int) -> dict:
    """Tokens per step over the last `last` prompts, for the methods that count steps."""
    out = {}
    for name, total in totals.items():
        tail = total["steps"][-last:]
        if tail and tail[0][1] is not None:
            out[name] = sum(n for n, _ in tail) / sum(s for _, s in tail)
    return out


def print_workload(workload: str, result: dict, args) -> None:
    methods = result["methods"]
    plain = {n: m["tokens_per_s"] for n, m in methods.items() if n.startswith("plain")}
    fastest = max(plain, key=plain.get)
    print(f"\n## {workload}: {result['prompts']} prompts, {args.max_new_tokens} new tokens; fastest plain: "
          f"{fastest} {plain[fastest]:.1f} tok/s")
    print(f"{'method':<34}{'tok/s':>8}{'vs own plain':>14}{'vs fastest':>12}{'tok/step':>10}{'identical':>11}")
    own = methods["plain (draftlab)"]["tokens_per_s"]
    for name, m in methods.items():
        per_step = f"{m['tokens_per_step']:.2f}" if m["tokens_per_step"] else "-"
        print(f"{name:<34}{m['tokens_per_s']:>8.1f}{m['tokens_per_s'] / own:>13.2f}x"
              f"{m['tokens_per_s'] / plain[fastest]:>11.2f}x{per_step:>10}{m['identical']:>8}/{result['prompts']}")
    speed = {n: m["tokens_per_s"] for n, m in methods.items()}
    ngram = max((n for n in speed if n.startswith("ngram")), key=speed.get)
    warm = max((n for n in speed if n.startswith("suffix") and " warm " in n), key=speed.get)
    coldest = max((n for n in speed if n.startswith("suffix") and " cold " in n), key=speed.get)
    print(f"best suffix warm ({warm}) / best n-gram ({ngram}): {speed[warm] / speed[ngram]:.2f}x; suffix warm / own "
          f"plain: {speed[warm] / own:.2f}x; / fastest plain: {speed[warm] / plain[fastest]:.2f}x")
    tail = result["last"]
    pairs = ", ".join(f"K={k} warm {tail[f'suffix warm K={k}']:.2f} / cold {tail[f'suffix cold K={k}']:.2f} = "
                      f"{tail[f'suffix warm K={k}'] / tail[f'suffix cold K={k}']:.2f}x" for k in args.suffix_ks)
    print(f"tokens per step over the last {min(args.last, result['prompts'])} prompts: {pairs}; "
          f"{ngram} {tail[ngram]:.2f}; best cold: {coldest}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--backend", default="auto", help="auto (draftlab's torch forward) or llamacpp")
    parser.add_argument("--workloads", nargs="+", default=["code-edit:20", "humaneval:8"],
                        help="prompt sets with a count each, NAME:N, run in order as a stream of requests")
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8], help="n-gram lookup's K (and the peers')")
    parser.add_argument("--peer-ks", type=int, nargs="+", default=None, help="the peers' K (default: --ks)")
    parser.add_argument("--suffix-ks", type=int, nargs="+", default=[24],
                        help="suffix decoding's K: the most tokens one step proposes")
    parser.add_argument("--suffix", nargs="+", default=["suffix"],
                        help="suffix drafter specs (warm); cold adds responses=0; the first is named 'suffix'")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--last", type=int, default=20, help="prompts at the end over which warm and cold compare")
    parser.add_argument("--no-hf", action="store_true", help="skip HF generate and its prompt lookup")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    target = load_model(args.target, backend=args.backend)
    factories, references = build_methods(args, target)
    results = {}
    for item in args.workloads:
        workload, _, count = item.partition(":")
        results[workload] = measure(args, target, factories, references, workload, int(count or 20))
        print_workload(workload, results[workload], args)
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16"})
    print(f"\nhost: {cpu_model()} ({' '.join(flags)}), Python {platform.python_version()}; "
          f"{time.perf_counter() - started:.0f} s")
    print("command: python benchmarks/suffix.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(json.dumps({"target": args.target, "backend": str(target.engine), "suffix_ks": args.suffix_ks, "ks": args.ks,
                      "max_new_tokens": args.max_new_tokens, "results": results}))


if __name__ == "__main__":
    main()

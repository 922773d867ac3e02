"""How `draftlab serve` chooses K, in process: aggregate tokens/s of K policies at each number of requests in flight,
against the same server's plain decoding, in one run.

Each run builds a fresh server (`build_served`: its scheduler, the target's KV streams, a new drafter cache, the
startup timing of `--k auto`) and sends the prompts through `--levels` closed-loop clients, each prompt once; the
policies take turns within every repeat, so the machine's drift falls on each alike, and each figure is the median of
`--repeat` runs. Every answer is checked against `draftlab generate`'s plain decoding alone. A policy is `plain`,
`auto` (`--k auto`), a fixed K (`3`) or `--k-per-load` rows (`1:3,2-64:auto`). The HTTP layer is left out (see
`benchmarks/serve.py` for started servers beside llama-server). The last line is one JSON document.

    python benchmarks/serve_k.py --drafter suffix --policies "plain;auto;3;1:3,2-64:auto" --levels 1,4 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import threading
import time

from draftlab.api import SpeculativeDecoder, prompt_ids
from draftlab.backends.routes import cpu_flags
from draftlab.engine import GenerationConfig
from draftlab.files.datasets import load_prompts
from draftlab.serving.build import ServeSettings, build_served
from draftlab.serving.scheduler import Job, LoadK
from draftlab.study.run.budget import HOST_FLAGS


def settings(args: argparse.Namespace, policy: str) -> ServeSettings:
    """The server a policy names."""
    if policy == "plain":
        return ServeSettings(args.target, "none", LoadK.fixed(0), slots=args.slots, context=4096, prompt_cache=False)
    ks = None if policy == "auto" else LoadK.parse(policy if ":" in policy else f"1:{policy}")
    return ServeSettings(args.target, args.drafter, ks, slots=args.slots, context=4096, prompt_cache=False)


def answer(served, ids: list[int], tokens: int) -> list[int]:
    """One request's tokens, waited for."""
    out, done = [], threading.Event()

    def emit(kind: str, value) -> None:
        if kind == "tokens":
            out.extend(value)
        else:
            done.set()
    served.scheduler.submit(Job(ids, GenerationConfig(max_new_tokens=tokens, eos_token_ids=served.eos_ids), emit))
    done.wait()
    return out


def run(args: argparse.Namespace, policy: str, level: int, prompts: list[list[int]]) -> tuple[float, list]:
    """Aggregate tokens/s of one fresh server with `level` clients, and every answer in the prompts' order."""
    served = build_served(settings(args, policy))
    served.scheduler.start()
    work: queue.Queue = queue.Queue()
    for i in range(len(prompts)):
        work.put(i)
    answers: list = [None] * len(prompts)

    def client() -> None:
        while True:
            try:
                i = work.get_nowait()
            except queue.Empty:
                return
            answers[i] = answer(served, prompts[i], args.max_new_tokens)
    started = time.perf_counter()
    clients = [threading.Thread(target=client) for _ in range(level)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    wall = time.perf_counter() - started
    served.scheduler.stop()
    return sum(map(len, answers)) / wall, answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m@Q4_0_PURE")
    parser.add_argument("--drafter", default="suffix")
    parser.add_argument("--policies", default="plain;auto;3", help="';'-separated: plain, auto, K or K-per-load rows")
    parser.add_argument("--levels", default="1,4")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--dataset", default="heldout")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    policies = args.policies.split(";")
    if "plain" not in policies:
        policies.insert(0, "plain")
    levels = [int(x) for x in args.levels.split(",")]
    plain = SpeculativeDecoder.from_names(args.target, drafter="none", k=1, backend="llamacpp")
    prompts = [prompt_ids(plain.target.tokenizer, p) for p in load_prompts(args.dataset, args.limit)]
    alone = [plain.generate(p, max_new_tokens=args.max_new_tokens, temperature=0).token_ids for p in prompts]
    rates: dict[tuple[int, str], list[float]] = {}
    identical: dict[tuple[int, str], int] = {}
    for _ in range(args.repeat):
        for level in levels:
            for policy in policies:
                rate, answers = run(args, policy, level, prompts)
                rates.setdefault((level, policy), []).append(rate)
                same = sum(a == b for a, b in zip(answers, alone))
                identical[(level, policy)] = min(identical.get((level, policy), same), same)
    flags = " ".join(f for f in HOST_FLAGS if f in cpu_flags())
    print(f"{args.target}, {args.drafter}, {len(prompts)} {args.dataset} prompts x {args.max_new_tokens} tokens, "
          f"{args.slots} slots, median of {args.repeat} (host: {flags})")
    report = []
    for level in levels:
        base = statistics.median(rates[(level, "plain")])
        for policy in policies:
            values = rates[(level, policy)]
            median = statistics.median(values)
            print(f"  {level:>2} in flight  {policy:<16} {median:7.1f} tok/s  {median / base:5.2f}x plain "
                  f"({min(values):.1f}-{max(values):.1f})  identical {identical[(level, policy)]}/{len(prompts)}")
            report.append({"level": level, "policy": policy, "tokens_per_s": values, "median": median,
                           "vs_plain": median / base, "identical": identical[(level, policy)]})
    print(json.dumps({"target": args.target, "drafter": args.drafter, "host_flags": flags, "rows": report}))


if __name__ == "__main__":
    main()

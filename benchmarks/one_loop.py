"""Do bench, the sweep and the tuner's race report the same speedup for the same configuration and prompts?

All three now time through the one measurement loop (`draftlab.measure`) and use its speedup definitions. This
runs them back to back, in one process, on the same target, drafter, K and prompts: `draftlab bench`'s
`run_bench`, a sweep of the one cell (its store and report, `summarize`), and the race's round (`run_round`, what
`draftlab tune` races with), each against draftlab's plain decoding on the same backend; `--repeats` times, so
the spread between repeats of one method shows the run-to-run noise the differences between methods compare with.
Prints a table of end-to-end and decode-only speedups, the command, the host's CPU flags, and, as its last line,
one JSON document.

    python benchmarks/one_loop.py
    python benchmarks/one_loop.py --drafter suffix --k 4 --dataset code-edit --limit 6 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from draftlab.api import SpeculativeDecoder
from draftlab.backends.routes import cpu_flags
from draftlab.bench import BenchSettings, run_bench
from draftlab.files.datasets import load_prompts
from draftlab.measure import DECODE, END_TO_END, RunSettings
from draftlab.perf.halving import PLAIN, encode, run_round
from draftlab.study.answer.report import summarize
from draftlab.study.run.store import ResultsStore
from draftlab.study.run.sweep import SweepConfig, run_sweep


def bench_speedups(decoder, prompts, args) -> tuple[float, float]:
    summary = run_bench(decoder, prompts, BenchSettings(args.max_new_tokens, warmup=1, host_baselines=False),
                        progress=False).summary()
    return summary["speedup"], summary["decode_speedup"]


def sweep_speedups(args, where: Path) -> tuple[float, float]:
    config = SweepConfig(targets=(args.target,), drafters=(args.drafter,), ks=(args.k,), methods=("ar", "sps"),
                         datasets=(args.dataset,), limit=args.limit, max_new_tokens=args.max_new_tokens,
                         backend=args.backend, host_baselines=False, baseline_every=0, race_after=0)
    store = ResultsStore(where)
    run_sweep(config, store, progress=False)
    rows = store.rows()
    store.close()
    cell = next(s for s in summarize(rows) if s.method == "sps" and s.dataset != "all")
    return cell.speedup, cell.decode_speedup


def race_speedups(decoder, plain, prompts, args) -> tuple[float, float]:
    key = (args.drafter, args.k)
    measured = run_round({PLAIN: plain, key: decoder}, [PLAIN, key], encode(decoder.target, prompts),
                         RunSettings(args.max_new_tokens))
    return measured.speedup(key, PLAIN, END_TO_END), measured.speedup(key, PLAIN, DECODE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--dataset", default="code-edit")
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    prompts = load_prompts(args.dataset, args.limit)
    decoder = SpeculativeDecoder.from_names(args.target, drafter=args.drafter, k=args.k, backend=args.backend)
    plain = SpeculativeDecoder.from_names(decoder.target, drafter="none", k=1, backend=args.backend)
    results: dict[str, list[tuple[float, float]]] = {"bench": [], "sweep": [], "race": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            results["bench"].append(bench_speedups(decoder, prompts, args))
            results["sweep"].append(sweep_speedups(args, Path(tmp) / f"study-{repeat}.sqlite"))
            results["race"].append(race_speedups(decoder, plain, prompts, args))
            print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
    print(f"{args.target} {args.drafter} K={args.k}, {len(prompts)} {args.dataset} prompts, "
          f"{args.max_new_tokens} new tokens, backend {args.backend} ({decoder.target_backend.numerics})")
    print(f"{'method':<8}{'end-to-end speedup, each repeat':<36}{'decode-only speedup, each repeat':<36}")
    for method, runs in results.items():
        print(f"{method:<8}{'  '.join(f'{e:.3f}x' for e, _ in runs):<36}{'  '.join(f'{d:.3f}x' for _, d in runs):<36}")
    every = [x for runs in results.values() for x in runs]
    spread = {kind: (max(v[i] for v in every) - min(v[i] for v in every)) / statistics.median(v[i] for v in every)
              for i, kind in enumerate(("end_to_end", "decode"))}
    noise = {kind: max((max(r[i] for r in runs) - min(r[i] for r in runs)) / statistics.median(r[i] for r in runs)
                       for runs in results.values()) for i, kind in enumerate(("end_to_end", "decode"))}
    print(f"spread across all methods and repeats: end to end {spread['end_to_end']:.1%}, decode {spread['decode']:.1%};"
          f" largest spread between repeats of one method: end to end {noise['end_to_end']:.1%}, "
          f"decode {noise['decode']:.1%}")
    print(f"command: python {' '.join(sys.argv)}")
    print(f"host CPU flags: {' '.join(sorted(f for f in cpu_flags() if f.startswith(('avx', 'amx'))))}")
    print(json.dumps({"args": vars(args), "speedups": results, "spread": spread, "repeat_noise": noise,
                      "cpu_flags": sorted(cpu_flags())}))


if __name__ == "__main__":
    main()

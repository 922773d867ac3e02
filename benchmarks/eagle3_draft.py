"""The EAGLE-3 draft against the shipped EAGLE-1-style (feature) draft, on held-out prompts, in one sweep.

For each dataset (HumanEval after the 60 prompts both drafts trained on, MT-Bench after its first 40), runs
draftlab's engine with each draft at the given K values (chains, and a tree) beside plain decoding, and prints
tokens per step (the papers' TAR: committed tokens / target passes), acceptance, tokens/s and the ratios
EAGLE-3 / designed. Greedy, so every output must equal plain decoding's (the `identical` column). Last line: JSON.

    python benchmarks/eagle3_draft.py --limit 20 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from draftlab.study.answer.report import summarize
from draftlab.study.run.store import ResultsStore
from draftlab.study.run.sweep import SweepConfig, run_sweep

HELD_OUT = {"humaneval": 60, "mt-bench": 40}  # prompts the shipped drafts' training text holds, per set


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--eagle3", default="eagle3", help="drafter spec of the EAGLE-3 draft (default: the shipped)")
    parser.add_argument("--baseline", default="designed", help="drafter spec it is compared with")
    parser.add_argument("--datasets", nargs="+", default=list(HELD_OUT))
    parser.add_argument("--ks", type=int, nargs="+", default=[3])
    parser.add_argument("--tree", default="tree:2x2x1", help="also grow this tree shape from each draft ('' for none)")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--host-baselines", action="store_true",
                        help="also time plain decoding in the host's other dtypes (the fastest plain decoding)")
    parser.add_argument("--db", default=None)
    args = parser.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    drafts = [args.baseline, args.eagle3]
    drafters = tuple(drafts + ([f"{args.tree}:{d}" for d in drafts] if args.tree else []))
    db = Path(args.db) if args.db else Path(tempfile.mkdtemp()) / "eagle3.sqlite"
    results = {}
    for dataset in args.datasets:
        config = SweepConfig(targets=(args.target,), drafters=drafters, ks=tuple(args.ks), methods=("sps",),
                             datasets=(dataset,), limit=args.limit, skip=HELD_OUT.get(dataset, 0),
                             max_new_tokens=args.max_new_tokens, dtype=args.dtype,
                             host_baselines=args.host_baselines)
        store = ResultsStore(db)
        run_sweep(config, store)
        rows = store.rows()
        store.close()
        results[dataset] = report(dataset, [s for s in summarize(rows) if s.dataset == dataset], args)
    print("reproduce: python " + " ".join(sys.argv))
    print(json.dumps({"target": args.target, "results": results, "db": str(db)}))


def report(dataset: str, cells, args) -> dict:
    """Print one dataset's table and ratios; the figures as a dict."""
    plain = next(s for s in cells if s.method == "ar")
    print(f"\n{dataset}: {plain.prompts} prompts after the first {HELD_OUT.get(dataset, 0)}, {args.max_new_tokens} new "
          f"tokens, greedy; plain decoding {plain.tokens_per_s:.1f} tok/s")
    print(f"{'drafter':<34}{'K':>3}{'tokens/step':>12}{'accept':>8}{'tok/s':>8}{'vs plain':>9}{'identical':>10}")
    figures = {"plain_tokens_per_s": plain.tokens_per_s, "cells": {}}
    for s in sorted((c for c in cells if c.method == "sps"), key=lambda c: (c.drafter, c.k)):
        print(f"{s.drafter:<34}{s.k:>3}{s.tokens_per_step:>12.2f}{s.acceptance_rate:>8.1%}{s.tokens_per_s:>8.1f}"
              f"{s.speedup:>8.2f}x{s.identical:>6}/{s.prompts}")
        figures["cells"][f"{s.drafter}@{s.k}"] = {"tokens_per_step": s.tokens_per_step, "tokens_per_s": s.tokens_per_s,
                                                  "speedup": s.speedup, "identical": s.identical, "prompts": s.prompts}
    for k in args.ks:
        prefixes = [""] + ([f"{args.tree}:"] if args.tree else [])
        for prefix in prefixes:
            base, new = figures["cells"].get(f"{prefix}{args.baseline}@{k}"), figures["cells"].get(
                f"{prefix}{args.eagle3}@{k}")
            if base and new:
                ratio = new["tokens_per_step"] / base["tokens_per_step"]
                figures[f"{prefix}ratio@{k}"] = ratio
                print(f"{prefix or 'chain:'} K={k}: EAGLE-3 {new['tokens_per_step']:.2f} tokens/step vs "
                      f"{base['tokens_per_step']:.2f}: {ratio:.2f}x (mark 1.2x)")
    return figures


if __name__ == "__main__":
    main()

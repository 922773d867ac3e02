"""Chains against token trees and the confidence stop, for one draft or several, on the same prompts in one run.

Runs the sweep (our engine, baseline re-timed between cells) over each draft as
a chain at K = 1..K_max and over each tree spec at each depth, then prints per
configuration: tok/s, speedup against the baseline closest in time, tokens per
step, drafted tokens per step (a tree's node count), and identical outputs,
then each draft's best chain against its best tree.
Then (unless --no-predict) calibrates every spec at the deepest K on the same
prompts and prints the performance model's decode throughput beside the
measured one (prefill excluded, as the model does), with the error.
Last line: JSON.

    python benchmarks/trees.py --draft designed --trees 2 3x1 2x2 dyn-2-6 1@0.3 --depths 1 2 3
    python benchmarks/trees.py --trees 2 2x2 --depths 1 2 --limit 4   # about 10 minutes on 2 cores
    python benchmarks/trees.py --drafts designed model:HEADS_DIR --trees 2 2x2 --depths 1 2 3 --limit 4
    python benchmarks/trees.py --trees 1 2 --guide ngram --depths 1 2 3 --dataset humaneval --limit 4

`--guide ngram` adds each tree merged with n-gram lookup (`merged:ngram/tree:SHAPE:DRAFT`): the
n-gram continuation is one branch, the draft's tokens the others.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--drafts", "--draft", nargs="+", default=["designed"],
                        help="drafter specs with logits (designed, layers:..., model:DIR of a draft or heads)")
    parser.add_argument("--trees", nargs="+", default=["2", "3x1", "2x2", "dyn-2-6", "1@0.3"])
    parser.add_argument("--depths", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--guide", default=None, help="also run every tree merged with this n-gram guide (ngram[:A-B])")
    parser.add_argument("--dataset", default="heldout")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--db", default=None)
    parser.add_argument("--no-predict", action="store_true", help="skip the calibration and the model's check")
    args = parser.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    specs = [spec for draft in args.drafts for spec in [draft, *tree_specs(draft, args.trees, args.guide)]]
    db = Path(args.db) if args.db else Path(tempfile.mkdtemp()) / "trees.sqlite"
    config = SweepConfig(targets=(args.target,), drafters=tuple(specs), ks=tuple(args.depths), methods=("sps",),
                         datasets=(args.dataset,), limit=args.limit, max_new_tokens=args.max_new_tokens,
                         dtype=args.dtype)
    store = ResultsStore(db)
    run_sweep(config, store)
    rows, checks = store.rows(), store.baseline_checks()
    store.close()
    summaries = [s for s in summarize(rows, checks) if s.dataset == args.dataset]  # not the 'all' duplicates
    cells = [s for s in summaries if s.method == "sps"]
    ar = next(s for s in summaries if s.method == "ar")
    print(f"target={args.target} dtype={args.dtype} dataset={args.dataset} prompts={args.limit} "
          f"max_new_tokens={args.max_new_tokens}; autoregressive {ar.tokens_per_s:.1f} tok/s")
    print(f"{'drafter':<34}{'K':>3}{'tok/s':>8}{'speedup':>9}{'tokens/step':>12}{'drafted/step':>13}{'identical':>10}")
    results = []
    for s in sorted(cells, key=lambda s: (specs.index(s.drafter), s.k)):
        drafted = _drafted_per_step(rows, s.drafter, s.k)
        print(f"{s.drafter:<34}{s.k:>3}{s.tokens_per_s:>8.1f}{s.speedup:>8.2f}x{s.tokens_per_step:>12.2f}"
              f"{drafted:>13.2f}{s.identical:>7}/{s.prompts}")
        results.append({"drafter": s.drafter, "k": s.k, "tokens_per_s": s.tokens_per_s, "speedup": s.speedup,
                        "tokens_per_step": s.tokens_per_step, "drafted_per_step": drafted,
                        "identical": s.identical, "prompts": s.prompts})
    best = max(results, key=lambda r: r["speedup"])
    for draft in args.drafts:
        print(_chain_vs_tree(draft, results))
    print(f"best: {best['drafter']} K={best['k']} at {best['speedup']:.2f}x plain decoding")
    model = None if args.no_predict else check_model(args, specs, rows)
    print("reproduce: python " + " ".join(sys.argv))
    print(json.dumps({"autoregressive_tokens_per_s": ar.tokens_per_s, "cells": results, "model": model,
                      "db": str(db)}))


def tree_specs(draft: str, shapes: list[str], guide: str | None) -> list[str]:
    """The tree of each shape grown by `draft`, then (with a guide) each merged with it."""
    trees = [f"tree:{shape}:{draft}" for shape in shapes]
    return trees + ([f"merged:{guide}/{tree}" for tree in trees] if guide else [])


def check_model(args, specs: list[str], rows: list[dict]) -> dict:
    """Calibrate every spec at the deepest K on the benchmark's prompts; predicted vs measured decode tok/s."""
    from draftlab.files.datasets import load_prompts
    from draftlab.models import load_model
    from draftlab.perf.calibrate import CalibrationSettings, calibrate
    from draftlab.perf.validate import compare, error_summary

    target = load_model(args.target, dtype=args.dtype)
    target.name = args.target
    settings = CalibrationSettings(k_max=max(args.depths), max_new_tokens=args.max_new_tokens)
    profile = calibrate(target, specs, load_prompts(args.dataset, args.limit), settings)
    comparisons = [c for c in compare(profile, rows) if c.k in args.depths]
    print(f"performance model (calibrated at K={settings.k_max} in {profile.seconds:.0f}s), decode tok/s:")
    print(f"{'drafter':<34}{'K':>3}{'measured':>10}{'predicted':>11}{'interval':>14}{'error':>8}")
    for c in comparisons:
        interval = f"{c.interval[0]:.1f}-{c.interval[1]:.1f}"
        print(f"{c.draft:<34}{c.k:>3}{c.measured_tokens_per_s:>10.1f}{c.simplified_tokens_per_s:>11.1f}"
              f"{interval:>14}{c.simplified_error:>7.1%}" + (f"  {c.cause}" if c.cause else ""))
    errors = error_summary(comparisons)
    trees = [c.simplified_error for c in comparisons if c.draft.startswith(("tree:", "merged:"))]
    print(f"model error: all cells mean {errors['simplified_mean_error']:.1%} max {errors['simplified_max_error']:.1%}"
          + (f"; trees mean {sum(trees) / len(trees):.1%} max {max(trees):.1%}" if trees else "")
          + f" (target <= 10%); inside the interval {errors['inside_interval']:.0%}")
    return {**errors, "tree_max_error": max(trees, default=0.0)}


def _chain_vs_tree(draft: str, results: list[dict]) -> str:
    """One line: the draft's best chain, its best tree, and their throughput ratio."""
    chains = [r for r in results if r["drafter"] == draft]
    trees = [r for r in results if r["drafter"].startswith(("tree:", "merged:")) and r["drafter"].endswith(":" + draft)]
    if not chains or not trees:
        return f"{draft}: no chain or no tree ran"
    chain, tree = max(chains, key=lambda r: r["speedup"]), max(trees, key=lambda r: r["speedup"])
    return (f"{draft}: best chain K={chain['k']} {chain['speedup']:.2f}x, best tree {tree['drafter']} K={tree['k']} "
            f"{tree['speedup']:.2f}x: the tree is {tree['tokens_per_s'] / chain['tokens_per_s']:.2f}x the chain")


def _drafted_per_step(rows: list[dict], drafter: str, k: int) -> float:
    """Tokens drafted per step (a tree's node count) over the records of one configuration."""
    mine = [r for r in rows if r["drafter"] == drafter and r["k"] == k and r["method"] == "sps"]
    return sum(r["drafted"] for r in mine) / max(1, sum(r["steps"] for r in mine))


if __name__ == "__main__":
    main()

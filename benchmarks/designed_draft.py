"""A designed (pruned + distilled) draft against undistilled layer self-drafts and plain decoding.

On MT-Bench prompts (where n-gram lookup gains little), sweeps our engine over
each draft at K = 1..K_max, takes each draft's best K, and prints throughput,
the ratios designed / best undistilled self-draft and designed / autoregressive,
and the acceptance and latency numbers that explain them. Last line: JSON.

    python benchmarks/designed_draft.py --designed designs/smollm2-d2 --limit 8
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
    parser.add_argument("--designed", nargs="+", required=True, help="designed draft directories")
    parser.add_argument("--self-drafts", nargs="+", default=["layers:0-1", "layers:0-3", "layers:0-7"])
    parser.add_argument("--dataset", default="mt-bench")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--skip", type=int, default=0,
                        help="pass over the first prompts (in round-robin order): those the draft was trained on")
    parser.add_argument("--k-max", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--db", default=None)
    args = parser.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    designed = [f"model:{d}" for d in args.designed]
    db = Path(args.db) if args.db else Path(tempfile.mkdtemp()) / "designed.sqlite"
    config = SweepConfig(targets=(args.target,), drafters=tuple(args.self_drafts + designed),
                         ks=tuple(range(1, args.k_max + 1)), methods=("sps",), datasets=(args.dataset,),
                         limit=args.limit, skip=args.skip, max_new_tokens=args.max_new_tokens)
    store = ResultsStore(db)
    run_sweep(config, store)
    rows = store.rows()
    store.close()
    cells = [s for s in summarize(rows) if s.dataset == args.dataset]
    ar = next(s for s in cells if s.method == "ar")
    best = {}
    for s in cells:
        if s.method == "sps" and (s.drafter not in best or s.tokens_per_s > best[s.drafter].tokens_per_s):
            best[s.drafter] = s
    print(f"target={args.target} dataset={args.dataset} prompts={args.limit} (after skipping {args.skip}) K=1..{args.k_max} "
          f"max_new_tokens={args.max_new_tokens}")
    print(f"{'draft':<44}{'best K':>7}{'tok/s':>8}{'vs AR':>8}{'TAR':>6}{'accept':>8}{'draft ms/step':>14}{'target ms/step':>15}")
    print(f"{'autoregressive':<44}{'-':>7}{ar.tokens_per_s:>8.1f}{1.0:>7.2f}x")
    for name, s in best.items():
        print(f"{name:<44}{s.k:>7}{s.tokens_per_s:>8.1f}{s.speedup:>7.2f}x{s.tokens_per_step:>6.2f}"
              f"{s.acceptance_rate:>8.1%}{s.draft_ms_per_step:>14.1f}{s.target_ms_per_step:>15.1f}")
    best_self = max((best[d] for d in args.self_drafts), key=lambda s: s.tokens_per_s)
    results = {}
    for d in designed:
        s = best[d]
        results[d] = {"k": s.k, "tokens_per_s": s.tokens_per_s, "over_best_self_draft": s.tokens_per_s / best_self.tokens_per_s,
                      "over_autoregressive": s.speedup, "tokens_per_step": s.tokens_per_step,
                      "acceptance_rate": s.acceptance_rate, "identical": s.identical}
        print(f"{d}: {results[d]['over_best_self_draft']:.2f}x the best undistilled self-draft "
              f"({best_self.drafter} K={best_self.k}; target >= 1.3x), {s.speedup:.2f}x autoregressive (target >= 1.5x), "
              f"identical outputs {s.identical}/{s.prompts}")
    print("reproduce: python " + " ".join(sys.argv))
    print(json.dumps({"autoregressive_tokens_per_s": ar.tokens_per_s, "best_self_draft": [best_self.drafter, best_self.k,
                      best_self.tokens_per_s], "designed": results, "db": str(db)}))


if __name__ == "__main__":
    main()

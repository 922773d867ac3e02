"""Does `tune` find the best (draft, K) at a fraction of an exhaustive sweep's cost?

Runs, on the same prompts and in one process:
  1. an exhaustive sweep of our engine over every candidate draft and K = 1..K_max
     (sps cells only) into a study database, timed;
  2. `tune` (calibrate, predict with intervals, race the contenders against plain
     decoding with successive halving), timed;
then prints the best cell of the sweep, the cell the tuner picked, the regret
(how much slower the pick measured in the sweep than the best cell), the
ratio of wall times, and the model's errors against the sweep: in absolute
tokens/s, and anchored to the sweep's own plain decoding (re-timed every
`--baseline-every` cells; the re-timings are left out of the sweep's time),
so that a change of the machine's speed between calibration and sweep cancels.
  4. the model checked on its own: a full calibration (every prompt, full length,
     no budget) after the tune, and its errors against the sweep, absolute and
     anchored; tune's own profile is cut to its budget (fewer prompts, shorter
     runs), so its errors mix the model's with what the budget left unmeasured.
  3. when the pick is not the sweep's best, a head-to-head check: both cells and
     plain decoding re-run interleaved on the same prompts (`--confirm` rounds),
     since the best of many single-shot cells is biased upward by their noise
     (the winner's curse); the confirmed regret is printed beside the sweep's.
The last line of stdout is one JSON document.

    python benchmarks/tune_vs_sweep.py --drafts ngram ngram:2-4 layers:0-3 --limit 2
    python benchmarks/tune_vs_sweep.py --drafts ngram layers:0-3 --dataset my_prompts.jsonl --limit 4
    python benchmarks/tune_vs_sweep.py --drafts ngram ngram:2-4 layers:0-3 --limit 2 --budget-share 0  # no budget
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from draftlab.perf.calibrate import CalibrationSettings
from draftlab.models import load_model
from draftlab.study.answer.report import summarize
from draftlab.study.run.store import ResultsStore
from draftlab.study.run.sweep import SweepConfig, run_sweep
from draftlab.files.datasets import load_prompts
from draftlab.perf.halving import PLAIN
from draftlab.perf.sizing import TuneSettings
from draftlab.perf.validate import compare, error_summary, measured_cells
from draftlab.perf.tuner import tune


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--drafts", nargs="+", default=["ngram", "ngram:2-4", "layers:0-3", "layers:0-7"])
    parser.add_argument("--dataset", default="mixed", help="a bundled prompt set or a JSONL prompt file")
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--k-max", type=int, default=7)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--budget", type=float, default=None, help="tune's time budget in seconds")
    parser.add_argument("--budget-share", type=float, default=0.2,
                        help="tune's budget as a share of the sweep's measured time (default 0.2, inside the 25%% "
                             "target; 0: no budget); --budget wins")
    parser.add_argument("--confirm", type=int, default=2,
                        help="interleaved rounds of the head-to-head check of pick vs sweep best (0: none)")
    parser.add_argument("--baseline-every", type=int, default=6,
                        help="re-time plain decoding after this many cells of a prompt in the sweep, to anchor the "
                             "model's predictions to (0: never; their time is not counted as the sweep's)")
    parser.add_argument("--no-full-calibration", action="store_true",
                        help="skip step 4, the model's check from a calibration without budget")
    parser.add_argument("--db", default=None, help="keep the sweep database here (default: a temporary file)")
    args = parser.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    db = Path(args.db) if args.db else Path(tempfile.mkdtemp()) / "sweep.sqlite"
    config = SweepConfig(targets=(args.target,), drafters=tuple(args.drafts), ks=tuple(range(1, args.k_max + 1)),
                         methods=("sps",), datasets=(args.dataset,), limit=args.limit,
                         max_new_tokens=args.max_new_tokens,
                         baseline_every=args.baseline_every)
    store = ResultsStore(db)
    start = time.perf_counter()
    run_sweep(config, store)
    rows, checks = store.rows(), store.baseline_checks()
    store.close()
    sweep_s = time.perf_counter() - start - sum(c["wall_s"] for c in checks)  # an exhaustive sweep needs no re-checks

    target = load_model(args.target)
    target.name = args.target
    prompts = load_prompts(args.dataset, args.limit)
    settings = CalibrationSettings(k_max=args.k_max, max_new_tokens=args.max_new_tokens)
    start = time.perf_counter()
    budget = args.budget or (args.budget_share * sweep_s if args.budget_share else None)
    rec, profile, _ = tune(target, args.drafts, prompts, settings, TuneSettings(budget_s=budget))
    tune_s = time.perf_counter() - start

    summaries = [s for s in summarize(rows) if s.dataset == "all"]
    ar = next(s for s in summaries if s.method == "ar")
    cells = {(s.drafter, s.k): s for s in summaries if s.method == "sps"}
    cells[("none", 0)] = ar  # plain decoding is a configuration too: the best when no draft pays
    best = max(cells.values(), key=lambda s: s.tokens_per_s)
    picked = cells.get((rec.draft, rec.k))
    picked_tps = picked.tokens_per_s if picked else ar.tokens_per_s
    regret = best.tokens_per_s / picked_tps - 1.0
    comparisons = compare(profile, rows)
    errors = error_summary(comparisons)
    anchored = compare(profile, rows, checks)
    anchored_errors = error_summary(anchored)
    plain_decode = measured_cells(rows, method="ar")[PLAIN].tokens_per_s  # the sweep's, prefill excluded
    relative = speedup_errors(comparisons, profile.target.autoregressive_tokens_per_s, plain_decode)
    full = None if args.no_full_calibration else full_check(target, args.drafts, prompts, settings, rows, checks)
    confirmed = None
    if args.confirm and (best.drafter, best.k) != (rec.draft, rec.k):
        confirmed = head_to_head(target, (best.drafter, best.k), (rec.draft, rec.k), prompts, settings, args.confirm)
    print(f"target={args.target} dataset={args.dataset} prompts={args.limit} K=1..{args.k_max} drafts={' '.join(args.drafts)}")
    print(f"exhaustive sweep: {len(cells) - 1} cells in {sweep_s:.0f}s; best {best.drafter} K={best.k}: "
          f"{best.tokens_per_s:.1f} tok/s ({best.speedup:.2f}x over AR {ar.tokens_per_s:.1f})")
    raced = f"{rec.measured_speedup:.2f}x in its race" if rec.measured_speedup else "not raced"
    print(f"tune: budget {'none' if budget is None else f'{budget:.0f}s'}; picked {rec.draft} K={rec.k} in {tune_s:.0f}s (predicted {rec.predicted_tokens_per_s:.1f} tok/s, "
          f"{raced}); that cell measured {picked_tps:.1f} tok/s in the sweep")
    for number, round_ in enumerate(rec.race, start=1):
        speedups = ", ".join(f"{name} {x:.2f}x" for name, x in round_["speedups"].items())
        print(f"tune race round {number} ({round_['prompts']} prompt(s), {round_['tokens']} tokens): {speedups}")
    for note in rec.notes:
        print(f"tune note: {note}")
    print(f"regret {regret:.1%} (target <= 5%), tune time / sweep time {tune_s / sweep_s:.1%} (target <= 25%)")
    if confirmed is not None:
        print(f"head-to-head ({args.confirm} interleaved rounds on the same prompts): sweep best "
              f"{confirmed['best_speedup']:.3f}x, pick {confirmed['picked_speedup']:.3f}x plain decoding; "
              f"confirmed regret {confirmed['regret']:.1%}")
    else:
        print("head-to-head: not needed (the pick is the sweep's best)" if args.confirm else "head-to-head: skipped")
    print(f"model vs sweep (decode tok/s): simplified mean {errors['simplified_mean_error']:.1%} max "
          f"{errors['simplified_max_error']:.1%}; Leviathan mean {errors['leviathan_mean_error']:.1%} max "
          f"{errors['leviathan_max_error']:.1%}; measured inside the predicted interval in "
          f"{errors['inside_interval']:.0%} of cells ({errors['large_errors_inside_interval']:.0%} of those off by > 10%)")
    print_large_errors(comparisons)
    print(f"model vs sweep as speedups over each one's own plain decoding (calibration's {relative['calibration_ar']:.1f} "
          f"tok/s, the sweep's {relative['sweep_ar']:.1f}; the machine's speed between them cancels): simplified mean "
          f"{relative['mean_error']:.1%} max {relative['max_error']:.1%}")
    factors = [c.anchor for c in anchored]
    print(f"model vs sweep anchored to the sweep's plain decoding closest in time ({len(checks)} re-timings; "
          f"anchors {min(factors):.2f}-{max(factors):.2f}): simplified mean {anchored_errors['simplified_mean_error']:.1%} "
          f"max {anchored_errors['simplified_max_error']:.1%}; Leviathan mean {anchored_errors['leviathan_mean_error']:.1%} "
          f"max {anchored_errors['leviathan_max_error']:.1%}; measured inside the predicted interval in "
          f"{anchored_errors['inside_interval']:.0%} of cells ({anchored_errors['large_errors_inside_interval']:.0%} of "
          "those off by > 10%)")
    print_large_errors(anchored)
    if full is not None:
        print(f"model from a full calibration ({full['prompts']} prompts, {args.max_new_tokens} tokens, "
              f"{full['seconds']:.0f}s) vs sweep: simplified mean {full['errors']['simplified_mean_error']:.1%} max "
              f"{full['errors']['simplified_max_error']:.1%}, inside the interval in {full['errors']['inside_interval']:.0%} "
              f"of cells ({full['errors']['large_errors_inside_interval']:.0%} of those off by > 10%); anchored: mean "
              f"{full['anchored']['simplified_mean_error']:.1%} max {full['anchored']['simplified_max_error']:.1%}, "
              f"inside {full['anchored']['inside_interval']:.0%} ({full['anchored']['large_errors_inside_interval']:.0%})")
        print_large_errors(full["comparisons"])
    print("reproduce: python " + " ".join(sys.argv))
    print(json.dumps({"sweep_s": sweep_s, "tune_s": tune_s, "best": [best.drafter, best.k, best.tokens_per_s],
                      "picked": [rec.draft, rec.k, picked_tps], "regret": regret, "time_ratio": tune_s / sweep_s,
                      "confirmed": confirmed, "errors": errors, "speedup_errors": relative,
                      "anchored_errors": anchored_errors,
                      "full_calibration": None if full is None else {k: v for k, v in full.items() if k != "comparisons"},
                      "db": str(db)}))


def full_check(target, drafts, prompts, settings, rows, checks) -> dict:
    """The model's errors against the sweep from a calibration on every prompt at full length, without budget."""
    from draftlab.perf.calibrate import calibrate

    profile = calibrate(target, drafts, prompts, settings)
    comparisons = compare(profile, rows)
    return {"prompts": len(prompts), "seconds": profile.seconds, "errors": error_summary(comparisons),
            "anchored": error_summary(compare(profile, rows, checks)), "comparisons": comparisons}


def print_large_errors(comparisons) -> None:
    """One line per cell the simplified model misses by more than 10%: its interval and the cause."""
    for c in sorted(comparisons, key=lambda c: -c.simplified_error):
        if c.simplified_error > 0.10:
            inside = "inside" if c.inside_interval else "OUTSIDE"
            print(f"  large error: {c.draft} K={c.k} measured {c.measured_tokens_per_s:.1f}, predicted "
                  f"{c.simplified_tokens_per_s:.1f} ({c.interval[0]:.1f}-{c.interval[1]:.1f}, {inside}), "
                  f"off by {c.simplified_error:.1%}: {c.cause}")


def speedup_errors(comparisons, calibration_ar: float, sweep_ar: float) -> dict:
    """The simplified model's error on speedups: each prediction over calibration's plain decoding, each cell
    over the sweep's, so that a change of the machine's speed between calibration and sweep cancels."""
    errors = [abs((c.simplified_tokens_per_s / calibration_ar) / (c.measured_tokens_per_s / sweep_ar) - 1.0)
              for c in comparisons]
    return {"calibration_ar": calibration_ar, "sweep_ar": sweep_ar, "mean_error": sum(errors) / len(errors),
            "max_error": max(errors)}


def head_to_head(target, best: tuple[str, int], picked: tuple[str, int], prompts, settings, rounds: int) -> dict:
    """Re-measure the sweep's best and the pick beside plain decoding, interleaved, on the same prompts (the race's
    rounds, decode speedups)."""
    from draftlab.api import SpeculativeDecoder
    from draftlab.measure import RunSettings
    from draftlab.perf.halving import encode, race_speedup, run_round

    keys = list(dict.fromkeys([PLAIN, best, picked]))
    decoders = {key: SpeculativeDecoder.from_names(target, drafter=key[0], k=max(key[1], 1), backend=settings.backend)
                for key in keys}
    encoded = encode(target, prompts)
    measured = [run_round(decoders, keys, encoded, RunSettings(settings.max_new_tokens)) for _ in range(rounds)]
    best_speedup, picked_speedup = race_speedup(measured, best), race_speedup(measured, picked)
    return {"best_speedup": best_speedup, "picked_speedup": picked_speedup,
            "regret": best_speedup / picked_speedup - 1.0, "rounds": rounds}


if __name__ == "__main__":
    main()

"""Does a shape-only profile predict measured decoding? Predicted against measured tok/s per (draft, K), in one run.

The prediction's two halves come from two places (`draftlab.perf.shapes`): the target's block costs from random
weights in the model's shape (`calibrate_shape`, no weights), and acceptance, the drafted block sizes and the
host-side costs per step from decodes of the real model (this run's, or a study's with `--acceptance-from`). The
measured side is the real model decoding the same prompts through the measurement loop, on the same device.

A shared host's speed drifts by more than 10% between runs, so both sides are timed in one run, interleaved: each
round calibrates the shape, then decodes every prompt with plain decoding and every (draft, K); the profile that
predicts a round is the mean of the calibrations before and after it. The profile is timed after the prompts' mean
context (mean prompt length plus half the new tokens). Trees are reported apart: the profile times one tree shape
per size (two paths from the root), a drafter's trees take many.

    python benchmarks/shape_prediction.py                                    # SmolLM2-135M, fp32, on the CPU
    python benchmarks/shape_prediction.py --acceptance-from results/study.sqlite --rounds 3
    python benchmarks/shape_prediction.py --drafters ngram designed merged:ngram/tree:1:designed   # trees too
    python benchmarks/shape_prediction.py --device cuda --dtype bf16         # where a GPU and the model are at hand

The last line of stdout is one JSON document. Run it alone: it is a benchmark.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, replace

from draftlab.api import SpeculativeDecoder, prompt_ids
from draftlab.backends.routes import cpu_flags
from draftlab.files.datasets import load_prompts
from draftlab.checks.exactness import shapes_named
from draftlab.measure import EncodedPrompt, RunSettings, measure
from draftlab.perf.calibrate import Profile
from draftlab.perf.throughput import TargetProfile
from draftlab.perf.shapes import StepCounts, acceptance, calibrate_shape, format_predicted, predict_from
from draftlab.decoding.policy import FixedK
from draftlab.registry import build_drafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--shape", default="smollm2-135m", help="the target's shape (draftlab.checks.exactness.SHAPES)")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--drafters", nargs="+", default=["ngram", "designed"])
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--prompts", default="heldout")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=4, help="rounds of each calibration's block timings")
    parser.add_argument("--acceptance-from", metavar="STUDY", help="acceptance from this study (run anywhere) "
                        "instead of this run's decodes; the measured side stays this run's")
    args = parser.parse_args()
    flags = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))))
    print(f"host CPU flags: {flags}; device {args.device}, {args.dtype}")
    base = SpeculativeDecoder.from_names(args.target, drafter="none", k=1, device=args.device, dtype=args.dtype)
    decoders = {("plain", 0): base}
    for spec in args.drafters:
        drafter = build_drafter(spec, base.target, base.backend).drafter
        decoders.update({(spec, k): base.with_drafter(drafter).with_policy(FixedK(k)) for k in args.ks})
    prompts = [EncodedPrompt(p.id, p.category, prompt_ids(base.target.tokenizer, p))
               for p in load_prompts(args.prompts, limit=args.limit)]
    context = int(statistics.fmean(len(p.ids) for p in prompts) + args.max_new_tokens / 2)
    shape = shapes_named([args.shape])[0]
    settings = RunSettings(args.max_new_tokens)
    calibrations = [calibrate_shape(shape, args.dtype, args.device, {}, args.repeats, context)]
    rounds = []
    for r in range(args.rounds):
        # the first round warms every contender on every prompt (its longest prefill included): first calls pay
        # one-off costs, and in a process's first minutes they ran its decodes ~20% slower than its later rounds
        measured = measure(decoders, prompts, settings, warmup=len(prompts) if r == 0 else 0,
                           progress=f"round {r + 1}")
        calibrations.append(calibrate_shape(shape, args.dtype, args.device, {}, args.repeats, context))
        rounds.append(compare(mean_profile(calibrations[-2:]), measured.records, args))
    report(rounds, calibrations, context, flags, args)


def compare(profile: Profile, records: dict, args) -> dict:
    """One round: each cell's prediction (this round's profile; acceptance from this round or the study) beside
    its decode tok/s measured in this round."""
    cells = {key: acceptance(key[0], key[1], args.device, [counts(r.stats) for r in runs])
             for key, runs in records.items() if key[0] != "plain"}
    if args.acceptance_from:
        from draftlab.study.answer.transfer import acceptance_from

        elsewhere = {(c.drafter, c.k): c for c in acceptance_from(args.acceptance_from)[0]}
        cells = {key: replace(elsewhere[key], measured_tokens_per_s=cell.measured_tokens_per_s, device=args.device)
                 for key, cell in cells.items() if key in elsewhere}
    rows = predict_from(profile, list(cells.values()), same_device=True)
    plain = acceptance("plain", 0, args.device, [counts(r.stats) for r in records[("plain", 0)]])
    return {"profile": profile, "rows": rows, "plain_measured": plain.measured_tokens_per_s}


def counts(stats) -> StepCounts:
    """A decode's counts, as a study's records hold them."""
    return StepCounts(stats.steps, stats.new_tokens, tuple(stats.drafted_per_step_list), stats.has_trees,
                      stats.draft_s, stats.overhead_s, stats.wall_s - stats.prefill_s)


def mean_profile(profiles: list[Profile]) -> Profile:
    """The mean of calibrations (before and after a round): block costs and overhead per step averaged."""
    first = profiles[0].target
    blocks = {n: statistics.fmean(p.target.score_s[n] for p in profiles) for n in first.score_s}
    overhead = statistics.fmean(p.target.overhead_s_per_step for p in profiles)
    trees = {n: statistics.fmean(p.target.tree_s[n] for p in profiles) for n in first.tree_s}
    target = TargetProfile(first.name, blocks, overhead, first.score_spread, first.drift, trees)
    return Profile(target, [], profiles[0].context_tokens, sum(p.seconds for p in profiles), profiles[0].device)


def report(rounds: list[dict], calibrations: list[Profile], context: int, flags: str, args) -> None:
    """Each round's table, then the errors over all rounds (chains and trees apart), and one JSON line."""
    for i, result in enumerate(rounds):
        print(f"\nround {i + 1}:")
        print(format_predicted(result["rows"], result["profile"], result["plain_measured"], measured_in="this round"))
    every = [row for result in rounds for row in result["rows"]]
    chains = [abs(row.error) for row in every if not row.tree and row.error is not None]
    trees = [abs(row.error) for row in every if row.tree and row.error is not None]
    plain_errors = [1 / (r["profile"].target.score_s[1] + r["profile"].target.overhead_s_per_step)
                    / r["plain_measured"] - 1 for r in rounds]
    one_token = [1000 * c.target.score_s[1] for c in calibrations]
    print(f"\nover {len(rounds)} round(s), profile timed after {context} cached tokens (one token "
          f"{min(one_token):.2f}-{max(one_token):.2f} ms across {len(calibrations)} calibrations): plain decoding "
          f"error {statistics.fmean(plain_errors):+.1%}; chain cells mean |error| "
          f"{statistics.fmean(chains):.1%} over {len(chains)} (worst {max(chains):.1%})"
          + (f"; tree cells {statistics.fmean(trees):.1%} over {len(trees)}" if trees else ""))
    print(json.dumps({"host_flags": flags, "device": args.device, "dtype": args.dtype, "target": args.target,
                      "shape": args.shape, "context": context, "rounds": len(rounds),
                      "acceptance_from": args.acceptance_from or "this run",
                      "plain_error_mean": statistics.fmean(plain_errors),
                      "chain_error_mean": statistics.fmean(chains), "chain_error_max": max(chains),
                      "chain_cells": len(chains), "tree_error_mean": statistics.fmean(trees) if trees else None,
                      "cells": [{"round": i + 1, **asdict(row)} for i, r in enumerate(rounds) for row in r["rows"]]}))


if __name__ == "__main__":
    main()

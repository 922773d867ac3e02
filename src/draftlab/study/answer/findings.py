"""The seeds' findings beside what draftlab measured: one row per finding, with the cells that show it.

The two studies behind draftlab ("How speculative can speculative decoding
be?" and "Designing draft models for speculative decoding") report six
findings on GPUs. Each function here reads what a study (and, when given, a
calibration profile, a depth/width microbenchmark and a quality-vs-TAR
correlation) measured on this machine and says whether it agrees, partly
agrees, disagrees, or was not measured, with the evidence in one line each.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from draftlab.errors import DraftlabError
from draftlab.study.answer.report import ALL, CellSummary
from draftlab.contenders.methods import ASG, SPS
from draftlab.study.answer.report import comparisons_of

AGREES, PARTLY, DISAGREES, NOT_MEASURED = "agrees", "partly", "disagrees", "not measured"


@dataclass(frozen=True)
class Finding:
    """One finding of the seeds and what this study measured of it."""

    claim: str  # the seeds' finding, in their words where short
    source: str  # which study reported it
    verdict: str  # AGREES, PARTLY, DISAGREES or NOT_MEASURED
    measured: str  # what draftlab measured, one sentence
    evidence: list[str] = field(default_factory=list)  # the cells (or files) that show it


@dataclass(frozen=True)
class Evidence:
    """What a study can be compared on: its cells, parameter counts, and optional extra measurements."""

    summaries: list[CellSummary]
    params: dict[str, int]
    comparisons: list | None = None  # perf.tuner.Comparison of a calibration profile against the study's records
    microbench: list[dict] | None = None  # `draftlab design microbench`'s microbench.json
    correlate: dict | None = None  # `draftlab design correlate`'s correlate.json


def gather_evidence(summaries: list[CellSummary], params: dict[str, int], rows: list[dict],
                    profile_path: str | Path | None = None, microbench_path: str | Path | None = None,
                    correlate_path: str | Path | None = None) -> Evidence:
    """A study's evidence, with the model's comparisons and the design commands' results when their files are given."""
    return Evidence(summaries, params, comparisons_of(profile_path, rows) if profile_path else None,
                    read_json(microbench_path, "microbenchmark"), read_json(correlate_path, "correlation"))


def seeds_findings(evidence: Evidence) -> list[Finding]:
    """The six findings, in the order of the issue that asked for them."""
    return [optimal_k(evidence.summaries), smallest_draft(evidence.summaries, evidence.params),
            depth_not_width(evidence.microbench), accuracy_not_tar(evidence.correlate),
            model_error(evidence.comparisons), sps_beats_asg(evidence.summaries)]


def read_json(path: str | Path | None, what: str):
    """A JSON file written by a design command, or None when no path is given."""
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DraftlabError(f"cannot read the {what} results {path} ({exc}); run the command again") from exc


def _best_sps(summaries: list[CellSummary]) -> dict[tuple, CellSummary]:
    """Per (target, dataset, temperature), the fastest SpS cell (categories only, not 'all')."""
    best: dict[tuple, CellSummary] = {}
    for s in summaries:
        key = (s.target, s.dataset, s.temperature)
        if s.method == SPS.name and s.dataset != ALL and (key not in best or s.speedup > best[key].speedup):
            best[key] = s
    return best


def _cell(s: CellSummary) -> str:
    return f"{s.target} {s.dataset}: {s.drafter} K={s.k} {s.method.upper()} {s.speedup:.2f}x"


def optimal_k(summaries: list[CellSummary]) -> Finding:
    """First study: the optimal number of draft tokens lies in 3-5."""
    claim, source = "The optimal number of draft tokens K lies in 3-5.", "How speculative can SD be? (optimal table)"
    best = _best_sps(summaries)
    ks = sorted({s.k for s in summaries if s.method == SPS.name})
    if not best or max(ks) < 3:
        return Finding(claim, source, NOT_MEASURED, f"this study ran K in {ks or 'none'}: too few to place an optimum")
    inside = [s for s in best.values() if 3 <= s.k <= 5]
    verdict = AGREES if len(inside) == len(best) else DISAGREES if not inside else PARTLY
    found = sorted({s.k for s in best.values()})
    measured = (f"the best K per category is {', '.join(map(str, found))} (K {ks[0]}..{ks[-1]} studied); "
                f"{len(inside)} of {len(best)} categories in 3-5")
    return Finding(claim, source, verdict, measured, [_cell(s) for s in best.values()])


def smallest_draft(summaries: list[CellSummary], params: dict[str, int]) -> Finding:
    """Second study: with today's drafts, the smallest draft is often the best."""
    claim, source = "The smallest draft is often the best.", "Designing draft models (Figure 2, Section 5)"
    per_group: dict[tuple, dict[str, CellSummary]] = defaultdict(dict)
    for s in summaries:
        size = params.get(f"{s.target}::{s.drafter}")
        if s.method != SPS.name or s.dataset == ALL or not size:
            continue
        mine = per_group[(s.target, s.dataset, s.temperature)]
        if s.drafter not in mine or s.speedup > mine[s.drafter].speedup:
            mine[s.drafter] = s
    groups = {key: cells for key, cells in per_group.items() if len(cells) >= 2}
    if not groups:
        return Finding(claim, source, NOT_MEASURED, "fewer than two drafts with parameters ran in one category")
    wins, evidence = 0, []
    for (target, dataset, _), cells in groups.items():
        smallest = min(cells, key=lambda d: params[f"{target}::{d}"])
        best = max(cells.values(), key=lambda s: s.speedup)
        wins += best.drafter == smallest
        evidence.append(f"{target} {dataset}: smallest {smallest} {cells[smallest].speedup:.2f}x, "
                        f"best {best.drafter} {best.speedup:.2f}x")
    verdict = AGREES if wins * 2 > len(groups) else PARTLY if wins else DISAGREES
    return Finding(claim, source, verdict, f"the smallest draft with parameters is the best of them in {wins} of "
                   f"{len(groups)} categories", evidence)


def depth_not_width(microbench: list[dict] | None) -> Finding:
    """Second study: draft latency grows with depth, hardly with width."""
    claim, source = "Draft latency grows with depth and hardly with width.", "Designing draft models (Figure 4)"
    if not microbench:
        return Finding(claim, source, NOT_MEASURED, "no microbenchmark given (draftlab design microbench, then "
                       "draftlab report --microbench DIR/microbench.json)")
    depth = _growth([m for m in microbench if m["series"] == "fixed_width"], "layers")
    width = _growth([m for m in microbench if m["series"] == "fixed_depth"], "hidden")
    if depth is None or width is None:
        return Finding(claim, source, NOT_MEASURED, "the microbenchmark lacks its fixed-width or fixed-depth series")
    (depth_x, depth_span), (width_x, width_span) = depth, width
    verdict = AGREES if width_x < 1.25 <= depth_x else DISAGREES if width_x >= 0.75 * depth_x else PARTLY
    measured = (f"{depth_span:.0f}x the layers cost {depth_x:.2f}x the latency; {width_span:.0f}x the width cost "
                f"{width_x:.2f}x" + (" (on this CPU latency follows the bytes read, so width costs too)"
                                     if verdict != AGREES else ""))
    rows = [f"{m['series']} {m['layers']} layers x {m['hidden']}: {m['ms_per_token']:.2f} ms/token" for m in microbench
            if m["series"] in ("fixed_width", "fixed_depth")]
    return Finding(claim, source, verdict, measured, rows)


def _growth(series: list[dict], key: str) -> tuple[float, float] | None:
    """(latency ratio, size ratio) between the largest and smallest `key` of a series."""
    if len(series) < 2:
        return None
    low, high = min(series, key=lambda m: m[key]), max(series, key=lambda m: m[key])
    return high["ms_per_token"] / low["ms_per_token"], high[key] / low[key]


def accuracy_not_tar(correlate: dict | None) -> Finding:
    """Second study: a draft's accuracy on language tasks does not predict its TAR."""
    claim = "A draft's language-modelling accuracy (MMLU, HellaSwag) does not predict its TAR."
    source = "Designing draft models (Figure 5, Figure 10)"
    if not correlate or len(correlate.get("drafts", [])) < 3:
        return Finding(claim, source, NOT_MEASURED, "no correlation of three or more drafts given (draftlab design "
                       "correlate, then draftlab report --correlate DIR/correlate.json)")
    mmlu = correlate["correlations"]["mmlu_accuracy"]
    spearman = mmlu["spearman"]
    verdict = AGREES if abs(spearman) < 0.5 else DISAGREES
    measured = (f"MMLU accuracy vs TAR over {len(correlate['drafts'])} drafts: Spearman {spearman:.2f}, "
                f"Pearson {mmlu['pearson']:.2f}; log-perplexity vs TAR: Spearman "
                f"{correlate['correlations']['log_perplexity']['spearman']:.2f}")
    rows = [f"{d['draft']}: MMLU {d['mmlu_accuracy']:.1%}, TAR {d['tokens_per_step']:.2f}" for d in correlate["drafts"]]
    return Finding(claim, source, verdict, measured, rows)


def model_error(comparisons: list | None) -> Finding:
    """Second study: the simplified throughput model is within 3.5% of measurement."""
    claim, source = "The simplified model TAR / (t_target + t_draft) is within 3.5% of measurement.", \
        "Designing draft models (Appendix, Figure 12)"
    if not comparisons:
        return Finding(claim, source, NOT_MEASURED, "no calibration profile given (draftlab calibrate, then "
                       "draftlab report --profile PROFILE)")
    errors = [c.simplified_error for c in comparisons]
    worst = max(comparisons, key=lambda c: c.simplified_error)
    mean = sum(errors) / len(errors)
    verdict = AGREES if worst.simplified_error <= 0.035 else PARTLY if mean <= 0.035 else DISAGREES
    measured = (f"over {len(errors)} cells the model is off by {mean:.1%} on average and {worst.simplified_error:.1%} "
                f"at most (one run per cell on a shared 2-core machine, where the seeds averaged 100 iterations)")
    return Finding(claim, source, verdict, measured,
                   [f"{c.draft} K={c.k}: measured {c.measured_tokens_per_s:.1f}, predicted "
                    f"{c.simplified_tokens_per_s:.1f} tok/s ({c.simplified_error:.1%})" for c in comparisons])


def sps_beats_asg(summaries: list[CellSummary]) -> Finding:
    """First study: speculative sampling (SpS) beats HF assisted generation (AsG) on the same pair."""
    claim, source = "SpS is faster than AsG on the same draft and K.", "How speculative can SD be? (optimal table)"
    cells = {(s.target, s.dataset, s.temperature, s.drafter, s.k, s.method): s for s in summaries}
    pairs = [(s, cells[key[:-1] + (ASG.name,)]) for key, s in cells.items()
             if key[-1] == SPS.name and key[:-1] + (ASG.name,) in cells and s.dataset != ALL]
    if not pairs:
        return Finding(claim, source, NOT_MEASURED, "no configuration ran with both SpS and AsG")
    ratios = [sps.tokens_per_s / asg.tokens_per_s for sps, asg in pairs]
    faster = sum(r > 1.0 for r in ratios)
    verdict = AGREES if faster == len(pairs) else DISAGREES if not faster else PARTLY
    measured = (f"SpS is faster in {faster} of {len(pairs)} pairs; SpS / AsG throughput median {median(ratios):.2f}x "
                f"(range {min(ratios):.2f}-{max(ratios):.2f}x)")
    return Finding(claim, source, verdict, measured,
                   [f"{s.target} {s.dataset} {s.drafter} K={s.k}: SpS {s.tokens_per_s:.1f} vs AsG {a.tokens_per_s:.1f} "
                    f"tok/s" for s, a in pairs])


def format_findings(findings: list[Finding]) -> str:
    """The findings for a terminal: one line each."""
    return "\n".join(f"[{f.verdict}] {f.claim} Here: {f.measured}." for f in findings)

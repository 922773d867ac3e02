"""The performance model against measured sweeps: predicted vs measured decode throughput, with causes.

`compare` puts each formula's predicted decode throughput beside the throughput
measured in a study database (decode only: new tokens over wall time minus
prefill, since neither formula models prefill), optionally anchored to the
study's own plain decoding so that a uniform change of the machine's speed
cancels; `explain` names the cause of each large error.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from draftlab.perf.baselines import nearest_baseline, prompt_key
from draftlab.errors import DraftlabError
from draftlab.perf.calibrate import Profile
from draftlab.perf.throughput import Prediction, predict
from draftlab.contenders.methods import AR, SPS


def predictions(profile: Profile, k_max: int | None = None) -> list[Prediction]:
    """Both formulas for every draft in the profile and every K up to its K_max."""
    out = []
    for draft in profile.drafts:
        for k in range(1, min(k_max or draft.k_max, draft.k_max) + 1):
            out.append(predict(profile.target, draft, k))
    return out


def format_predictions(preds: list[Prediction], ar_tokens_per_s: float) -> str:
    """A table of predicted tokens/s and speedup per draft and K, with the inputs."""
    lines = [f"autoregressive (predicted): {ar_tokens_per_s:.1f} tokens/s",
             f"{'draft':<18}{'K':>3}{'TAR':>6}{'t_target ms':>12}{'t_draft ms':>11}{'tok/s':>8}{'interval':>14}"
             f"{'speedup':>9}{'a':>7}{'c':>7}{'Leviathan':>11}"]
    for p in preds:
        interval = f"{p.tokens_per_s_low:.1f}-{p.tokens_per_s_high:.1f}"
        lines.append(
            f"{p.draft:<18}{p.k:>3}{p.tokens_per_step:>6.2f}{1000 * p.t_target:>12.1f}{1000 * p.t_draft:>11.1f}"
            f"{p.tokens_per_s:>8.1f}{interval:>14}{p.speedup:>8.2f}x{p.leviathan_acceptance:>7.2f}"
            f"{p.leviathan_c:>7.3f}{p.leviathan_speedup:>10.2f}x"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Comparison:
    """One sweep cell: measured decode throughput against both formulas, and why they differ."""

    draft: str
    k: int
    measured_tokens_per_s: float
    simplified_tokens_per_s: float
    leviathan_tokens_per_s: float
    interval: tuple[float, float] = (0.0, float("inf"))  # the simplified model's predicted interval
    cause: str = ""  # the input whose misprediction moved the time per token most (large errors only)
    anchor: float = 1.0  # the study's plain decoding over calibration's, applied to the predictions (1: none)

    @property
    def simplified_error(self) -> float:
        return abs(self.simplified_tokens_per_s - self.measured_tokens_per_s) / self.measured_tokens_per_s

    @property
    def leviathan_error(self) -> float:
        return abs(self.leviathan_tokens_per_s - self.measured_tokens_per_s) / self.measured_tokens_per_s

    @property
    def inside_interval(self) -> bool:
        """True when the measured throughput falls inside the predicted interval."""
        return self.interval[0] <= self.measured_tokens_per_s <= self.interval[1]


@dataclass(frozen=True)
class MeasuredCell:
    """A sweep cell's decode throughput and its per-step parts, summed over its records."""

    tokens_per_s: float
    tokens_per_step: float
    target_s: float  # per step
    draft_s: float  # per step
    overhead_s: float  # per step


def measured_cells(rows: list[dict], method: str = SPS.name) -> dict[tuple[str, int], MeasuredCell]:
    """Decode throughput (prefill excluded) and its parts for every cell of `method`, over all its datasets
    (plain decoding's records: method "ar", cell ("none", 0))."""
    sums: dict[tuple, list[float]] = defaultdict(lambda: [0.0] * 6)
    for r in rows:
        if r["method"] == method:
            acc = sums[(r["drafter"], r["k"])]
            for i, value in enumerate((r["new_tokens"], r["wall_s"] - r["prefill_s"], r["steps"], r["target_s"],
                                       r["draft_s"], r["overhead_s"])):
                acc[i] += value
    return {key: MeasuredCell(tokens / seconds, tokens / steps, target / steps, draft / steps, overhead / steps)
            for key, (tokens, seconds, steps, target, draft, overhead) in sums.items() if seconds > 0 and steps > 0}


def explain(p: Prediction, cell: MeasuredCell, overhead_s: float, anchor: float = 1.0) -> str:
    """Which input's misprediction moved the time per token most: TAR, block time, draft cost or overhead.

    `anchor` > 1: the machine ran that much faster in the study than in calibration; predicted times shrink by it."""
    t_target, t_draft, overhead_s = p.t_target / anchor, p.t_draft / anchor, overhead_s / anchor
    predicted_step = t_target + t_draft
    effects = {
        "acceptance (TAR)": predicted_step / cell.tokens_per_step - predicted_step / p.tokens_per_step,
        "target block time": (cell.target_s - (t_target - overhead_s)) / cell.tokens_per_step,
        "draft cost": (cell.draft_s - t_draft) / cell.tokens_per_step,
        "engine overhead": (cell.overhead_s - overhead_s) / cell.tokens_per_step,
    }
    cause, effect = max(effects.items(), key=lambda item: abs(item[1]))
    direction = "slower" if effect > 0 else "faster"
    return f"{cause} ({direction} than predicted by {1000 * abs(effect):.1f} ms/token)"


def compare(profile: Profile, rows: list[dict], checks: list[dict] | None = None) -> list[Comparison]:
    """Predicted vs measured for every sps cell whose draft the profile knows; large errors get a cause.

    `checks` (the study's baseline re-timings; pass [] when it has none) anchors the predictions to the study's
    own plain decoding: each record's predicted speed is scaled by the plain decoding measured closest in time on
    its prompt over calibration's, so that a uniform change of the machine's speed between calibration and study,
    or during the study, cancels, and the model answers for what it predicts, the speedup (a change that slows
    single tokens and blocks unequally does not cancel). None: absolute tokens/s.
    """
    drafts = {d.name: d for d in profile.drafts}
    factor = None if checks is None else anchor_factors(rows, checks, profile.target.autoregressive_tokens_per_s)
    out = []
    for (draft, k), cell in sorted(measured_cells(rows).items()):
        if draft in drafts and k <= drafts[draft].k_max:
            p = predict(profile.target, drafts[draft], k)
            scale = 1.0 if factor is None else cell_anchor(rows, draft, k, factor)
            error = abs(scale * p.tokens_per_s - cell.tokens_per_s) / cell.tokens_per_s
            cause = explain(p, cell, profile.target.overhead_s_per_step, scale) if error > 0.10 else ""
            out.append(Comparison(draft, k, cell.tokens_per_s, scale * p.tokens_per_s, scale * p.leviathan_tokens_per_s,
                                  (scale * p.tokens_per_s_low, scale * p.tokens_per_s_high), cause, scale))
    if not out:
        raise DraftlabError("no sps cell of the study matches a draft of the profile; calibrate the same drafts")
    return out


def anchor_factors(rows: list[dict], checks: list[dict], calibration_ar: float) -> Callable[[dict], float]:
    """record -> plain decoding's decode tokens/s on its prompt at its time (`nearest_baseline`: re-timings decode
    from their prompt's ar record's prefill), over calibration's."""
    decode_speed = nearest_baseline(rows, checks)
    plain = {prompt_key(r): r for r in rows if r["method"] == AR.name}

    def factor(row: dict) -> float:
        ar, speed = plain.get(prompt_key(row)), decode_speed(row)
        if ar is None or speed is None or ar["wall_s"] <= ar["prefill_s"]:
            raise DraftlabError(f"no plain decoding record for prompt {row['prompt_id']} to anchor the predictions "
                                "to; validate without anchoring")
        return speed / calibration_ar

    return factor


def cell_anchor(rows: list[dict], draft: str, k: int, factor: Callable[[dict], float]) -> float:
    """The cell's scale: its tokens over the time they take at each record's anchored speed (time-weighted)."""
    records = [r for r in rows if r["method"] == SPS.name and r["drafter"] == draft and r["k"] == k]
    tokens = sum(r["new_tokens"] for r in records)
    return tokens / sum(r["new_tokens"] / factor(r) for r in records)


def error_summary(comparisons: list[Comparison]) -> dict:
    """Mean and maximum relative error of each formula, and how often the interval held the measurement."""
    simple = [c.simplified_error for c in comparisons]
    lev = [c.leviathan_error for c in comparisons]
    large = [c for c in comparisons if c.simplified_error > 0.10]
    return {
        "cells": len(comparisons),
        "simplified_mean_error": statistics.mean(simple), "simplified_max_error": max(simple),
        "leviathan_mean_error": statistics.mean(lev), "leviathan_max_error": max(lev),
        "inside_interval": sum(c.inside_interval for c in comparisons) / len(comparisons),
        "large_errors_inside_interval": sum(c.inside_interval for c in large) / len(large) if large else 1.0,
    }

"""Validate the performance model against measured sweeps, and pick draft and K for a user.

`validate` compares each formula's predicted decode throughput with the
throughput measured in a study database (decode only: new tokens over wall
time minus prefill, since neither formula models prefill). `tune` calibrates,
predicts every (draft, K) with an interval, races the configurations whose
interval could hold the best against plain decoding (successive halving on
short interleaved runs), recommends the measured best with its speed and
spread, honours a time budget, and prints how to use the pick in draftlab,
HF transformers, vLLM and llama.cpp. `tune_dtypes` makes the target's dtype
part of the search: each dtype is tuned on its own, then the picks (and plain
decoding in the first dtype, the reference) race head to head on the same
prompts, and the answer says whether its outputs equal the reference's.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from draftlab.api import parse_drafter_spec
from draftlab.drafters import feature, heads
from draftlab.drafters.files import draft_format
from draftlab.perf.calibrate import CalibrationSettings, Profile, calibrate
from draftlab.datasets import Prompt
from draftlab.errors import DraftlabError
from draftlab.models import LoadedModel
from draftlab.perf.model import Prediction, predict


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


def measured_cells(rows: list[dict], method: str = "sps") -> dict[tuple[str, int], MeasuredCell]:
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


def measured_decode_throughput(rows: list[dict]) -> dict[tuple[str, int], float]:
    """Decode tokens/s (prefill excluded) of every sps cell, over all its datasets."""
    return {key: cell.tokens_per_s for key, cell in measured_cells(rows).items()}


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
    """record -> plain decoding's decode tokens/s closest in time on its prompt, over calibration's.

    Re-timings store wall time only; each is turned into decode time with its prompt's own ar record's
    prefill share."""
    from draftlab.study.report import nearest_baseline, prompt_key

    wall_speed = nearest_baseline(rows, checks)
    plain = {prompt_key(r): r for r in rows if r["method"] == "ar"}

    def factor(row: dict) -> float:
        ar, speed = plain.get(prompt_key(row)), wall_speed(row)
        if ar is None or speed is None or ar["wall_s"] <= ar["prefill_s"]:
            raise DraftlabError(f"no plain decoding record for prompt {row['prompt_id']} to anchor the predictions "
                                "to; validate without anchoring")
        return speed * ar["wall_s"] / (ar["wall_s"] - ar["prefill_s"]) / calibration_ar

    return factor


def cell_anchor(rows: list[dict], draft: str, k: int, factor: Callable[[dict], float]) -> float:
    """The cell's scale: its tokens over the time they take at each record's anchored speed (time-weighted)."""
    records = [r for r in rows if r["method"] == "sps" and r["drafter"] == draft and r["k"] == k]
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


def plot_comparison(comparisons: list[Comparison], path: Path) -> None:
    """Predicted vs measured throughput, both formulas, with the y = x line (the study's Figure 12)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    measured = [c.measured_tokens_per_s for c in comparisons]
    ax.scatter(measured, [c.simplified_tokens_per_s for c in comparisons], label="TAR / (t_target + t_draft)")
    ax.scatter(measured, [c.leviathan_tokens_per_s for c in comparisons], marker="x", label="Leviathan et al.")
    top = max(measured + [c.simplified_tokens_per_s for c in comparisons] + [c.leviathan_tokens_per_s for c in comparisons])
    ax.plot([0, top * 1.05], [0, top * 1.05], "k:", label="predicted = measured")
    ax.set_xlabel("measured decode throughput (tokens/s)")
    ax.set_ylabel("predicted throughput (tokens/s)")
    ax.set_title("Performance model vs measurement", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def required_tar(target_tokens_per_s: float, t_target: float, t_draft: float) -> float:
    """TAR a draft needs to reach a throughput goal (the study's Figure 11): goal x (t_target + t_draft)."""
    return target_tokens_per_s * (t_target + t_draft)


def latency_reduction_for_parity(tar: float, t_target: float, t_draft: float, best_tokens_per_s: float) -> float:
    """Fraction of its drafting time a draft must shed to match `best_tokens_per_s` (the study's Table 5).

    Solves TAR / (t_target + x t_draft) = best for x; returns 1 - x (above 1: unreachable even at zero cost).
    """
    if t_draft <= 0:
        return 0.0
    needed_draft_time = tar / best_tokens_per_s - t_target
    return 1.0 - needed_draft_time / t_draft


def extra_tar_for_parity(tar: float, t_target: float, t_draft: float, best_tokens_per_s: float) -> float:
    """TAR a draft must add to match `best_tokens_per_s` at its current latency (the study's Figure 7)."""
    return required_tar(best_tokens_per_s, t_target, t_draft) - tar


def format_what_if(preds: list[Prediction]) -> str:
    """For each draft at its best K: what it would take to match the best draft (Table 5, Figure 7)."""
    best_per_draft: dict[str, Prediction] = {}
    for p in preds:
        if p.draft not in best_per_draft or p.tokens_per_s > best_per_draft[p.draft].tokens_per_s:
            best_per_draft[p.draft] = p
    best = max(best_per_draft.values(), key=lambda p: p.tokens_per_s)
    lines = [f"what it takes to match the best draft ({best.draft} K={best.k}, {best.tokens_per_s:.1f} tokens/s):",
             f"{'draft':<18}{'K':>3}{'tok/s':>8}{'draft latency cut':>19}{'or extra TAR':>14}"]
    for p in sorted(best_per_draft.values(), key=lambda p: -p.tokens_per_s):
        cut = latency_reduction_for_parity(p.tokens_per_step, p.t_target, p.t_draft, best.tokens_per_s)
        extra = extra_tar_for_parity(p.tokens_per_step, p.t_target, p.t_draft, best.tokens_per_s)
        cut_text = f"{cut:.0%}" if cut <= 1 else "unreachable"
        extra_text = f"+{extra:.2f}" if p.tokens_per_step + extra <= p.k + 1 else f"+{extra:.2f} (> K+1)"
        lines.append(f"{p.draft:<18}{p.k:>3}{p.tokens_per_s:>8.1f}{cut_text:>19}{extra_text:>14}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Recommendation:
    """The tuner's choice: measured in a race, with its prediction, spread and what the budget left out."""

    draft: str
    k: int
    predicted_tokens_per_s: float
    predicted_speedup: float
    measured_tokens_per_s: float | None
    measured_speedup: float | None
    seconds: float
    speedup_spread: tuple[float, float] = (0.0, 0.0)  # min and max per-prompt speedup in the race
    race: tuple[dict, ...] = ()  # every round: candidates, prompts, measured speedups
    notes: tuple[str, ...] = ()  # what the budget could not afford


def choose(preds: list[Prediction]) -> Prediction | None:
    """The fastest predicted configuration; None when nothing beats autoregressive decoding."""
    best = max(preds, key=lambda p: p.tokens_per_s, default=None)
    return best if best is not None and best.speedup > 1.0 else None


def contenders(preds: list[Prediction], limit: int) -> list[Prediction]:
    """Configurations whose predicted interval could hold the best: high end above the best low end.

    The predicted best comes first, then the others by the high end of their interval (the most each could
    be), so that a short race measures the model's pick beside its likeliest upset; a K the calibration saw
    too little of (a long K, or a draft whose acceptance differed between prompts) gets its chance.
    """
    if not preds:
        return []
    floor = max(p.tokens_per_s_low for p in preds)
    able = [p for p in preds if p.tokens_per_s_high >= floor]
    best = max(able, key=lambda p: p.tokens_per_s)
    others = sorted((p for p in able if p is not best), key=lambda p: -p.tokens_per_s_high)
    return [best, *others][:limit]


@dataclass(frozen=True)
class TuneSettings:
    """How the tuner spends its time."""

    budget_s: float | None = None  # the whole tune, calibration included; None: no limit
    calibration_share: float = 0.45  # of the budget, at most, for calibration (the race decides; it gets the rest)
    max_contenders: int = 4  # configurations that enter the race (plain decoding always runs beside them)

    def __post_init__(self) -> None:
        if self.budget_s is not None and self.budget_s <= 0:
            raise DraftlabError(f"the tuning budget must be > 0 seconds, got {self.budget_s}")


def tune(target: LoadedModel, drafters: list[str], prompts: list[Prompt], settings: CalibrationSettings,
         tune_settings: TuneSettings = TuneSettings(), progress: bool = True
         ) -> tuple[Recommendation, Profile, list[Prediction]]:
    """Calibrate, predict, then race the contenders against plain decoding and recommend the measured best."""
    start = time.perf_counter()
    deadline = start + tune_settings.budget_s if tune_settings.budget_s else float("inf")
    pilot = run_pilot(target, prompts[0], settings) if tune_settings.budget_s else None
    fitted, calibration_prompts, notes = _fit_calibration(pilot, prompts, drafters, settings, tune_settings)
    profile = calibrate(target, drafters, calibration_prompts, fitted, progress)
    preds = predictions(profile)
    entrants = contenders(preds, tune_settings.max_contenders)
    outcome = race(target, entrants, prompts, settings, deadline, progress, pilot)  # full runs, every prompt
    notes = notes + outcome.notes
    best = outcome.winner
    predicted = next((p for p in preds if (p.draft, p.k) == best), None)
    ar = profile.target.autoregressive_tokens_per_s
    return Recommendation(
        best[0], best[1], predicted.tokens_per_s if predicted else ar, predicted.speedup if predicted else 1.0,
        outcome.tokens_per_s.get(best), outcome.speedups.get(best), time.perf_counter() - start,
        outcome.spreads.get(best, (1.0, 1.0)), tuple(outcome.rounds), tuple(notes),
    ), profile, preds


MIN_RUN_TOKENS = 16  # the shortest race run the tuner times when a budget makes it cut runs short
MIN_CALIBRATION_TOKENS = 12  # the shortest calibration run, on one prompt, when a budget affords nothing longer
CALIBRATION_LENGTH_SHARE = 0.5  # under a budget, calibration runs cover at least this share of the user's length
MIN_CALIBRATION_PROMPTS = 2  # kept before runs go below that share: one prompt says nothing of the others
# Calibration's cost, in plain decoding's seconds per new token (measured on 2 cores for SmolLM2-135M and its
# n-gram and layer drafts at K_max 7, where a layer draft's run costs ~4x plain decoding and n-gram's ~1.3x):
RUN_COST_PER_TOKEN = 2.5  # a draft's run at K_max drafts and verifies blocks: slower than plain decoding
SHORT_RUN_COST_PER_TOKEN = 1.2  # its K = 1 runs, on the first two prompts, half as long
DRAFT_SETUP_TOKENS = 15.0  # building and warming up a draft, in plain decoding's tokens
BLOCK_COST_ROWS = 2.3  # one timed block, averaged over the sizes 1..K_max+1, in single rows


@dataclass(frozen=True)
class Pilot:
    """One plain generation timed before calibration: what the tuner's time estimates scale from."""

    per_token_s: float  # decode seconds per new token
    prefill_s: float  # the prompt's prefill


def run_pilot(target: LoadedModel, prompt: Prompt, settings: CalibrationSettings) -> Pilot:
    """Time one plain generation of `settings.max_new_tokens` on `prompt` (after an untimed warm-up)."""
    from draftlab.api import SpeculativeDecoder, encode_prompt

    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1, backend=settings.backend)
    ids = encode_prompt(target.tokenizer, prompt.text, prompt.chat)
    plain.generate(ids, max_new_tokens=4)
    stats = plain.generate(ids, max_new_tokens=settings.max_new_tokens).stats
    return Pilot((stats.wall_s - stats.prefill_s) / max(stats.new_tokens, 1), stats.prefill_s)


def _fit_calibration(pilot: Pilot, prompts, drafters, settings, tune_settings):
    """Shorter calibration runs (then fewer prompts) when a budget says so; notes on what was left out.

    Runs are kept at half the user's length or more while two prompts fit, dropping prompts first: n-gram
    lookup drafts little in a generation's first tokens, so runs of 12 on four prompts predicted K = 1 for a
    draft whose best K is 5 (the K that runs of 24 on two prompts, and full runs on all four, predict); and
    one prompt (code, where lookup rarely hits) predicted K = 1 with runs of 15 to 26 tokens, so two prompts
    come before length.
    """
    if not tune_settings.budget_s:
        return settings, prompts, []
    allowed = tune_settings.budget_s * tune_settings.calibration_share
    settings = replace(settings, repeats=min(settings.repeats, 3), short_run_prompts=1)
    fit, tokens = calibration_size(CalibrationCost(pilot, settings, len(drafters)), len(prompts), allowed)
    notes = []
    if fit < len(prompts):
        notes.append(f"calibrated on {fit} of {len(prompts)} prompts to fit the budget")
    if tokens < settings.max_new_tokens:
        notes.append(f"calibration runs shortened to {tokens} new tokens to fit the budget")
    return replace(settings, max_new_tokens=tokens), prompts[:fit], notes


@dataclass(frozen=True)
class CalibrationCost:
    """What calibration's cost is estimated from: the pilot and what calibration runs."""

    pilot: Pilot
    settings: CalibrationSettings  # its max_new_tokens is the longest run considered
    drafts: int

    def seconds(self, prompts: int, tokens: int) -> float:
        """Estimated calibration seconds on `prompts` prompts with runs of `tokens` new tokens."""
        per_token, prefill = self.pilot.per_token_s, self.pilot.prefill_s
        runs = prompts * (RUN_COST_PER_TOKEN * tokens * per_token + prefill)
        short_runs = min(prompts, self.settings.short_run_prompts) * (
            SHORT_RUN_COST_PER_TOKEN * (tokens // 2) * per_token + prefill)
        setup = DRAFT_SETUP_TOKENS * per_token
        blocks = (self.settings.repeats + 1) * (self.settings.k_max + 1) * BLOCK_COST_ROWS * per_token
        return self.drafts * (runs + short_runs + setup) + blocks


def calibration_size(cost: CalibrationCost, prompts: int, allowed_s: float) -> tuple[int, int]:
    """(prompts, new tokens per run) that fit `allowed_s`.

    Full runs on every prompt, else runs down to half the length on every prompt, else fewer prompts (down
    to `MIN_CALIBRATION_PROMPTS`), else shorter runs (down to `MIN_CALIBRATION_TOKENS`), else one prompt.
    """
    longest = cost.settings.max_new_tokens
    shortest = min(MIN_CALIBRATION_TOKENS, longest)
    half = min(max(shortest, round(longest * CALIBRATION_LENGTH_SHARE)), longest)
    keep = min(prompts, MIN_CALIBRATION_PROMPTS)
    at_half = [(count, half) for count in range(prompts, keep - 1, -1)]
    shorter = [(count, shortest) for count in range(keep, 0, -1)]
    for count, floor in at_half + shorter:
        if cost.seconds(count, floor) <= allowed_s:
            return count, _longest_fit(cost, count, longest, floor, allowed_s)
    return 1, shortest


def _longest_fit(cost: CalibrationCost, prompts: int, longest: int, shortest: int, allowed_s: float) -> int:
    """The longest run, from `longest` down to `shortest`, whose calibration on `prompts` fits `allowed_s`."""
    tokens = longest
    while tokens > shortest and cost.seconds(prompts, tokens) > allowed_s:
        tokens -= 1
    return tokens


@dataclass
class RaceOutcome:
    """Measured decode speed of every configuration that ran, and the winner."""

    winner: tuple[str, int]
    tokens_per_s: dict = field(default_factory=dict)  # (draft, K) -> decode tokens/s over its rounds
    speedups: dict = field(default_factory=dict)  # (draft, K) -> over plain decoding on the same prompts
    spreads: dict = field(default_factory=dict)  # (draft, K) -> (min, max) per-prompt speedup
    rounds: list = field(default_factory=list)
    notes: list = field(default_factory=list)


PLAIN = ("none", 0)


@dataclass(frozen=True)
class RacePlan:
    """How a race spends its time: how many contenders, on how many prompts, how long each run, how many rounds.

    Every round runs at the same length (the user's, unless the budget cuts it): a draft's speedup depends on
    where in a generation it is measured (n-gram lookup pays once the output starts repeating the prompt), so
    short first rounds would drop the drafts that pay late.
    """

    contenders: int
    prompts: int
    tokens: int  # new tokens per run, every round
    rounds: int  # how many rounds of the halving schedule run

    def schedule(self) -> list[int]:
        """The whole halving schedule: candidates halved (rounded up) until one is left; one contender runs twice."""
        sizes = [self.contenders]
        while sizes[-1] > 1:
            sizes.append((sizes[-1] + 1) // 2)
        return sizes if len(sizes) >= 2 else sizes + [1]

    def field_sizes(self) -> list[int]:
        """Candidates alive in each round this plan runs: the first `rounds` of the schedule."""
        return self.schedule()[: self.rounds]

    def run_seconds(self, pilot: Pilot) -> float:
        """One run's estimated seconds: its prefill and its decoding, a little slower than plain decoding."""
        return pilot.prefill_s + RACE_MARGIN * self.tokens * pilot.per_token_s

    def seconds(self, pilot: Pilot) -> float:
        """The race's estimated seconds: building the contenders, then plain decoding and every alive
        candidate on every prompt, each round."""
        setup = self.contenders * DRAFT_SETUP_TOKENS * pilot.per_token_s
        runs = sum((alive + 1) * self.prompts for alive in self.field_sizes())
        return setup + runs * self.run_seconds(pilot)


RACE_MARGIN = 1.15  # a contender's decoding is rarely slower than this many times plain decoding's


def plan_race(contenders: int, prompts: int, max_new_tokens: int, pilot: Pilot | None, seconds: float
              ) -> RacePlan | None:
    """The race that fits `seconds`: every prompt, full-length runs, as many contenders, then rounds, as fit.

    Without a pilot or a limit, every contender runs on every prompt at full length through the whole
    halving schedule. Runs are shortened (down to `MIN_RUN_TOKENS`) only when not even one contender fits at
    full length; prompts are dropped only when that does not fit either. None when nothing fits.
    """
    if pilot is None or seconds == float("inf"):
        plan = RacePlan(contenders, prompts, max_new_tokens, 1)
        return replace(plan, rounds=len(plan.schedule()))
    floor = min(MIN_RUN_TOKENS, max_new_tokens)
    for count in range(prompts, 0, -1):
        for tokens in range(max_new_tokens, floor - 1, -1):
            for n in range(contenders, 0, -1):
                plan = RacePlan(n, count, tokens, 1)
                if plan.seconds(pilot) <= seconds:
                    return _most_rounds(plan, pilot, seconds)
    return None


def _most_rounds(plan: RacePlan, pilot: Pilot, seconds: float) -> RacePlan:
    """The plan with as many rounds of its halving schedule as still fit `seconds`."""
    while plan.rounds < len(plan.schedule()):
        longer = replace(plan, rounds=plan.rounds + 1)
        if longer.seconds(pilot) > seconds:
            break
        plan = longer
    return plan


def race(target: LoadedModel, entrants: list[Prediction], prompts: list[Prompt], settings: CalibrationSettings,
         deadline: float = float("inf"), progress: bool = True, pilot: Pilot | None = None) -> RaceOutcome:
    """Successive halving: interleaved full-length runs on every prompt, the slower half out each round.

    Plain decoding runs in every round beside the candidates (on the same prompts, interleaved), so each
    candidate's speedup is measured against a baseline taken at the same time; a candidate's speed sums all
    its rounds. `pilot` (one plain generation, timed before calibration) sizes the race to the deadline
    (`plan_race`); before each later round, the round is checked against the time left at the pace the
    race has measured; what did not fit is noted.
    """
    from draftlab.api import SpeculativeDecoder, encode_prompt

    outcome = RaceOutcome(PLAIN)
    plan = plan_race(len(entrants), len(prompts), settings.max_new_tokens, pilot, deadline - time.perf_counter())
    if plan is None or not entrants:
        if entrants:
            outcome.notes.append("the budget left no time to race; recommending plain decoding unmeasured against "
                                 "the drafts")
        return outcome
    outcome.notes.extend(_plan_notes(plan, len(entrants), len(prompts), settings.max_new_tokens))
    decoders = {PLAIN: SpeculativeDecoder.from_names(target, drafter="none", k=1, backend=settings.backend)}
    for p in entrants[: plan.contenders]:
        decoders[(p.draft, p.k)] = SpeculativeDecoder.from_names(target, drafter=p.draft, k=p.k,
                                                                 backend=settings.backend)
    encoded = [encode_prompt(target.tokenizer, p.text, p.chat) for p in prompts[: plan.prompts]]
    alive = [key for key in decoders if key != PLAIN]
    totals = {key: [0, 0.0] for key in decoders}  # new tokens, decode seconds
    per_prompt: dict = {key: [] for key in decoders}  # decode tokens/s per prompt, aligned across keys
    run_s = 0.0  # the measured seconds of one run (prefill included) in the last round
    for number, size in enumerate(plan.field_sizes()):
        alive = alive[:size]
        runs = (size + 1) * len(encoded)
        if run_s and time.perf_counter() + runs * run_s > deadline:
            outcome.notes.append(f"race stopped before round {number + 1} to fit the budget; "
                                 f"{len(alive)} candidate(s) left")
            break
        started = time.perf_counter()
        keys = [PLAIN, *alive]
        run_interleaved(decoders, keys[number % len(keys):] + keys[: number % len(keys)], encoded,
                        plan.tokens, totals, per_prompt)
        run_s = (time.perf_counter() - started) / runs
        speed = {key: totals[key][0] / totals[key][1] for key in keys if totals[key][1] > 0}
        outcome.rounds.append({"prompts": len(encoded), "tokens": plan.tokens,
                               "speedups": {f"{d} K={k}": speed[(d, k)] / speed[PLAIN] for d, k in alive}})
        if progress:
            print(f"tune: race round {number + 1}: {len(alive)} candidate(s) on {len(encoded)} prompt(s), "
                  f"{plan.tokens} new tokens each")
        alive = sorted(alive, key=lambda key: -speed[key])
    _settle(outcome, totals, per_prompt, alive)
    return outcome


def _plan_notes(plan: RacePlan, contenders: int, prompts: int, max_new_tokens: int) -> list[str]:
    """What the race plan left out to fit the budget."""
    notes = []
    if plan.contenders < contenders:
        notes.append(f"raced {plan.contenders} of {contenders} contenders to fit the budget")
    if plan.prompts < prompts:
        notes.append(f"raced on {plan.prompts} of {prompts} prompts to fit the budget")
    if plan.tokens < max_new_tokens:
        notes.append(f"race runs shortened to {plan.tokens} new tokens to fit the budget")
    if plan.rounds < len(plan.schedule()):
        notes.append(f"raced {plan.rounds} of {len(plan.schedule())} halving rounds to fit the budget")
    return notes


def _settle(outcome: RaceOutcome, totals: dict, per_prompt: dict, alive: list) -> None:
    """Every raced configuration's measured speed, speedup and spread; the winner among the last alive."""
    speed = {key: totals[key][0] / totals[key][1] for key in totals if totals[key][1] > 0}
    for key in speed:
        outcome.tokens_per_s[key] = speed[key]
        outcome.speedups[key] = speed[key] / speed[PLAIN]
        ratios = [a / b for a, b in zip(per_prompt[key], per_prompt[PLAIN])]
        outcome.spreads[key] = (min(ratios), max(ratios)) if ratios else (1.0, 1.0)
    finalists = [key for key in alive if key in speed] or [PLAIN]
    best = max(finalists, key=lambda key: speed.get(key, 0.0))
    outcome.winner = best if PLAIN in speed and speed.get(best, 0.0) > speed[PLAIN] else PLAIN


def run_interleaved(decoders: dict, keys: list, prompts: list, max_new_tokens: int, totals: dict,
                    per_prompt: dict, outputs: dict | None = None) -> None:
    """Every key on every prompt, the order rotated per prompt so that drift hits all alike.

    Adds (new tokens, decode seconds) to `totals[key]` and each run's decode tokens/s to `per_prompt[key]`;
    with `outputs`, each run's token ids to `outputs[key]` (in prompt order).
    """
    for i, ids in enumerate(prompts):
        order = keys[i % len(keys):] + keys[: i % len(keys)]
        for key in order:
            result = decoders[key].generate(ids, max_new_tokens=max_new_tokens)
            stats = result.stats
            seconds = max(stats.wall_s - stats.prefill_s, 1e-9)
            totals[key][0] += stats.new_tokens
            totals[key][1] += seconds
            per_prompt[key].append(stats.new_tokens / seconds)
            if outputs is not None:
                outputs.setdefault(key, []).append(result.token_ids)


@dataclass(frozen=True)
class DtypeChoice:
    """The tuner's answer across dtypes: each dtype's own pick, then the picks raced head to head."""

    dtype: str  # the winning dtype
    recommendation: Recommendation  # the winning dtype's own tune
    per_dtype: dict  # dtype -> Recommendation
    head_to_head: dict  # "dtype draft K=k" -> decode tokens/s, on the same prompts, interleaved
    speedup: float  # the winner over plain decoding in the reference dtype (the first), head to head
    identical: tuple[int, int]  # the winner's outputs equal to reference plain decoding (greedy), of prompts run
    seconds: float
    notes: tuple[str, ...] = ()


def tune_dtypes(load: Callable[[str], LoadedModel], dtypes: list[str], drafters: list[str], prompts: list[Prompt],
                settings: CalibrationSettings, tune_settings: TuneSettings = TuneSettings(),
                progress: bool = True) -> DtypeChoice:
    """Tune the target in each dtype (`load(dtype)`), then race the picks and reference plain decoding.

    The first dtype is the reference: the winner's speedup is over plain decoding in it, and its outputs are
    compared with that plain decoding's (another dtype rounds differently, so its greedy text may differ:
    lossless against plain decoding in its own dtype, not in the reference's). A budget is shared: 80% split
    evenly between the dtypes' tunes, the rest for the head-to-head, which runs as many prompts as fit.
    """
    if not dtypes or len(set(dtypes)) != len(dtypes):
        raise DraftlabError(f"give distinct dtypes to compare, got {dtypes}")
    start = time.perf_counter()
    budget = tune_settings.budget_s
    deadline = start + budget if budget else float("inf")
    each = replace(tune_settings, budget_s=budget * 0.8 / len(dtypes)) if budget else tune_settings
    targets, picks = {}, {}
    for dtype in dtypes:
        targets[dtype] = load(dtype)
        picks[dtype], _, _ = tune(targets[dtype], drafters, prompts, settings, each, progress)
        if progress:
            print(f"tune: {dtype}: {picks[dtype].draft} K={picks[dtype].k}")
    reference = (dtypes[0], *PLAIN)
    keys = [reference] + [(d, r.draft, r.k) for d, r in picks.items() if (d, r.draft, r.k) != reference]
    decoders = {key: _decoder(targets[key[0]], key[1], key[2], settings.backend) for key in keys}
    tokens_per_s, outputs, notes = _head_to_head(decoders, keys, targets[dtypes[0]], prompts, settings, deadline)
    winner = max(keys, key=lambda key: tokens_per_s[key])
    same = sum(a == b for a, b in zip(outputs[winner], outputs[reference]))
    if winner[0] != dtypes[0] and same < len(outputs[winner]):
        notes.append(f"{winner[0]} output differs from {dtypes[0]} plain decoding on {len(outputs[winner]) - same} of "
                     f"{len(outputs[winner])} prompts: another rounding of the same model (speculation in {winner[0]} "
                     f"is lossless against {winner[0]} plain decoding)")
    return DtypeChoice(winner[0], picks[winner[0]], picks, {_label(k): v for k, v in tokens_per_s.items()},
                       tokens_per_s[winner] / tokens_per_s[reference], (same, len(outputs[winner])),
                       time.perf_counter() - start, tuple(notes))


def _decoder(target: LoadedModel, draft: str, k: int, backend: str):
    from draftlab.api import SpeculativeDecoder

    return SpeculativeDecoder.from_names(target, drafter=draft, k=max(k, 1), backend=backend)


def _label(key: tuple[str, str, int]) -> str:
    dtype, draft, k = key
    return f"{dtype} plain decoding" if draft == "none" else f"{dtype} {draft} K={k}"


def _head_to_head(decoders: dict, keys: list, target: LoadedModel, prompts: list[Prompt],
                  settings: CalibrationSettings, deadline: float) -> tuple[dict, dict, list[str]]:
    """Decode tokens/s and outputs of every key on as many prompts as fit before the deadline (at least one)."""
    from draftlab.api import encode_prompt

    totals = {key: [0, 0.0] for key in keys}
    per_prompt: dict = {key: [] for key in keys}
    outputs: dict = {}
    round_s, done = 0.0, 0
    for prompt in prompts:
        if done and time.perf_counter() + round_s > deadline:
            break
        started = time.perf_counter()
        ids = encode_prompt(target.tokenizer, prompt.text, prompt.chat)
        run_interleaved(decoders, keys[done % len(keys):] + keys[: done % len(keys)], [ids],
                        settings.max_new_tokens, totals, per_prompt, outputs)
        round_s, done = time.perf_counter() - started, done + 1
    notes = [f"head-to-head on {done} of {len(prompts)} prompts to fit the budget"] if done < len(prompts) else []
    return {key: totals[key][0] / totals[key][1] for key in keys}, outputs, notes


def usage(target: str, draft: str, k: int) -> list[str]:
    """How to run the recommendation in draftlab, HF transformers, vLLM and llama.cpp."""
    if draft == "none":
        return ["speculative decoding is not predicted to help here: decode autoregressively"]
    plan = parse_drafter_spec(draft)
    lines = [f"draftlab:     draftlab generate --target {target} --drafter {draft} --k {k} --prompt ..."]
    if plan.kind == "ngram":
        low, high = plan.ngram
        lines += [
            f"transformers: model.generate(..., prompt_lookup_num_tokens={k}, max_matching_ngram_size={high})",
            f'vLLM:         speculative_config={{"method": "ngram", "num_speculative_tokens": {k}, '
            f'"prompt_lookup_max": {high}, "prompt_lookup_min": {low}}}',
            f"llama.cpp:    llama-lookup -m TARGET.gguf --draft {k}  (prompt-lookup decoding)",
        ]
    elif plan.kind == "model" and draft_format(plan.model) == heads.FORMAT:
        lines += ["transformers / llama.cpp: no decoder heads; vLLM: its Medusa method, with the heads converted "
                  "to Medusa's checkpoint format"]
    elif plan.kind == "designed" or (plan.kind == "model" and draft_format(plan.model) == feature.FORMAT):
        lines += ["transformers / llama.cpp: no feature drafts that read the target's hidden states; "
                  "vLLM: its EAGLE method, with the draft converted to EAGLE's checkpoint format"]
    elif plan.kind == "model":
        lines += [
            f"transformers: draft.generation_config.num_assistant_tokens = {k}; "
            'draft.generation_config.num_assistant_tokens_schedule = "constant"; '
            "model.generate(..., assistant_model=draft)",
            f'vLLM:         speculative_config={{"model": "{plan.model}", "num_speculative_tokens": {k}}}',
            f"llama.cpp:    llama-speculative -m TARGET.gguf -md DRAFT.gguf --draft {k}",
        ]
    elif plan.kind in ("tree", "merged"):
        lines += ["transformers / llama.cpp: no token trees (the chain of the same draft runs there); "
                  "vLLM: tree attention only for its EAGLE drafts"]
    elif plan.kind == "staged":
        lines += ["transformers / vLLM / llama.cpp: no staged drafting; the inner draft alone drafts the same "
                  "tokens (greedy) there, one pass per token"]
    else:
        lines += [
            "transformers: build the layer draft with draftlab.build_layer_draft(target, layers) and pass it as "
            f"assistant_model with num_assistant_tokens={k} (constant schedule)",
            "vLLM / llama.cpp: no layer self-draft; save the draft as a model to use it there",
        ]
    return lines

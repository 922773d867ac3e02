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

import time
from dataclasses import dataclass, replace
from typing import Callable

from draftlab.files.datasets import Prompt
from draftlab.errors import DraftlabError
from draftlab.models import LoadedModel
from draftlab.perf.calibrate import CalibrationSettings, Profile, calibrate
from draftlab.perf.throughput import Prediction
from draftlab.perf.halving import PLAIN, head_to_head, label, race, race_decoder
from draftlab.perf.sizing import TuneSettings, fit_calibration, run_pilot
from draftlab.perf.validate import predictions


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


def tune(target: LoadedModel, drafters: list[str], prompts: list[Prompt], settings: CalibrationSettings,
         tune_settings: TuneSettings = TuneSettings(), progress: bool = True
         ) -> tuple[Recommendation, Profile, list[Prediction]]:
    """Calibrate, predict, then race the contenders against plain decoding and recommend the measured best."""
    start = time.perf_counter()
    deadline = start + tune_settings.budget_s if tune_settings.budget_s else float("inf")
    pilot = run_pilot(target, prompts[0], settings) if tune_settings.budget_s else None
    fitted, calibration_prompts, notes = fit_calibration(pilot, prompts, drafters, settings, tune_settings)
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
    decoders = {key: race_decoder(targets[key[0]], key[1], key[2], settings.backend) for key in keys}
    tokens_per_s, outputs, notes = head_to_head(decoders, keys, targets[dtypes[0]], prompts, settings, deadline)
    winner = max(keys, key=lambda key: tokens_per_s[key])
    same = sum(a == b for a, b in zip(outputs[winner], outputs[reference]))
    if winner[0] != dtypes[0] and same < len(outputs[winner]):
        notes.append(f"{winner[0]} output differs from {dtypes[0]} plain decoding on {len(outputs[winner]) - same} of "
                     f"{len(outputs[winner])} prompts: another rounding of the same model (speculation in {winner[0]} "
                     f"is lossless against {winner[0]} plain decoding)")
    return DtypeChoice(winner[0], picks[winner[0]], picks, {label(k): v for k, v in tokens_per_s.items()},
                       tokens_per_s[winner] / tokens_per_s[reference], (same, len(outputs[winner])),
                       time.perf_counter() - start, tuple(notes))

"""The tuner's race: contenders and plain decoding in interleaved full-length runs, the slower half dropped each round.

Successive halving over every prompt (a draft's speedup depends on where in a
generation it is measured), planned to fit the time left; `head_to_head`
re-measures a few configurations in interleaved rounds on the same prompts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from draftlab.files.datasets import Prompt
from draftlab.measure import DECODE, EncodedPrompt, Measurement, RunSettings, measure, paired, speedup
from draftlab.models import LoadedModel
from draftlab.perf.calibrate import CalibrationSettings
from draftlab.perf.throughput import Prediction
from draftlab.perf.sizing import DRAFT_SETUP_TOKENS, MIN_RUN_TOKENS, Pilot
from draftlab.api import SpeculativeDecoder
from draftlab.api import prompt_ids
from draftlab.contenders.plain import fastest_plain
from draftlab.drafters.kinds import is_plain_drafter


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
    outcome = RaceOutcome(PLAIN)
    plan = plan_race(len(entrants), len(prompts), settings.max_new_tokens, pilot, deadline - time.perf_counter())
    if plan is None or not entrants:
        if entrants:
            outcome.notes.append("the budget left no time to race; recommending plain decoding unmeasured against "
                                 "the drafts")
        return outcome
    outcome.notes.extend(_plan_notes(plan, len(entrants), len(prompts), settings.max_new_tokens))
    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1, backend=settings.backend)
    decoders = {PLAIN: fastest_plain(plain)}  # on llama.cpp: its default kernels, the fastest plain decoding there
    for p in entrants[: plan.contenders]:
        decoders[(p.draft, p.k)] = SpeculativeDecoder.from_names(target, drafter=p.draft, k=p.k,
                                                                 backend=settings.backend)
    encoded = encode(target, prompts[: plan.prompts])
    alive = [key for key in decoders if key != PLAIN]
    rounds: list[Measurement] = []
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
        rounds.append(run_round(decoders, keys[number % len(keys):] + keys[: number % len(keys)], encoded,
                                RunSettings(plan.tokens)))
        run_s = (time.perf_counter() - started) / runs
        speed = {key: race_speedup(rounds, key) for key in alive}
        outcome.rounds.append({"prompts": len(encoded), "tokens": plan.tokens,
                               "speedups": {f"{d} K={k}": speed[(d, k)] for d, k in alive}})
        if progress:
            print(f"tune: race round {number + 1}: {len(alive)} candidate(s) on {len(encoded)} prompt(s), "
                  f"{plan.tokens} new tokens each")
        alive = sorted(alive, key=lambda key: -speed[key])
    _settle(outcome, rounds, list(decoders), alive)
    return outcome


def encode(target: LoadedModel, prompts: list[Prompt]) -> list[EncodedPrompt]:
    """The prompts as the measurement loop takes them."""
    return [EncodedPrompt(p.id, p.category, prompt_ids(target.tokenizer, p)) for p in prompts]


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


def race_speedup(rounds: list[Measurement], key) -> float:
    """`key`'s decode speedup over plain decoding in the rounds it ran (each prompt against plain decoding's run of
    it in the same round)."""
    runs, paces = [], []
    for measured in rounds:
        r, p = paired(measured.records.get(key, []), measured.records[PLAIN], DECODE)
        runs, paces = runs + r, paces + p
    return speedup(runs, paces) or 0.0


def _decode_speed(rounds: list[Measurement], key) -> float:
    """`key`'s decode tokens/s over every round it ran."""
    runs = [r for measured in rounds for r in measured.records.get(key, [])]
    seconds = sum(r.seconds(DECODE) for r in runs)
    return sum(r.new_tokens for r in runs) / seconds if seconds else 0.0


def _settle(outcome: RaceOutcome, rounds: list[Measurement], keys: list, alive: list) -> None:
    """Every raced configuration's measured speed, speedup and spread; the winner among the last alive."""
    ran = [key for key in keys if any(measured.records.get(key) for measured in rounds)]
    for key in ran:
        outcome.tokens_per_s[key] = _decode_speed(rounds, key)
        outcome.speedups[key] = race_speedup(rounds, key)
        ratios = [x for measured in rounds for x in measured.per_prompt(key, PLAIN, DECODE)]
        outcome.spreads[key] = (min(ratios), max(ratios)) if ratios else (1.0, 1.0)
    finalists = [key for key in alive if key in outcome.speedups] or [PLAIN]
    best = max(finalists, key=lambda key: outcome.speedups.get(key, 0.0))
    outcome.winner = best if PLAIN in outcome.speedups and outcome.speedups.get(best, 0.0) > 1.0 else PLAIN


def run_round(decoders: dict, keys: list, prompts: list[EncodedPrompt], settings: RunSettings) -> Measurement:
    """Every key on every prompt through the measurement loop, the order rotated per prompt so that drift hits all
    alike. A drafter that learns across requests (suffix decoding) starts each call from what it was built with
    (`fork`) and sees the prompts as a stream: it holds its answers to the earlier prompts of this call, never a
    prompt's own answer from an earlier call (a race round repeats the prompts)."""
    contenders = {key: decoders[key].with_drafter(decoders[key].drafter.fork()) for key in keys}
    return measure(contenders, prompts, settings, warmup=0)


def race_decoder(target: LoadedModel, draft: str, k: int, backend: str):
    return SpeculativeDecoder.from_names(target, drafter=draft, k=max(k, 1), backend=backend)


def label(key: tuple[str, str, int]) -> str:
    dtype, draft, k = key
    return f"{dtype} plain decoding" if is_plain_drafter(draft) else f"{dtype} {draft} K={k}"


def head_to_head(decoders: dict, keys: list, target: LoadedModel, prompts: list[Prompt],
                 settings: CalibrationSettings, deadline: float) -> tuple[dict, dict, list[str]]:
    """Decode tokens/s and outputs of every key on as many prompts as fit before the deadline (at least one):
    one prompt at a time through the measurement loop, the order rotated per prompt."""
    contenders = {key: decoders[key].with_drafter(decoders[key].drafter.fork()) for key in keys}
    rounds: list[Measurement] = []
    round_s = 0.0
    for prompt in encode(target, prompts):
        if rounds and time.perf_counter() + round_s > deadline:
            break
        started = time.perf_counter()
        shift = len(rounds) % len(keys)
        rounds.append(measure({k: contenders[k] for k in keys[shift:] + keys[:shift]}, [prompt],
                              RunSettings(settings.max_new_tokens), warmup=0))
        round_s = time.perf_counter() - started
    notes = [f"head-to-head on {len(rounds)} of {len(prompts)} prompts to fit the budget"] if len(rounds) < len(prompts) else []
    outputs = {key: [r.token_ids for measured in rounds for r in measured.records[key]] for key in keys}
    return {key: _decode_speed(rounds, key) for key in keys}, outputs, notes

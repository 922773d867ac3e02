"""How much calibration a tuning budget affords: a pilot run, then prompts and run lengths that fit.

Under a budget the tuner times one plain generation first (the pilot) and
sizes calibration from it: shorter runs on every prompt down to half the
user's length, then fewer prompts down to two, then shorter runs, then one
prompt; what it could not afford is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from draftlab.files.datasets import Prompt
from draftlab.errors import DraftlabError
from draftlab.measure import DECODE, EncodedPrompt, RunSettings, run_once, warm_up
from draftlab.models import LoadedModel
from draftlab.perf.calibrate import CalibrationSettings
from draftlab.api import SpeculativeDecoder, prompt_ids


@dataclass(frozen=True)
class TuneSettings:
    """How the tuner spends its time."""

    budget_s: float | None = None  # the whole tune, calibration included; None: no limit
    calibration_share: float = 0.45  # of the budget, at most, for calibration (the race decides; it gets the rest)
    max_contenders: int = 4  # configurations that enter the race (plain decoding always runs beside them)

    def __post_init__(self) -> None:
        if self.budget_s is not None and self.budget_s <= 0:
            raise DraftlabError(f"the tuning budget must be > 0 seconds, got {self.budget_s}")


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


PILOT = "pilot"  # the pilot run's key in the measurement loop


@dataclass(frozen=True)
class Pilot:
    """One plain generation timed before calibration: what the tuner's time estimates scale from."""

    per_token_s: float  # decode seconds per new token
    prefill_s: float  # the prompt's prefill


def run_pilot(target: LoadedModel, prompt: Prompt, settings: CalibrationSettings) -> Pilot:
    """Time one plain generation of `settings.max_new_tokens` on `prompt` (after an untimed warm-up)."""
    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1, backend=settings.backend)
    encoded = EncodedPrompt(prompt.id, prompt.category, prompt_ids(target.tokenizer, prompt))
    warm_up({PILOT: plain}, encoded, RunSettings(4))
    run = run_once(PILOT, plain, encoded, RunSettings(settings.max_new_tokens))
    return Pilot(run.seconds(DECODE) / max(run.new_tokens, 1), run.stats.prefill_s)


def fit_calibration(pilot: Pilot, prompts, drafters, settings, tune_settings):
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

"""The one measurement loop: its speedup definitions, its interleaving, warm-up, re-checks and skips."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from draftlab.api import SpeculativeDecoder
from draftlab.engine import GenerationResult
from draftlab.errors import DraftlabError
from draftlab.measure import (
    DECODE, END_TO_END, EncodedPrompt, Listener, Measurement, Rechecks, RunRecord, RunSettings, measure,
    measure_prompt, paired, run_once, speedup,
)
from draftlab.decoding.metrics import GenerationStats
from draftlab.models import load_model
from draftlab.contenders.plain import autoregressive
from tests.conftest import tiny_model_dir

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama with a tokenizer (the API reads its end-of-sequence ids)."""
    return load_model(str(tiny_model_dir(tmp_path_factory.mktemp("measure") / "tiny")), dtype="fp32")


PROMPTS = [EncodedPrompt("a", "code", [5, 9, 5, 9, 5, 9, 12]), EncodedPrompt("b", "qa", [3, 7, 11, 3, 7])]


def _run(key, prompt_id, tokens, total_s, prefill_s=0.0, times_prefill=True) -> RunRecord:
    return RunRecord(key, prompt_id, "", list(range(tokens)), GenerationStats(new_tokens=tokens, wall_s=total_s,
                                                                              prefill_s=prefill_s), times_prefill)


def test_the_speedup_is_the_baselines_time_for_the_same_tokens_over_the_runs_time():
    runs = [_run("s", "a", 10, 1.0, 0.5), _run("s", "b", 20, 1.0, 0.2)]
    base = [_run("b", "a", 10, 2.0, 0.5), _run("b", "b", 10, 1.0, 0.2)]
    measured = Measurement({"s": runs, "b": base})
    # End to end: the baseline needs 2.0 s for prompt a's 10 tokens and 2.0 s for prompt b's 20: 4.0 / 2.0.
    assert measured.speedup("s", "b", END_TO_END) == pytest.approx(2.0)
    # Decode only: 1.5 s at a's pace and 1.6 s at b's, over 0.5 + 0.8 s.
    assert measured.speedup("s", "b", DECODE) == pytest.approx(3.1 / 1.3)
    assert measured.per_prompt("s", "b", END_TO_END) == pytest.approx([2.0, 2.0])
    # Equal outputs: the same as tokens/s over tokens/s.
    same = Measurement({"s": runs[:1], "b": base[:1]})
    assert same.speedup("s", "b", END_TO_END) == pytest.approx((10 / 1.0) / (10 / 2.0))


def test_an_engine_that_times_no_prefill_has_no_decode_speedup():
    peer = [_run("p", "a", 10, 1.0, times_prefill=False)]
    base = [_run("b", "a", 10, 2.0, 0.5)]
    assert Measurement({"p": peer, "b": base}).speedup("p", "b", DECODE) is None
    assert Measurement({"p": peer, "b": base}).speedup("p", "b", END_TO_END) == pytest.approx(2.0)
    assert paired(peer, base, DECODE) == ([], []) and speedup([], []) is None


def test_the_loop_interleaves_rotates_and_warms_up_without_teaching(tiny):
    plain = SpeculativeDecoder.from_names(tiny, drafter="none", k=1)
    suffix = SpeculativeDecoder.from_names(tiny, drafter="suffix", k=4)
    measured = measure({"plain": plain, "suffix": suffix}, PROMPTS, RunSettings(12), warmup=1)
    order = sorted((r.finished_at, r.key) for runs in measured.records.values() for r in runs)
    assert [key for _, key in order] == ["plain", "suffix", "suffix", "plain"]  # rotated per prompt
    # The warm-up ran on a forgetful view: the suffix cache held nothing at the first timed prompt.
    assert [r.stats.cache_held for r in measured.records["suffix"]] == [0, 1]
    assert [r.token_ids for r in measured.records["suffix"]] == [r.token_ids for r in measured.records["plain"]]
    assert all(r.seconds(DECODE) < r.seconds(END_TO_END) for runs in measured.records.values() for r in runs)


def test_rechecks_retime_the_baseline_and_measure_drift(tiny):
    plain = SpeculativeDecoder.from_names(tiny, drafter="none", k=1)
    ngram = SpeculativeDecoder.from_names(tiny, drafter="ngram", k=3)
    checks: list[RunRecord] = []
    ran = measure_prompt({"plain": plain, "n2": ngram, "n3": ngram.with_drafter(ngram.drafter)}, PROMPTS[0],
                         RunSettings(8), Rechecks("plain", autoregressive(plain), 1), _Heard(checks=checks))
    assert [r.key for r in ran] == ["plain", "n2", "n3"] and [c.key for c in checks] == ["plain", "plain"]
    assert Measurement({"plain": [ran[0]]}).drift() == 0.0  # no re-checks: not measured
    timings = [_run("plain", "a", 10, 1.0), _run("plain", "a", 12, 1.0), _run("plain", "a", 8, 1.0)]
    assert Measurement({"plain": timings[:1]}, timings[1:]).drift() == pytest.approx((12 - 8) / 10)


@dataclass
class _Heard(Listener):
    """What the loop told: the re-checks, and the keys whose errors it took as skips."""

    checks: list = field(default_factory=list)
    skipped: list = field(default_factory=list)

    def rechecked(self, record) -> None:
        self.checks.append(record)

    def failed(self, key, exc) -> bool:
        self.skipped.append(key)
        return True


class _Refuses:
    """A contender that cannot run any prompt (as a peer library's error would)."""

    times_prefill = False
    reuses_prefill = False
    prefill_key = ""

    def run(self, prompt_ids, settings) -> GenerationResult:
        raise DraftlabError("refused")

    def forgetful(self):
        return self


def test_an_error_the_caller_accepts_skips_the_contender_and_any_other_propagates(tiny):
    plain = SpeculativeDecoder.from_names(tiny, drafter="none", k=1)
    skipped = []
    ran = measure_prompt({"bad": _Refuses(), "plain": plain}, PROMPTS[1], RunSettings(4),
                         listener=_Heard(skipped=skipped))
    assert [r.key for r in ran] == ["plain"] and skipped == ["bad"]
    with pytest.raises(DraftlabError, match="refused"):
        measure_prompt({"bad": _Refuses()}, PROMPTS[1], RunSettings(4))


def test_run_once_times_the_whole_call(tiny):
    plain = SpeculativeDecoder.from_names(tiny, drafter="none", k=1)
    run = run_once("plain", plain, PROMPTS[0], RunSettings(6))
    assert run.new_tokens == 6 and run.stats.wall_s >= run.stats.prefill_s + run.stats.target_s > 0

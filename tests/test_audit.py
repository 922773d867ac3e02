"""`draftlab audit` passes draftlab's engine and fails a deliberately broken verifier (tiny models)."""

from __future__ import annotations

import pytest

from draftlab.audit import AuditSettings, exact_first_distribution, format_audit, run_audit
from draftlab.backends import FastLlamaBackend
from draftlab.drafters import ModelDrafter, NoDrafter
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.errors import DraftlabError
from draftlab.policy import FixedK
from draftlab.sampling import SamplingConfig, logits_to_probs, sample
from draftlab.verify import Verdict
from tests.conftest import noisy_copy, tiny_llama

PROMPT = [1, 2, 3, 4, 5]
SAMPLING = SamplingConfig(0.8)


def accept_everything(block, draft_probs, target_logits, sampling, generator):
    """A broken verifier: keeps every drafted token, then a bonus token from the last row."""
    bonus = sample(logits_to_probs(target_logits[-1:], sampling)[0], generator)
    return Verdict(tuple(range(len(block.tokens) - 1)), bonus)


def sampler(target, drafter, verifier=None):
    options = {} if verifier is None else {"verifier": verifier}
    engine = SpeculativeEngine(FastLlamaBackend(target.model), drafter, FixedK(3), context_length=512, **options)
    config = lambda seed: GenerationConfig(max_new_tokens=3, sampling=SAMPLING, seed=seed)  # noqa: E731
    return lambda seed: engine.generate(PROMPT, config(seed)).token_ids


@pytest.fixture(scope="module")
def report():
    target = tiny_llama(vocab=8, layers=1, seed=5, hidden=16)
    draft = noisy_copy(target, 1.0, seed=3)
    methods = {
        "draftlab model K=3": sampler(target, ModelDrafter(FastLlamaBackend(draft.model))),
        "broken model K=3": sampler(target, ModelDrafter(FastLlamaBackend(draft.model)), accept_everything),
    }
    settings = AuditSettings(positions=3, samples=600, budget_s=60)
    return run_audit(sampler(target, NoDrafter()), methods, exact_first_distribution(target.model, PROMPT, SAMPLING),
                     settings)


def test_audit_passes_the_engine_and_fails_a_broken_verifier(report):
    by_name = {m.method: m for m in report.methods}
    assert by_name["draftlab model K=3"].passed
    assert not by_name["broken model K=3"].passed
    assert not report.passed
    assert report.samples == 600
    broken = by_name["broken model K=3"].checks
    # later positions are where accepting everything shows
    assert broken[1].pvalue < 1e-6 and broken[1].tvd > 2 * broken[1].noise_tvd
    table = format_audit(report)
    assert "FAIL" in table and "draftlab model K=3" in table


def test_audit_refuses_a_budget_too_small():
    slow = lambda seed: (__import__("time").sleep(0.05), [1, 2, 3])[1]  # noqa: E731
    with pytest.raises(DraftlabError, match="budget"):
        run_audit(slow, {"x": slow}, None, AuditSettings(samples=100, budget_s=0.5))

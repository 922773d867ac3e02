"""`draftlab audit` passes draftlab's engine and fails a deliberately broken verifier (tiny models)."""

from __future__ import annotations

import pytest

from draftlab.checks.audit import AuditSettings, exact_first_distribution, format_audit, run_audit
from draftlab.backends import FastLlamaBackend
from draftlab.drafters import ModelDrafter, NoDrafter
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.errors import DraftlabError
from draftlab.decoding.policy import FixedK
from draftlab.decoding.sampling import SamplingConfig, logits_to_probs, sample
from draftlab.decoding.verify import Verdict
from tests.conftest import noisy_copy, tiny_llama
from tests.tiers import slow

PROMPT = [1, 2, 3, 4, 5]
SAMPLING = SamplingConfig(0.8)
# bf16 with top-p: the exact reference must come from the audited backend's own numerics, or a token inside its
# nucleus can fall outside the reference's and a lossless method fails.
SETTINGS = {"fp32": SamplingConfig(0.8), "bf16": SamplingConfig(0.8, top_p=0.9)}


def accept_everything(block, draft_probs, target_logits, sampling, generator):
    """A broken verifier: keeps every drafted token, then a bonus token from the last row."""
    bonus = sample(logits_to_probs(target_logits[-1:], sampling)[0], generator)
    return Verdict(tuple(range(len(block.tokens) - 1)), bonus)


def engine(target, drafter, verifier=None):
    options = {} if verifier is None else {"verifier": verifier}
    return SpeculativeEngine(FastLlamaBackend(target.model), drafter, FixedK(3), context_length=512, **options)


def sampler(target, drafter, verifier=None, sampling=SAMPLING):
    run = engine(target, drafter, verifier)
    config = lambda seed: GenerationConfig(max_new_tokens=3, sampling=sampling, seed=seed)  # noqa: E731
    return lambda seed: run.generate(PROMPT, config(seed)).token_ids


@pytest.fixture(scope="module", params=["fp32", slow("bf16")])  # SETTINGS' dtypes; bf16 trains longer
def report(request):
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[request.param]
    sampling = SETTINGS[request.param]
    target = tiny_llama(vocab=8, layers=1, seed=5, hidden=16)
    draft = noisy_copy(target, 1.0, seed=3)
    target.model.to(dtype)
    draft.model.to(dtype)
    methods = {
        "draftlab model K=3": sampler(target, ModelDrafter(FastLlamaBackend(draft.model)), sampling=sampling),
        "broken model K=3": sampler(target, ModelDrafter(FastLlamaBackend(draft.model)), accept_everything, sampling),
    }
    settings = AuditSettings(positions=3, samples=600, budget_s=60)
    exact = exact_first_distribution(engine(target, NoDrafter()), PROMPT, sampling)
    return run_audit(sampler(target, NoDrafter(), sampling=sampling), methods, exact, settings)


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


def test_the_exact_reference_is_plain_decodings_first_step():
    """Bitwise the logits the first step of plain decoding scores, in bf16 too (the numerics the audit checks)."""
    import torch

    target = tiny_llama(vocab=64, layers=2, seed=2)
    target.model.to(torch.bfloat16)
    plain = engine(target, NoDrafter())
    first = plain.next_token_logits(PROMPT)  # [V]
    backend = plain.target
    from draftlab.decoding.step import Block

    backend.reset()
    backend.score_block(Block.chain(PROMPT[:-1]), last_only=True)
    assert torch.equal(first, backend.score_block(Block.chain(PROMPT[-1:])).logits[0])
    greedy = plain.generate(PROMPT, GenerationConfig(max_new_tokens=1)).token_ids[0]
    assert greedy == int(first.argmax())


def test_audit_refuses_a_budget_too_small():
    slow = lambda seed: (__import__("time").sleep(0.05), [1, 2, 3])[1]  # noqa: E731
    with pytest.raises(DraftlabError, match="budget"):
        run_audit(slow, {"x": slow}, None, AuditSettings(samples=100, budget_s=0.5))

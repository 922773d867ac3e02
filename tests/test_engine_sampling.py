"""The whole engine reproduces a toy target's exact next-token distributions.

A 16-token random model is the target; a noisy copy drafts K=3 tokens at
temperature 1 (top-k 12 in one case). Over many seeded runs, the empirical
distribution of the first two generated tokens must match the exact ones
computed from the target's logits: P(t1) and P(t2) = sum_t1 P(t1) P(t2 | t1).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from draftlab.backend import HFBackend
from draftlab.drafters import ModelDrafter, NGramDrafter
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.policy import FixedK
from draftlab.sampling import SamplingConfig, logits_to_probs
from tests.conftest import noisy_copy, tiny_llama

VOCAB = 16
RUNS = 2500
PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def toy():
    target = tiny_llama(vocab=VOCAB, layers=1, seed=5, hidden=16)
    with torch.no_grad():
        target.model.lm_head.weight.mul_(0.25)  # spread the distribution: many tokens matter
    return target


def exact_distributions(model, sampling):
    with torch.inference_mode():
        first = logits_to_probs(model(torch.tensor([PROMPT])).logits[0, -1:], sampling)[0]  # [V]
        batch = torch.tensor([PROMPT + [t] for t in range(VOCAB)])  # [V, len+1]
        second_given_first = logits_to_probs(model(batch).logits[:, -1], sampling)  # [V, V]
    return first.double(), (first[:, None] * second_given_first).sum(0).double()


def empirical(engine, sampling):
    firsts, seconds = torch.zeros(VOCAB), torch.zeros(VOCAB)
    for seed in range(RUNS):
        out = engine.generate(PROMPT, GenerationConfig(max_new_tokens=2, sampling=sampling, seed=seed))
        firsts[out.token_ids[0]] += 1
        seconds[out.token_ids[1]] += 1
    return firsts, seconds


def assert_matches(counts, probs):
    expected = probs.double() / probs.double().sum() * counts.sum()
    assert counts[expected == 0].sum() == 0
    keep = expected > 0
    pvalue = chisquare(counts[keep].double().numpy(), expected[keep].numpy()).pvalue
    assert pvalue > 1e-3, f"p={pvalue:.2e}"


@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), SamplingConfig(0.8, top_k=12)], ids=["t1", "t0.8-top12"])
def test_engine_output_distribution_equals_target(toy, sampling):
    drafter = ModelDrafter(HFBackend(noisy_copy(toy, 0.5, seed=2).model))
    engine = SpeculativeEngine(HFBackend(toy.model), drafter, FixedK(3), context_length=512)
    firsts, seconds = empirical(engine, sampling)
    exact_first, exact_second = exact_distributions(toy.model, sampling)
    assert_matches(firsts, exact_first)
    assert_matches(seconds, exact_second)


def test_ngram_drafts_keep_the_distribution(toy):
    """A one-hot drafter (prompt lookup proposes '5'... after '1') is lossless too."""
    engine = SpeculativeEngine(HFBackend(toy.model), NGramDrafter(max_n=1), FixedK(2), context_length=512)
    firsts, seconds = empirical(engine, SamplingConfig(1.0))
    exact_first, exact_second = exact_distributions(toy.model, SamplingConfig(1.0))
    assert_matches(firsts, exact_first)
    assert_matches(seconds, exact_second)

"""The whole engine reproduces a toy target's exact joint distribution over the first K+1 tokens.

A 4-token random model is the target, so the exact joint distribution of the
first four generated tokens (256 sequences) is computable from its logits. The
engine drafts K=3 tokens in the first step (asserted: the drafted counts are
checked, so positions 2 and 3 of a block are really drafted and verified) with
a noisy copy of the target (a draft that is often wrong), an adversarial draft
that puts its mass where the target puts little, n-gram lookup on a prompt
whose last token recurs (one-hot drafts), and suffix decoding, whose chains
and trees come from what earlier runs generated. Over many seeded runs the empirical
joint distribution must match the exact one (chi-square over the sequences,
sparse cells pooled), at temperature 1, with top-k and with top-p.
"""

from __future__ import annotations

import itertools

import pytest

from tests.required import ARCTIC, module_or_skip
import torch
from scipy.stats import chisquare

from draftlab.backends import FastLlamaBackend
from draftlab.backends.slots import BackendSlots
from draftlab.drafters.served import ServedModelDrafter
from draftlab.drafters import ModelDrafter, NGramDrafter
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.decoding.policy import FixedK
from draftlab.registry import build_drafter
from draftlab.decoding.sampling import SamplingConfig, logits_to_probs
from tests.conftest import noisy_copy, tiny_llama
from tests.tiers import exhaustive, matrix

VOCAB = 4
K = 3
LENGTH = K + 1  # the first step commits up to K+1 tokens; later steps fill the rest
RUNS = 3000
PROMPT = [3, 1, 2, 0, 1, 2, 3]  # ends in 3, which recurs: n-gram lookup drafts [1, 2, 3]


@pytest.fixture(scope="module")
def toy():
    target = tiny_llama(vocab=VOCAB, layers=1, seed=5, hidden=16)
    with torch.no_grad():
        # a head sharp enough that draft and target lie far apart (a draft probability taken at the wrong position
        # shows in 3000 runs: p=1e-24 to 1e-121; on a head x0.15, near-uniform, the served draft's did not), every
        # token still likely enough to count
        target.model.lm_head.weight.mul_(0.6)
    return target


def adversarial(target):
    """A draft whose output layer is the target's negated: it prefers what the target avoids."""
    draft = noisy_copy(target, 0.0, seed=0)
    with torch.no_grad():
        draft.model.lm_head.weight.mul_(-1.0)
    return draft


def exact_joint(model, sampling) -> dict[tuple[int, ...], float]:
    """P(first LENGTH tokens = s) for every sequence s, from the target's warped distributions."""
    joint = {(): 1.0}
    with torch.inference_mode():
        for _ in range(LENGTH):
            prefixes = list(joint)
            batch = torch.tensor([PROMPT + list(p) for p in prefixes])  # [P, L]
            probs = logits_to_probs(model(batch).logits[:, -1].double(), sampling)  # [P, V]
            joint = {p + (t,): joint[p] * float(probs[i, t]) for i, p in enumerate(prefixes) for t in range(VOCAB)}
    return joint


def empirical_joint(engine, sampling) -> tuple[dict[tuple[int, ...], int], list[int]]:
    """Counts of the first LENGTH tokens over RUNS seeds, and the tokens drafted in each run's first step."""
    counts: dict[tuple[int, ...], int] = {}
    first_drafted = []
    for seed in range(RUNS):
        out = engine.generate(PROMPT, GenerationConfig(max_new_tokens=LENGTH, sampling=sampling, seed=seed))
        key = tuple(out.token_ids[:LENGTH])
        counts[key] = counts.get(key, 0) + 1
        first_drafted.append(out.stats.drafted_per_step_list[0])
    return counts, first_drafted


def assert_joint_matches(counts: dict, exact: dict) -> None:
    """Chi-square of observed vs exact sequence counts; cells expecting < 5 are pooled into one."""
    total = sum(counts.values())
    assert all(exact.get(s, 0.0) > 0 for s in counts), "a sequence of zero probability was generated"
    observed, expected, pooled_obs, pooled_exp = [], [], 0.0, 0.0
    for sequence, probability in exact.items():
        if probability * total >= 5:
            observed.append(counts.get(sequence, 0))
            expected.append(probability * total)
        else:
            pooled_obs += counts.get(sequence, 0)
            pooled_exp += probability * total
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    scale = sum(observed) / sum(expected)
    pvalue = chisquare(observed, [e * scale for e in expected]).pvalue
    assert len(observed) > 20, "too few sequences compared for the test to mean anything"
    assert pvalue > 1e-3, f"p={pvalue:.2e}"


SAMPLINGS = {
    "t1": SamplingConfig(1.0),
    "t0.8-top3": SamplingConfig(0.8, top_k=3),
    "t1-top0.85": SamplingConfig(1.0, top_p=0.85),
    "t0.9-top5-minp0.1": SamplingConfig(0.9, top_k=5, min_p=0.1),  # what draftlab serve's top_k and min_p set
}


@pytest.mark.parametrize("draft, name", matrix({("noisy", "t1"), ("adversarial", "t0.8-top3"), ("noisy", "t0.9-top5-minp0.1")}, ["noisy", "adversarial"],
                                              sorted(SAMPLINGS)))
@pytest.mark.slow  # statistical: `pytest -m slow`, which CI runs too
def test_engine_joint_distribution_equals_target(toy, name, draft):
    sampling = SAMPLINGS[name]
    draft_model = noisy_copy(toy, 0.8, seed=2) if draft == "noisy" else adversarial(toy)
    engine = SpeculativeEngine(FastLlamaBackend(toy.model), ModelDrafter(FastLlamaBackend(draft_model.model)), FixedK(K),
                               context_length=512)
    counts, first_drafted = empirical_joint(engine, sampling)
    assert set(first_drafted) == {K}
    assert_joint_matches(counts, exact_joint(toy.model, sampling))


@pytest.mark.slow  # statistical: `pytest -m slow`, which CI runs too
def test_a_served_draft_model_keeps_the_joint_distribution(toy):
    """`draftlab serve`'s draft model (a stream per slot, every run's positions drafted together, its probabilities
    taken at each position): the joint distribution is still the target's; its draft probabilities reversed across
    positions fail it (p=1e-24)."""
    draft_model = adversarial(toy)  # its mass where the target's is not: a wrong draft probability shows
    streams = BackendSlots(lambda: FastLlamaBackend(draft_model.model), 2, 512)
    drafter = ServedModelDrafter(ModelDrafter(FastLlamaBackend(draft_model.model)), streams)
    engine = SpeculativeEngine(FastLlamaBackend(toy.model), drafter, FixedK(K), context_length=512)
    counts, first_drafted = empirical_joint(engine, SAMPLINGS["t0.9-top5-minp0.1"])
    assert set(first_drafted) == {K} and streams.length(0) == 0
    assert_joint_matches(counts, exact_joint(toy.model, SAMPLINGS["t0.9-top5-minp0.1"]))


@pytest.mark.parametrize("name", ["t1", exhaustive("t1-top0.85")])
@pytest.mark.slow  # statistical: `pytest -m slow`, which CI runs too
def test_ngram_drafts_keep_the_joint_distribution(toy, name):
    """A one-hot drafter that really drafts K tokens (the prompt's last token recurs) is lossless too."""
    sampling = SAMPLINGS[name]
    engine = SpeculativeEngine(FastLlamaBackend(toy.model), NGramDrafter(max_n=1), FixedK(K), context_length=512)
    counts, first_drafted = empirical_joint(engine, sampling)
    assert set(first_drafted) == {K}
    assert_joint_matches(counts, exact_joint(toy.model, sampling))


@pytest.mark.parametrize("spec", ["suffix:factor=0,offset=3,min_prob=0",
                                  exhaustive("suffix:tree,factor=0,offset=3,min_prob=0")])
@pytest.mark.slow  # statistical: `pytest -m slow`, which CI runs too
def test_suffix_drafts_keep_the_joint_distribution(toy, spec):
    """Suffix decoding (chains, and trees of the continuations earlier runs took) over a cache that learns from
    every earlier run: what it proposes changes from run to run, and the output distribution does not."""
    module_or_skip("arctic_inference", ARCTIC, "suffix decoding needs arctic-inference (./run.sh installs it)")
    drafter = build_drafter(spec, toy).drafter
    engine = SpeculativeEngine(FastLlamaBackend(toy.model), drafter, FixedK(K), context_length=512)
    counts, first_drafted = empirical_joint(engine, SAMPLINGS["t1"])
    assert first_drafted[0] == K and drafter.cache.held == RUNS
    assert_joint_matches(counts, exact_joint(toy.model, SAMPLINGS["t1"]))
    later = [engine.generate(PROMPT, GenerationConfig(max_new_tokens=12, sampling=SAMPLINGS["t1"], seed=seed))
             for seed in range(20)]
    assert any(out.stats.has_trees for out in later) == ("tree" in spec)


def test_the_joint_check_detects_a_lossy_engine(toy):
    """Sampling the first token from the draft instead of the target must fail the check."""
    sampling = SAMPLINGS["t1"]
    exact = exact_joint(toy.model, sampling)
    wrong = exact_joint(adversarial(toy).model, sampling)
    generator = torch.Generator().manual_seed(0)
    sequences = list(wrong)
    draws = torch.multinomial(torch.tensor([wrong[s] for s in sequences]), RUNS, replacement=True, generator=generator)
    counts: dict = {}
    for index in draws.tolist():
        counts[sequences[index]] = counts.get(sequences[index], 0) + 1
    with pytest.raises(AssertionError):
        assert_joint_matches(counts, exact)
    assert len(list(itertools.islice(exact, 300))) == VOCAB**LENGTH

"""Staged drafting: a model draft speculated by a cheaper helper, lossless at both levels."""

from __future__ import annotations

import pytest
import torch

from draftlab.backends import FastLlamaBackend
from draftlab.drafters import ModelDrafter, NoDrafter, build_layer_draft
from draftlab.drafters.base import BlindDrafter
from draftlab.drafters.ngram import NGramDrafter
from draftlab.drafters.staged import StagedDrafter
from draftlab.errors import DraftlabError
from draftlab.registry import build_drafter, parse_drafter_spec
from draftlab.decoding.sampling import SamplingConfig
from draftlab.decoding.step import Proposal
from tests.conftest import noisy_copy, tiny_llama
from tests.test_engine_sampling import K, PROMPT, SAMPLINGS, VOCAB, adversarial, assert_joint_matches, \
    empirical_joint, exact_joint
from tests.test_trees import PROMPTS, run
from tests.tiers import matrix


class ConstantGuess(BlindDrafter):
    """A helper that always guesses the same token: the draft must reject most of its guesses."""

    name = "constant"

    def __init__(self, token: int) -> None:
        self.token = token

    def begin(self, prompt_ids) -> None:
        """Stateless."""

    def propose(self, context, k, sampling, generator) -> Proposal:
        return Proposal([self.token] * k)


def layer_draft(target):
    return ModelDrafter(FastLlamaBackend(build_layer_draft(target, [0, 1]).model))


@pytest.mark.parametrize("helper", ["ngram", "constant"])
def test_staged_greedy_output_equals_autoregressive(tiny_target, helper):
    make_helper = {"ngram": lambda: NGramDrafter(3, 1), "constant": lambda: ConstantGuess(7)}[helper]
    for prompt in PROMPTS:
        expected = run(tiny_target, NoDrafter(), 1, prompt).token_ids
        for k in (1, 3, 5):
            staged = StagedDrafter(layer_draft(tiny_target), make_helper())
            assert run(tiny_target, staged, k, prompt).token_ids == expected, f"{helper} k={k} prompt={prompt}"


def test_staged_greedy_drafts_what_the_draft_alone_drafts(tiny_target):
    """Greedy: a guess is kept only where it is the draft's own argmax, so the proposals are the same."""
    alone, staged = layer_draft(tiny_target), StagedDrafter(layer_draft(tiny_target), NGramDrafter(3, 1))
    greedy = SamplingConfig(0.0)
    context = [9, 10, 9, 10, 9, 10, 11, 9, 10]
    for cut in range(3, len(context) + 1):
        expected = alone.propose(context[:cut], 5, greedy, None).tokens
        assert staged.propose(context[:cut], 5, greedy, None).tokens == expected
    assert staged.guessed > 0


def test_kept_guesses_save_draft_passes(tiny_target):
    """A helper that guesses what the draft would draft (here: the same layers) leaves the draft two passes a step."""
    helper = layer_draft(tiny_target)
    staged = StagedDrafter(layer_draft(tiny_target), helper, helper)
    passes = []
    original = staged.draft.backend.score

    def counting(tokens, last_only=False):
        passes.append(len(tokens))
        return original(tokens, last_only)

    staged.draft.backend.score = counting
    prompt = PROMPTS[0]
    result = run(tiny_target, staged, 5, prompt, max_new_tokens=30)
    assert result.token_ids == run(tiny_target, NoDrafter(), 1, prompt, max_new_tokens=30).token_ids
    assert staged.kept == staged.guessed > 0
    assert len(passes) <= 2 * result.stats.steps  # catch up, then all guesses in one pass (unstaged: 5 a step)


@pytest.fixture(scope="module")
def toy():
    target = tiny_llama(vocab=VOCAB, layers=1, seed=5, hidden=16)
    with torch.no_grad():
        target.model.lm_head.weight.mul_(0.15)
    return target


@pytest.mark.parametrize("draft, name, helper", matrix({("noisy", "t1", "ngram")},
                                                      ["noisy", "adversarial"], ["t1", "t0.8-top3"], ["ngram", "constant"]))
@pytest.mark.slow  # statistical: `pytest -m slow`, which CI runs too
def test_staged_sampling_keeps_the_joint_distribution(toy, draft, name, helper):
    """Rejection sampling at the draft's level keeps each token's law = its draft_probs row: the target's law holds."""
    from draftlab.engine import SpeculativeEngine
    from draftlab.decoding.policy import FixedK

    draft_model = noisy_copy(toy, 0.8, seed=2) if draft == "noisy" else adversarial(toy)
    guesser = NGramDrafter(3, 1) if helper == "ngram" else ConstantGuess(PROMPT[-1])
    drafter = StagedDrafter(ModelDrafter(FastLlamaBackend(draft_model.model)), guesser)
    engine = SpeculativeEngine(FastLlamaBackend(toy.model), drafter, FixedK(K), context_length=512)
    counts, _ = empirical_joint(engine, SAMPLINGS[name])
    assert drafter.kept > 0 and drafter.kept < drafter.guessed  # guesses were both kept and rejected
    assert_joint_matches(counts, exact_joint(toy.model, SAMPLINGS[name]))


@pytest.mark.slow
def test_staged_first_token_follows_the_drafts_distribution(toy):
    """The draft-level rule alone: the first drafted token's frequencies match draft_probs, whatever is guessed."""
    draft_model = noisy_copy(toy, 0.8, seed=2)
    sampling = SAMPLINGS["t1"]
    drafter = StagedDrafter(ModelDrafter(FastLlamaBackend(draft_model.model)), ConstantGuess(0))
    counts = torch.zeros(VOCAB)
    rows = None
    for seed in range(4000):
        drafter.begin(PROMPT)
        proposal = drafter.propose(PROMPT, 2, sampling, torch.Generator().manual_seed(seed))
        counts[proposal.tokens[0]] += 1
        rows = proposal.draft_probs
    expected = rows[0] * counts.sum()  # [V]: the first row does not depend on the seed
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # 99.9% quantile of chi-square with 3 degrees of freedom


def test_staged_specs_in_the_registry(tiny_target):
    plan = parse_drafter_spec("staged:ngram:2-4/layers:0-1", 4)
    assert plan.kind == "staged" and plan.helper.ngram == (2, 4) and plan.inner.layers == (0, 1)
    built = build_drafter("staged:ngram/layers:0-1", tiny_target)
    assert isinstance(built.drafter, StagedDrafter) and built.model is not None
    with pytest.raises(DraftlabError, match="not one"):
        build_drafter("staged:ngram/ngram", tiny_target)
    with pytest.raises(DraftlabError, match="unknown drafter"):
        parse_drafter_spec("staged:ngram", 4)
    from draftlab.contenders.hf import hf_assist

    with pytest.raises(DraftlabError, match="no staged drafting"):
        hf_assist(plan, built.model, 2)

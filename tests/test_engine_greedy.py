"""Greedy speculative output must equal autoregressive output token for token (fp32)."""

from __future__ import annotations

import pytest
import torch

from draftlab.backends.hf import HFBackend
from draftlab.drafters import ModelDrafter, NGramDrafter, NoDrafter, build_layer_draft
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.backends import make_backend
from draftlab.decoding.policy import DynamicK, FixedK
from tests.conftest import noisy_copy
from tests.tiers import slow

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 9, 10, 9, 10, 11], [42]]
K_VALUES = [1, 2, 3, 5, 8]


def run(target, drafter, policy, prompt, max_new_tokens=40, backend="hf", **config):
    engine = SpeculativeEngine(make_backend(target.model, kind=backend), drafter, policy, context_length=512)
    return engine.generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens, **config))


def drafters(target):
    return {
        "ngram": lambda: NGramDrafter(max_n=3),
        "layers:0-1": lambda: ModelDrafter(HFBackend(build_layer_draft(target, [0, 1]).model)),
        "layers:0,3": lambda: ModelDrafter(HFBackend(build_layer_draft(target, [0, 3]).model)),
        "model:noisy": lambda: ModelDrafter(HFBackend(noisy_copy(target, 0.3).model)),
        "model:self": lambda: ModelDrafter(HFBackend(target.model)),
    }


@pytest.fixture(scope="module")
def baselines(tiny_target):
    return [run(tiny_target, NoDrafter(), FixedK(1), p).token_ids for p in PROMPTS]


@pytest.mark.parametrize("backend", ["hf", "fast"])
@pytest.mark.parametrize("k", K_VALUES)
@pytest.mark.parametrize("name", ["ngram", "layers:0-1", "layers:0,3", "model:noisy", "model:self"])
def test_greedy_equals_autoregressive(tiny_target, baselines, name, k, backend):
    make = drafters(tiny_target)[name]
    for prompt, expected in zip(PROMPTS, baselines):
        result = run(tiny_target, make(), FixedK(k), prompt, backend=backend)
        assert result.token_ids == expected, f"{name} k={k} prompt={prompt}"
        assert result.stats.new_tokens == 40


def test_drafts_are_really_accepted_and_rejected(tiny_target):
    """The equality tests above must exercise both paths: full acceptance and rejection."""
    self_draft = run(tiny_target, drafters(tiny_target)["model:self"](), FixedK(4), PROMPTS[0])
    assert self_draft.stats.acceptance_rate == 1.0
    assert self_draft.stats.steps == 8  # 40 tokens, 5 per step
    noisy = run(tiny_target, drafters(tiny_target)["model:noisy"](), FixedK(4), PROMPTS[0])
    assert 0.0 < noisy.stats.acceptance_rate < 1.0


def test_dynamic_k_is_lossless(tiny_target, baselines):
    drafter = ModelDrafter(HFBackend(noisy_copy(tiny_target, 0.3).model))
    result = run(tiny_target, drafter, DynamicK(2), PROMPTS[0])
    assert result.token_ids == baselines[0]


@pytest.mark.parametrize("backend", [slow("hf"), "fast"])
def test_target_cache_matches_fresh_prefill_after_every_step(tiny_target, backend):
    """The cache holds every committed token but the last, and gives the logits a fresh prefill gives."""
    backend = make_backend(tiny_target.model, kind=backend)
    drafter = ModelDrafter(HFBackend(noisy_copy(tiny_target, 0.3).model))
    engine = SpeculativeEngine(backend, drafter, FixedK(3), context_length=512)
    prompt = PROMPTS[0]
    sequence = list(prompt)
    checked = []

    def check(kept):
        sequence.extend(kept)
        assert backend.cache_len == len(sequence) - 1
        # Score the newest token on top of the cache, then roll back: the engine's state is unchanged.
        cached = backend.score([sequence[-1]])[0]
        backend.rollback(len(sequence) - 1)
        with torch.inference_mode():
            fresh = tiny_target.model(input_ids=torch.tensor([sequence])).logits[0, -1]
        torch.testing.assert_close(cached, fresh, rtol=1e-4, atol=1e-4)
        checked.append(len(kept))

    # 41 tokens with up to 4 per step: the last step is never truncated by the budget.
    engine.generate(prompt, GenerationConfig(max_new_tokens=400), on_tokens=check)
    assert len(checked) > 10 and max(checked) > 1


def test_stop_conditions(tiny_target, baselines):
    expected = baselines[0]
    eos = expected[10]
    first = expected.index(eos)
    result = run(tiny_target, NGramDrafter(), FixedK(4), PROMPTS[0], eos_token_ids=(eos,))
    assert result.token_ids == expected[: first + 1]
    assert result.stats.stop_reason == "eos"
    short = run(tiny_target, ModelDrafter(HFBackend(tiny_target.model)), FixedK(8), PROMPTS[0], max_new_tokens=7)
    assert short.token_ids == expected[:7] and short.stats.stop_reason == "max_new_tokens"


def test_stop_strings_cut_at_the_completing_token(tiny_target, baselines):
    expected = baselines[0]
    decode = lambda ids: " ".join(f"t{i}" for i in ids)  # noqa: E731 - a stand-in tokenizer
    stop = f"t{expected[5]} t{expected[6]}"
    engine = SpeculativeEngine(HFBackend(tiny_target.model), ModelDrafter(HFBackend(tiny_target.model)),
                               FixedK(5), context_length=512, decode=decode)
    result = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=40, stop_strings=(stop,)))
    text = decode(expected)
    cut = len(decode(expected[:7]))
    assert stop in text[:cut]
    assert result.stats.stop_reason == "stop_string"
    assert result.token_ids == expected[: len(result.token_ids)]
    assert stop in result.text and stop not in decode(result.token_ids[:-1])


def test_seeded_sampling_is_reproducible(tiny_target):
    drafter = lambda: ModelDrafter(HFBackend(noisy_copy(tiny_target, 0.3).model))  # noqa: E731
    from draftlab.decoding.sampling import SamplingConfig

    a = run(tiny_target, drafter(), FixedK(3), PROMPTS[0], sampling=SamplingConfig(1.0), seed=7)
    b = run(tiny_target, drafter(), FixedK(3), PROMPTS[0], sampling=SamplingConfig(1.0), seed=7)
    c = run(tiny_target, drafter(), FixedK(3), PROMPTS[0], sampling=SamplingConfig(1.0), seed=8)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


class DelayedBackend(HFBackend):
    """A draft backend that takes 1 ms more per token it scores: its prefill of a long prompt is slow to see."""

    def score(self, token_ids, last_only=False):
        import time

        time.sleep(0.001 * len(token_ids))
        return super().score(token_ids, last_only=last_only)


def test_the_first_steps_drafting_holds_a_draft_models_prefill(tiny_target):
    """The first step's drafting is recorded apart (`first_draft_s`): a draft model's prefill of the prompt runs in
    it, and `draft_prefill_s` (what the pilot spreads over a cell's output length) finds it there."""
    drafter = ModelDrafter(DelayedBackend(noisy_copy(tiny_target, 0.3).model))
    prompt = [(i * 7) % 60 + 1 for i in range(300)]
    stats = run(tiny_target, drafter, FixedK(3), prompt, max_new_tokens=24).stats
    assert stats.steps >= 2 and 0.0 < stats.first_draft_s <= stats.draft_s
    assert stats.draft_prefill_s >= 0.25  # 300 tokens at 1 ms each, beyond a later step's few
    plain = run(tiny_target, NGramDrafter(max_n=3), FixedK(3), prompt, max_new_tokens=24).stats
    assert plain.draft_prefill_s < 0.05  # n-gram lookup reads no prompt through a model

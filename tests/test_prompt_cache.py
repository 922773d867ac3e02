"""A prompt's prefill, reused by the engines that share a backend and a `PromptCache`, gives every generation the
output of a fresh prefill, token for token, and is computed once per prompt whatever the number of engines."""

from __future__ import annotations

import pytest
import torch

from draftlab.backends import make_backend
from draftlab.backends.hf import HFBackend
from draftlab.drafters import ModelDrafter, NGramDrafter, NoDrafter
from draftlab.drafters.anchored import FeatureDrafter
from draftlab.drafters.feature import new_feature_draft
from draftlab.engine import GenerationConfig, PromptCache, SpeculativeEngine
from draftlab.decoding.policy import FixedK
from draftlab.decoding.sampling import SamplingConfig
from tests.conftest import noisy_copy
from tests.tiers import slow

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 9, 10, 9, 10, 11], [42], [1, 2, 3, 4, 5, 6, 7, 8]]


def drafters(target):
    return {
        "none": lambda: NoDrafter(),
        "ngram": lambda: NGramDrafter(max_n=3),
        "model": lambda: ModelDrafter(HFBackend(noisy_copy(target, 0.3).model)),
        "feature": lambda: FeatureDrafter(new_feature_draft(target, torch.arange(64))),
    }


@pytest.mark.parametrize("backend", [slow("hf"), "fast"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engines_sharing_a_prompt_cache_decode_as_a_fresh_prefill_does_and_prefill_once(tiny_target, backend,
                                                                                          temperature):
    config = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(temperature), seed=3)
    shared, cache = make_backend(tiny_target.model, kind=backend), PromptCache("test")
    makes = drafters(tiny_target)
    for prompt in PROMPTS:
        for name, make in makes.items():
            for k in (1, 3):
                fresh = SpeculativeEngine(make_backend(tiny_target.model, kind=backend), make(), FixedK(k),
                                          context_length=512).generate(prompt, config)
                reused = SpeculativeEngine(shared, make(), FixedK(k), context_length=512,
                                           prompt_cache=cache).generate(prompt, config)
                assert reused.token_ids == fresh.token_ids, (name, k, prompt)
    # The first engine on a prompt prefills it; the others reuse it, except the feature draft's first engine,
    # which needs the prefill's hidden states (the plain engine before it did not keep them); a one-token prompt
    # has nothing to prefill but is still the new prompt.
    assert cache.prefills == 2 + 2 + 1 + 2


def test_a_prefill_call_is_what_the_next_generation_starts_from(tiny_target):
    backend, cache = make_backend(tiny_target.model, kind="hf"), PromptCache("test")
    engine = SpeculativeEngine(backend, NGramDrafter(max_n=3), FixedK(2), context_length=512, prompt_cache=cache)
    engine.prefill(PROMPTS[0])
    assert cache.prefills == 1 and backend.cache_len == len(PROMPTS[0]) - 1
    result = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=16))
    assert cache.prefills == 1 and result.stats.prefill_s == 0.0
    engine.next_token_logits(PROMPTS[1])  # another use of the backend: nothing held afterwards
    engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=16))
    assert cache.prefills == 3

"""Online adaptation on the real SmolLM2 and its shipped designed draft: greedy output stays plain decoding's on
every prompt of a stream while the draft learns (fp32 in the default suite; bf16 and a tree under -m slow)."""

from __future__ import annotations

import pytest
import torch

from draftlab.api import SpeculativeDecoder
from draftlab.files.datasets import load_prompts
from draftlab.drafters.adapt import AdaptingDrafter
from draftlab.models import load_model
from tests.tiers import exhaustive

pytestmark = pytest.mark.integration
TOKENS = 40


def check_stream(target, spec: str, k: int, count: int) -> None:
    prompts = [p.text for p in load_prompts("humaneval", count, skip=60)]
    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1)
    decoder = SpeculativeDecoder.from_names(target, drafter=spec, k=k)
    drafter = decoder.drafter
    assert isinstance(drafter, AdaptingDrafter)
    start = drafter.source.draft.layer.fc.weight.clone()
    for prompt in prompts:
        expected = plain.generate(prompt, max_new_tokens=TOKENS).token_ids
        assert decoder.generate(prompt, max_new_tokens=TOKENS).token_ids == expected, f"{spec} k={k}"
    assert drafter.learner.steps >= count and len(drafter.requests) == count
    assert not torch.equal(drafter.source.draft.layer.fc.weight, start)  # the drafting weights did change


@pytest.mark.slow
def test_adapting_designed_draft_greedy_equals_plain_decoding_fp32():
    check_stream(load_model("smollm2-135m", dtype="fp32"), "adapt:every=32/designed", 3, 3)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_adapting_designed_draft_greedy_equals_plain_decoding_bf16():
    check_stream(load_model("smollm2-135m", dtype="bf16"), "adapt:every=32/designed", 3, 4)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, exhaustive(5)])
def test_adapting_tree_greedy_equals_plain_decoding(k):
    check_stream(load_model("smollm2-135m", dtype="fp32"), "adapt:every=16,steps=2/tree:2x2:designed", k, 3)

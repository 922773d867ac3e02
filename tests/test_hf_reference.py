"""HF assisted generation as the reference: K reaches HF, and no loaded model keeps a changed config."""

from __future__ import annotations

import pytest
import torch

from draftlab.engine import GenerationConfig
from draftlab.errors import DraftlabError
from draftlab.contenders.hf import HFAssist, hf_assist, hf_generate
from draftlab.models import LoadedModel
from draftlab.registry import parse_drafter_spec
from tests.conftest import noisy_copy, tiny_llama

PROMPT = [3, 17, 5, 9, 3, 17, 5, 9, 3, 17]
EOS = (63,)
PLAIN_24 = GenerationConfig(24, eos_token_ids=EOS)  # plain decoding of 24 tokens, greedy


@pytest.fixture(scope="module")
def pair() -> tuple[LoadedModel, LoadedModel]:
    target = tiny_llama(seed=3)
    return target, noisy_copy(target, 0.3)


def seen_k_during(assistant: torch.nn.Module, call) -> list[int]:
    """num_assistant_tokens in the assistant's config at each of its forward passes during `call`."""
    seen = []
    hook = assistant.register_forward_hook(lambda module, args, out: seen.append(
        module.generation_config.num_assistant_tokens))
    try:
        call()
    finally:
        hook.remove()
    return seen


@pytest.mark.parametrize("k", [1, 3])
def test_assistant_drafts_k_for_the_call_and_keeps_its_own_config(pair, k):
    target, draft = pair
    own = draft.model.generation_config
    own_k = own.num_assistant_tokens
    plain = hf_generate(target, PROMPT, PLAIN_24)
    assist = hf_assist(parse_drafter_spec("model:noisy", k), draft, k)
    assert assist == HFAssist(k, assistant=draft.model)
    outputs = []
    seen = seen_k_during(draft.model, lambda: outputs.append(hf_generate(target, PROMPT, PLAIN_24, assist=assist)))
    assert seen and set(seen) == {k}  # HF read the lent K at every draft pass
    assert outputs[0] == plain  # greedy assisted generation keeps HF's greedy output
    assert draft.model.generation_config is own and own.num_assistant_tokens == own_k


def test_assistant_config_is_restored_when_generate_fails(pair):
    target, draft = pair
    own = draft.model.generation_config
    assist = hf_assist(parse_drafter_spec("model:noisy", 2), draft, 2)
    with pytest.raises(Exception):
        hf_generate(target, [], GenerationConfig(4, eos_token_ids=EOS), assist=assist)  # an empty prompt: HF refuses
    assert draft.model.generation_config is own


def test_prompt_lookup_takes_k_and_the_ngram_size(pair):
    target, _ = pair
    assist = hf_assist(parse_drafter_spec("ngram:1-3", 4), None, 4)
    assert assist.generate_args() == {"prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 3}
    plain = hf_generate(target, PROMPT, PLAIN_24)
    assert hf_generate(target, PROMPT, PLAIN_24, assist=assist) == plain


def test_a_cut_vocabulary_draft_has_no_hf_counterpart(pair):
    target, _ = pair
    small = tiny_llama(seed=4)
    small.model.lm_head = torch.nn.Linear(32, 16, bias=False)  # rows for the first 16 tokens only
    with pytest.raises(DraftlabError, match="full vocabulary"):
        hf_assist(parse_drafter_spec("model:small", 2), small, 2)

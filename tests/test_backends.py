"""Both backends follow the cache contract and agree with a fresh forward pass."""

from __future__ import annotations

import pytest
import torch

from draftlab.backends.hf import HFBackend
from draftlab.errors import DraftlabError
from draftlab.backends import FastLlamaBackend, make_backend

TOKENS = [5, 9, 2, 33, 17, 8, 41, 3, 3, 60, 12, 7]


def fresh_logits(model, tokens):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()  # [n, V]


@pytest.mark.parametrize("backend_cls", [HFBackend, FastLlamaBackend])
def test_score_blocks_and_rollback_match_fresh_forward(tiny_target, backend_cls):
    backend = backend_cls(tiny_target.model)
    backend.reset()
    reference = fresh_logits(tiny_target.model, TOKENS)
    first = backend.score(TOKENS[:5])
    torch.testing.assert_close(first, reference[:5], rtol=1e-4, atol=1e-4)
    block = backend.score(TOKENS[5:9] + [1, 2])  # two tokens we will roll back
    torch.testing.assert_close(block[:4], reference[5:9], rtol=1e-4, atol=1e-4)
    backend.rollback(9)
    assert backend.cache_len == 9
    rest = backend.score(TOKENS[9:], last_only=True)
    assert rest.shape == (1, backend.vocab_size)
    torch.testing.assert_close(rest[0], reference[-1], rtol=1e-4, atol=1e-4)


def test_fast_backend_grows_its_cache(tiny_target):
    backend = FastLlamaBackend(tiny_target.model, capacity=4)
    tokens = (TOKENS * 3)[:30]
    reference = fresh_logits(tiny_target.model, tokens)
    backend.score(tokens[:3])
    for i in range(3, 30):
        logits = backend.score([tokens[i]])
        torch.testing.assert_close(logits[0], reference[i], rtol=1e-4, atol=1e-4)


def test_fast_backend_does_not_touch_the_model(tiny_target):
    before = {k: v.clone() for k, v in tiny_target.model.state_dict().items()}
    FastLlamaBackend(tiny_target.model).score(TOKENS)
    after = tiny_target.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_make_backend_choice(tiny_target):
    assert isinstance(make_backend(tiny_target.model), FastLlamaBackend)
    assert isinstance(make_backend(tiny_target.model, kind="hf"), HFBackend)
    with pytest.raises(DraftlabError, match="unknown backend"):
        make_backend(tiny_target.model, kind="vllm")

"""Both backends follow the cache contract and agree with a fresh forward pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftlab.backends.hf import HFBackend
from draftlab.errors import DraftlabError
from draftlab.backends import FastLlamaBackend, make_backend
from draftlab.backends.numerics import weight_major_linear

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


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 15, 16, 64, 65])
def test_weight_major_products_agree_with_linear(rows):
    torch.manual_seed(rows)
    x, weight, bias = torch.randn(rows, 48), torch.randn(80, 48), torch.randn(80)
    for b in (None, bias):
        out = weight_major_linear(x, weight, b)
        assert out.shape == (rows, 80) and out.is_contiguous()
        torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    if rows == 1:  # a single row stays the GEMV: a plain decoding step computes what it did
        assert torch.equal(weight_major_linear(x, weight, bias), F.linear(x, weight, bias))
    transposed = x.t().contiguous().t()  # a column-major input gives the same rows
    torch.testing.assert_close(weight_major_linear(transposed, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_fast_backend_weight_major_is_the_fp32_cpu_default_of_drafts_and_scores_alike(tiny_target):
    weight_major = FastLlamaBackend(tiny_target.model, batch_invariant=False)
    linear = FastLlamaBackend(tiny_target.model, batch_invariant=False, weight_major=False)
    assert weight_major.weight_major and not linear.weight_major
    assert weight_major.route is None and "not exact" in weight_major.numerics  # a draft's products
    for backend in (weight_major, linear):
        backend.score(TOKENS[:5])
    torch.testing.assert_close(weight_major.score(TOKENS[5:]), linear.score(TOKENS[5:]), rtol=1e-4, atol=1e-4)

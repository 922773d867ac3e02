"""A draft model's greedy tokens in one call into llama.cpp (scripts/llama-cpp/draft-chain.patch): the same picks and
the same cache as the Python loop, one `score` a token; whole and trimmed heads; deterministic across rollbacks."""

from __future__ import annotations

import pytest
import torch

from draftlab.backends.base import greedy_rows
from draftlab.backends.gguf import greedy_chain_call
from draftlab.backends.gguf_head import derive_trimmed_head
from draftlab.backends.llamacpp import LlamaCppBackend
from draftlab.decoding.sampling import SamplingConfig
from draftlab.drafters.model_spec import gguf_draft
from draftlab.drafters.standalone import ModelDrafter
from draftlab.errors import DraftlabError
from draftlab.files import assets
from draftlab.models import gguf_path, load_model

PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
ROWS = torch.tensor([0, 1, 2, 7, *range(100, 5000), 49151])  # a trimmed head's token ids (as test_gguf_head's)
GREEDY = SamplingConfig(temperature=0.0)


@pytest.fixture(scope="module")
def draft():
    return load_model(gguf_draft("smollm2-135m"), backend="llamacpp", repack=True)


@pytest.fixture(scope="module")
def trimmed():
    path = derive_trimmed_head(gguf_path(gguf_draft("smollm2-135m")), ROWS, assets.cache_dir())
    return load_model(str(path), backend="llamacpp", repack=True)


def test_draftlabs_libllama_holds_the_draft_loop():
    assert greedy_chain_call() is not None  # ./run.sh --setup-only builds it (scripts/llama-cpp/draft-chain.patch)


@pytest.mark.parametrize("head", ["whole", "trimmed"])
def test_one_native_call_picks_and_caches_what_the_python_loop_does(draft, trimmed, head):
    model, rows = (draft, None) if head == "whole" else (trimmed, ROWS)
    native, python = (LlamaCppBackend(model.model, head_rows=rows) for _ in range(2))
    prompt = draft.tokenizer(PROMPT)["input_ids"]
    for backend in (native, python):
        backend.score(prompt, last_only=True)
    first = prompt[-1]
    picks = native.greedy_chain(first, 12, rows)
    assert picks == greedy_rows(python, first, 12, rows) and len(set(picks)) > 1
    assert native.cache_len == python.cache_len == len(prompt) + 12
    after = picks[-1] if rows is None else int(rows[picks[-1]])
    assert torch.equal(native.score([after]), python.score([after]))  # the same cells, bitwise
    native.rollback(len(prompt) + 3)  # a rejected tail goes as a Python-fed one does
    python.rollback(len(prompt) + 3)
    assert native.greedy_chain(7, 4, rows) == greedy_rows(python, 7, 4, rows)


def test_a_draft_drafts_the_same_tokens_for_the_same_context_after_any_rollback(draft):
    prompt = draft.tokenizer(PROMPT)["input_ids"]
    drafter, fresh = (ModelDrafter(LlamaCppBackend(draft.model)) for _ in range(2))
    drafter.begin(prompt)
    first = drafter.propose(prompt, 6, GREEDY, None).tokens
    context = [*prompt, *first[:2], 1]  # two accepted, then the target's own token
    second = drafter.propose(context, 6, GREEDY, None).tokens
    fresh.begin(prompt)
    assert fresh.propose(prompt, 6, GREEDY, None).tokens == first
    fresh.begin(context)
    assert fresh.propose(context, 6, GREEDY, None).tokens == second


def test_a_chain_past_the_context_is_refused_in_one_line(draft):
    backend = LlamaCppBackend(draft.model)
    backend.score([1, 2, 3], last_only=True)
    with pytest.raises(DraftlabError, match="context holds"):
        backend.greedy_chain(4, backend.n_ctx)
    assert backend.cache_len == 3

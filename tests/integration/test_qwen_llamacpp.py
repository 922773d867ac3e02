"""The Qwen2.5-Coder pair on llama.cpp, both Q4_K_M files as shipped: greedy output of every drafter that runs there
equals plain decoding on the same backend at K in {1, 2, 3, 5, 8}, on a short prompt and on a long code edit (past
the ~256 cached tokens where llama.cpp's flash attention would round blocks differently). Skipped like
test_qwen_pair.py unless the pair is cached or DRAFTLAB_QWEN=1 (CI sets it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from draftlab.api import SpeculativeDecoder, encode_prompt
from draftlab.files.datasets import load_prompts
from draftlab.models import load_model
from tests.integration.test_qwen_pair import pytestmark  # noqa: F401 (integration, slow, skipped unless cached)

DRAFT = "model:qwen2.5-coder-0.5b"
DRAFTERS = ["ngram", DRAFT, f"tree:2x2:{DRAFT}", f"merged:ngram/{DRAFT}", f"staged:ngram/{DRAFT}"]
TOKENS = 40


@pytest.fixture(scope="module")
def target():
    return load_model("qwen2.5-coder-1.5b", backend="llamacpp")


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    edit = max(load_prompts("code-edit"), key=lambda p: len(p.text))  # the longest: ~470 tokens
    ids = [encode_prompt(target.tokenizer, "Write a Python function that returns the n-th Fibonacci number."),
           encode_prompt(target.tokenizer, edit.text)]
    assert len(ids[1]) > 256
    return ids


@pytest.fixture(scope="module")
def reference(target, prompts) -> list[list[int]]:
    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1)
    return [plain.generate(ids, max_new_tokens=TOKENS).token_ids for ids in prompts]


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_equals_plain_decoding_on_llamacpp(target, prompts, reference, drafter):
    for k in (1, 2, 3, 5, 8):
        decoder = SpeculativeDecoder.from_names(target, drafter=drafter, k=k)
        for ids, expected in zip(prompts, reference):
            out = decoder.generate(ids, max_new_tokens=TOKENS)
            assert out.token_ids == expected, f"{drafter} K={k}"
            if drafter != "ngram":
                assert out.stats.accepted > 0


@pytest.mark.slow
def test_loading_the_model_prints_no_llama_cpp_warnings():
    """llama.cpp's loader warns on this file ("control-looking token ... was not control-type"): draftlab passes on
    llama.cpp's errors only (llama-cpp-python's own callback printed its warnings on every load)."""
    load = "from draftlab.models import load_model; load_model('qwen2.5-coder-1.5b', backend='llamacpp')"
    run = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "control-looking token" not in run.stderr and "load:" not in run.stderr, run.stderr[-2000:]

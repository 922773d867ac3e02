"""Suffix decoding on the real SmolLM2: greedy output equals plain decoding in fp32, in bf16 and on llama.cpp,
chains and trees, K 4 to 24, with a cold cache and a warm one (each prompt's answer already seen once)."""

from __future__ import annotations

import pytest

from tests.required import ARCTIC, unless

from draftlab.api import SpeculativeDecoder
from draftlab.backends import gguf
from draftlab.drafters import suffix
from draftlab.models import load_model
from tests.tiers import exhaustive

pytestmark = [pytest.mark.integration, unless(suffix.available(), ARCTIC, suffix.INSTALL_HINT)]
SLOW = pytest.mark.slow

PROMPTS = [
    "Rewrite this code with type hints and return it whole:\ndef add(a, b):\n    total = a + b\n    return total\n",
    "Rename the variable `items` to `values` and return the whole function:\n"
    "def mean(items):\n    if not items:\n        return 0.0\n    return sum(items) / len(items)\n",
]
SPECS = ["suffix", exhaustive("suffix:tree,min_prob=0.05")]
KS = (4, 8, 16, 24)
TOKENS = 40


def check_cold_and_warm(target, spec: str) -> None:
    """Per K a new decoder (an empty cache): the prompts once (cold, then learning), then again (warm)."""
    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1)
    expected = [plain.generate(p, max_new_tokens=TOKENS).token_ids for p in PROMPTS]
    for k in KS:
        decoder = SpeculativeDecoder.from_names(target, drafter=spec, k=k)
        steps = {}
        for phase in ("cold", "warm"):
            assert (decoder.drafter.cache.held > 0) == (phase == "warm")
            runs = [decoder.generate(p, max_new_tokens=TOKENS) for p in PROMPTS]
            for run, reference in zip(runs, expected):
                assert run.token_ids == reference, f"{spec} k={k} {phase}"
            steps[phase] = sum(r.stats.steps for r in runs)
        assert steps["warm"] < steps["cold"], f"{spec} k={k}: the warm cache saved no step"
        assert decoder.drafter.cache.held == 2 * len(PROMPTS)


@pytest.mark.parametrize("spec", SPECS)
@SLOW
def test_suffix_greedy_equals_plain_decoding_fp32(spec):
    check_cold_and_warm(load_model("smollm2-135m", dtype="fp32"), spec)


@pytest.mark.parametrize("spec", SPECS)
@SLOW
def test_suffix_greedy_equals_plain_decoding_bf16(spec):
    check_cold_and_warm(load_model("smollm2-135m", dtype="bf16"), spec)


@pytest.mark.parametrize("spec", SPECS)
@SLOW
@pytest.mark.skipif(not gguf.available(), reason=gguf.INSTALL_HINT)
def test_suffix_greedy_equals_plain_decoding_on_llamacpp(spec):
    check_cold_and_warm(load_model("smollm2-135m", backend="llamacpp"), spec)


@pytest.mark.slow
def test_a_cache_directory_carries_what_was_learned_to_a_new_decoder(tmp_path):
    target = load_model("smollm2-135m", dtype="fp32")
    spec = f"suffix:cache={tmp_path / 'suffix'}"
    first = SpeculativeDecoder.from_names(target, drafter=spec, k=16)
    cold = first.generate(PROMPTS[1], max_new_tokens=TOKENS)
    second = SpeculativeDecoder.from_names(target, drafter=spec, k=16)  # a new process would do the same
    assert second.drafter.cache.held == 1
    response = cold.token_ids
    second.drafter.begin([1, 2, 3])  # another request whose own text has none of the answer
    assert second.drafter.propose([1, 2, 3, *response[:8]], 16, None, None).tokens == response[8:16]
    second.drafter.finish([1, 2, 3])
    assert second.generate(PROMPTS[1], max_new_tokens=TOKENS).token_ids == response

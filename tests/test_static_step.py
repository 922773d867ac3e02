"""The static step (`draftlab.backends.static_step`): the passes a GPU replays as CUDA graphs, run eagerly on the CPU.

Greedy speculation through it equals its own plain decoding token for token, chains and trees, across the cache's
growth; taps come back per row as scored alone; CUDA graphs are refused off CUDA in one line. The shape matrix
(`tests/test_shape_matrix.py`) checks its rows bitwise on real models' shapes.
"""

from __future__ import annotations

import pytest
import torch

from draftlab.backends import FastLlamaBackend
from draftlab.backends.static_step import StaticStep
from draftlab.decoding.policy import FixedK
from draftlab.decoding.step import Block
from draftlab.drafters import ModelDrafter, NGramDrafter, NoDrafter
from draftlab.drafters.tree import TreeDrafter, TreeShape
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.errors import DraftlabError
from tests.conftest import noisy_copy, tiny_llama

STEP = StaticStep(False, "rows")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 9, 10, 9, 10, 11], [42]]
VOCAB = 64


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=VOCAB)


def generate(target, drafter, k: int, prompt: list[int]) -> list[int]:
    """Greedy output of a target whose cache starts at 64 entries (it grows past them), through the static step."""
    backend = FastLlamaBackend(target.model, capacity=16, invariant_rows=4, step=STEP)
    engine = SpeculativeEngine(backend, drafter, FixedK(k), context_length=512)
    return engine.generate(prompt, GenerationConfig(max_new_tokens=70)).token_ids


DRAFTERS = {
    "ngram": lambda target: NGramDrafter(max_n=3),
    "noisy model": lambda target: ModelDrafter(FastLlamaBackend(noisy_copy(target, 0.3).model)),
    "tree 2x2": lambda target: TreeDrafter(ModelDrafter(FastLlamaBackend(noisy_copy(target, 0.3).model)),
                                           TreeShape.parse("2x2"), VOCAB),
}


@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_speculation_through_the_static_step_equals_its_plain_decoding(target, name, k):
    for prompt in PROMPTS:
        plain = generate(target, NoDrafter(), 1, prompt)
        assert generate(target, DRAFTERS[name](target), k, prompt) == plain, f"{name} K={k} prompt={prompt}"


def test_the_static_step_names_itself_in_the_numerics_and_grows_its_cache_in_aligned_steps(target):
    backend = FastLlamaBackend(target.model, capacity=10, invariant_rows=4, step=STEP)
    assert backend.numerics == "fp32 exact-linear/4, static cache, attention by rows"
    backend.score(list(range(1, 40)), last_only=True)  # a prefill past the first 64 entries' last one
    backend.score([5])
    assert backend.cache_len == 40 and backend._keys[0].shape[1] % 64 == 0  # noqa: SLF001 (the cache's size)


def test_taps_come_back_per_row_as_each_row_scored_alone(target):
    backend = FastLlamaBackend(target.model, invariant_rows=4, step=STEP)
    backend.score([1, 2, 3, 4, 5], last_only=True)
    tokens = [7, 8, 9, 10, 11, 12]
    block = backend.score_block(Block.chain(tokens), with_hidden=True, taps=(0, 2))  # [6, 2 D]
    backend.rollback(5)
    alone = torch.cat([backend.score_block(Block.chain([t]), with_hidden=True, taps=(0, 2)).hidden for t in tokens])
    assert block.hidden.shape == (6, 2 * target.model.config.hidden_size)
    assert torch.equal(block.hidden, alone)


def test_cuda_graphs_and_unknown_steps_are_refused_in_one_line(target):
    with pytest.raises(DraftlabError, match="CUDA graphs need a CUDA device"):
        FastLlamaBackend(target.model, step=StaticStep(True, "rows"))
    with pytest.raises(DraftlabError, match="one of off, rows, block, graphs, graphs-block"):
        StaticStep.parse("fast")

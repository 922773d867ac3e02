"""Batch-invariant scoring: every row of a block is bitwise the row that scoring its token alone gives."""

from __future__ import annotations

import copy

import pytest
import torch

from draftlab.backends import FastLlamaBackend, make_backend
from draftlab.backends.numerics import INVARIANT_ROWS, invariant_linear
from draftlab.drafters import NGramDrafter, NoDrafter
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.errors import DraftlabError
from draftlab.decoding.policy import FixedK
from draftlab.decoding.step import Block
from tests.conftest import tiny_llama

PREFIX = [3, 14, 15, 92, 65, 35, 89]


def model_in(dtype: torch.dtype):
    """A tiny Llama wide enough that its products use the blocked GEMM kernels of real models."""
    model = copy.deepcopy(tiny_llama(vocab=256, layers=2, seed=11, hidden=128).model)
    return model.to(dtype)


def alone(model, prefix: list[int], tokens: list[int], rows: int | None = None) -> torch.Tensor:
    """Logits [n, V] of `tokens` scored one at a time after `prefix`."""
    backend = FastLlamaBackend(model, batch_invariant=True, invariant_rows=rows)
    backend.score(prefix)
    return torch.cat([backend.score([token]) for token in tokens])


@pytest.mark.parametrize("rows", [1, INVARIANT_ROWS], ids=["rows1", "rows16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_block_row_is_bitwise_the_row_scored_alone(dtype, rows):
    model = model_in(dtype)
    tokens = [(7 * i + 5) % 256 for i in range(16)]
    expected = alone(model, PREFIX, tokens, rows)  # [16, V]
    for n in range(1, 17):
        backend = FastLlamaBackend(model, batch_invariant=True, invariant_rows=rows)
        backend.score(PREFIX)
        block = backend.score_block(Block.chain(tokens[:n])).logits  # [n, V]
        assert torch.equal(block, expected[:n]), f"block of {n} differs from one-token scoring"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tree_rows_are_bitwise_their_path_scored_alone(dtype):
    model = model_in(dtype)
    tokens, parents = [10, 20, 30, 40, 50, 60], (-1, 0, 0, 1, 2, 4)
    backend = FastLlamaBackend(model, batch_invariant=True)
    backend.score(PREFIX)
    tree = backend.score_block(Block(tokens, parents)).logits  # [6, V]
    for node in range(len(tokens)):
        path = []
        at = node
        while at >= 0:
            path.insert(0, tokens[at])
            at = parents[at]
        assert torch.equal(tree[node], alone(model, PREFIX, path)[-1]), f"tree node {node}"
    backend.keep([0, 2, 4, 5])  # the path 10 -> 30 -> 50 -> 60, then one more token as decoding would
    assert torch.equal(backend.score([70]), alone(model, PREFIX, [10, 30, 50, 60, 70])[-1:])


def test_greedy_speculation_in_bf16_equals_autoregressive_bit_for_bit():
    model = model_in(torch.bfloat16)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    config = GenerationConfig(max_new_tokens=40)
    reference = SpeculativeEngine(FastLlamaBackend(model), NoDrafter(), FixedK(1), context_length=512).generate(
        prompt, config)
    for k in (1, 2, 3, 5, 8):
        engine = SpeculativeEngine(FastLlamaBackend(model), NGramDrafter(max_n=2, min_n=1), FixedK(k),
                                   context_length=512)
        result = engine.generate(prompt, config)
        assert result.token_ids == reference.token_ids, f"K={k}"
        assert result.stats.drafted > 0


def test_invariant_products_match_rows_alone_and_pad_to_fixed_chunks():
    weight = torch.randn(96, 80)
    x = torch.randn(2 * INVARIANT_ROWS + 3, 80)
    rows = torch.cat([invariant_linear(x[i : i + 1], weight) for i in range(x.shape[0])])
    assert torch.equal(invariant_linear(x, weight), rows)
    assert torch.allclose(rows, x @ weight.T, atol=1e-4)


def test_row_chunk_follows_the_measured_route():
    from draftlab.backends.routes import default_route

    model = model_in(torch.bfloat16)
    assert FastLlamaBackend(model).route == default_route(model.config, "bf16")  # timed on this host, cached
    assert FastLlamaBackend(model_in(torch.float32), batch_invariant=True, invariant_rows=16).invariant_rows == 16


def test_default_is_exact_in_every_dtype_drafts_opt_out_and_hf_refuses_it():
    assert FastLlamaBackend(model_in(torch.bfloat16)).batch_invariant
    assert FastLlamaBackend(model_in(torch.float32)).batch_invariant  # exact by construction in fp32 too
    assert not FastLlamaBackend(model_in(torch.float32), batch_invariant=False).batch_invariant
    with pytest.raises(DraftlabError, match="batch-invariant"):
        make_backend(model_in(torch.float32), kind="hf", batch_invariant=True)

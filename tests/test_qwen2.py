"""Qwen2 (Llama-like with q/k/v biases) in the fast backend, on a tiny random model: no download."""

from __future__ import annotations

import pytest
import torch

from draftlab.backends import FastLlamaBackend, make_backend
from draftlab.backends.hf import HFBackend
from draftlab.drafters import ModelDrafter, NGramDrafter, NoDrafter
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.policy import FixedK
from draftlab.step import Block

TOKENS = [5, 9, 2, 33, 17, 8, 41, 3, 3, 60, 12, 7]


def tiny_qwen2(seed: int = 0, layers: int = 3, hidden: int = 64, dtype: torch.dtype = torch.float32):
    """A random Qwen2ForCausalLM whose q/k/v biases are non-zero (HF initialises them to zero)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=96, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
        model.model.embed_tokens.weight.mul_(8.0)
    model.requires_grad_(False)
    return model.to(dtype)


def fresh_logits(model, tokens) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()  # [n, V]


def test_biases_are_live_so_the_test_can_fail():
    model = tiny_qwen2()
    without = tiny_qwen2()
    with torch.no_grad():
        for layer in without.model.layers:
            layer.self_attn.q_proj.bias.zero_()
    assert not torch.allclose(fresh_logits(model, TOKENS), fresh_logits(without, TOKENS), atol=1e-3)


def test_auto_picks_the_fast_backend_for_qwen2():
    assert isinstance(make_backend(tiny_qwen2()), FastLlamaBackend)


@pytest.mark.parametrize("backend_cls", [HFBackend, FastLlamaBackend])
def test_blocks_rollback_and_trees_match_a_fresh_forward(backend_cls):
    model = tiny_qwen2()
    reference = fresh_logits(model, TOKENS)  # [12, V]
    backend = backend_cls(model)
    torch.testing.assert_close(backend.score(TOKENS[:5]), reference[:5], rtol=1e-4, atol=1e-4)
    block = backend.score(TOKENS[5:9] + [1, 2])
    torch.testing.assert_close(block[:4], reference[5:9], rtol=1e-4, atol=1e-4)
    backend.rollback(9)
    rest = backend.score(TOKENS[9:])
    torch.testing.assert_close(rest, reference[9:], rtol=1e-4, atol=1e-4)
    if backend_cls is FastLlamaBackend:  # a tree: two branches after TOKENS[:9]
        backend.rollback(9)
        tree = backend.score_block(Block([TOKENS[9], 50, TOKENS[10], TOKENS[11]], (-1, 0, 0, 2))).logits
        torch.testing.assert_close(tree[[0, 2, 3]], reference[9:], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(tree[1], fresh_logits(model, TOKENS[:10] + [50])[-1], rtol=1e-4, atol=1e-4)


def test_bf16_block_rows_are_bitwise_the_rows_scored_alone():
    model = tiny_qwen2(hidden=128, dtype=torch.bfloat16)
    alone = FastLlamaBackend(model, batch_invariant=True)
    alone.score(TOKENS[:4])
    expected = torch.cat([alone.score([token]) for token in TOKENS[4:]])  # [8, V]
    block = FastLlamaBackend(model, batch_invariant=True)
    block.score(TOKENS[:4])
    assert torch.equal(block.score_block(Block.chain(TOKENS[4:])).logits, expected)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_with_a_qwen2_draft_equals_autoregressive(k):
    target, draft = tiny_qwen2(seed=0), tiny_qwen2(seed=0)
    with torch.no_grad():  # a draft that agrees often but not always
        for param in draft.parameters():
            param.add_(torch.randn_like(param) * 0.3 * param.std())
    prompt, config = [5, 6, 7, 5, 6, 7, 5, 6], GenerationConfig(max_new_tokens=30)
    reference = SpeculativeEngine(FastLlamaBackend(target), NoDrafter(), FixedK(1), 512).generate(prompt, config)
    for drafter in (ModelDrafter(FastLlamaBackend(draft)), NGramDrafter(max_n=2, min_n=1)):
        result = SpeculativeEngine(FastLlamaBackend(target), drafter, FixedK(k), 512).generate(prompt, config)
        assert result.token_ids == reference.token_ids, f"{type(drafter).__name__} K={k}"
        assert result.stats.drafted > 0 and result.stats.accepted > 0

"""Qwen2 (Llama-like with q/k/v biases) in the fast backend, on a tiny random model: no download."""

from __future__ import annotations

import pytest
import torch

from draftlab.backends import FastLlamaBackend, make_backend
from draftlab.backends.hf import HFBackend
from draftlab.drafters import ModelDrafter, NGramDrafter, NoDrafter
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.decoding.policy import FixedK
from draftlab.decoding.step import Block

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


def _loaded(model):
    from draftlab.models import LoadedModel

    return LoadedModel("tiny-qwen2", model, None, torch.device("cpu"), torch.float32)


def _run(target, drafter, k, prompt, max_new_tokens=40):
    engine = SpeculativeEngine(FastLlamaBackend(target.model), drafter, FixedK(k), context_length=512)
    return engine.generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens))


@pytest.mark.slow
def test_feature_draft_on_qwen2_copies_the_biases_trains_and_stays_lossless(tmp_path):
    """A feature draft for a Qwen2 target: its layer starts as the target's last (q/k/v biases included),
    training raises its agreement, the file loads back, and greedy output equals autoregressive."""
    from draftlab.design.feature import FeatureSettings, FeatureStudent, train_feature_draft
    from draftlab.drafters.anchored import FeatureDrafter
    from draftlab.drafters.feature import load_feature_draft, new_feature_draft

    target = _loaded(tiny_qwen2())
    draft = new_feature_draft(target, torch.arange(96))
    last = target.model.model.layers[-1].self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(draft.layer, name).bias, getattr(last, name).bias)
    assert float(last.q_proj.bias.abs().sum()) > 0  # live biases: a copy that dropped them would fail above
    # The tiny target's greedy text loops, which its own last layer already predicts; train from random.
    draft = new_feature_draft(target, torch.arange(96), init_layer=None)
    texts = [_run(target, NoDrafter(), 1, [i, i + 1], max_new_tokens=62).token_ids for i in range(40)]
    settings = FeatureSettings(budget_s=8.0, seq_len=32, batch_size=8, lr=3e-3, checkpoint_every_s=2.0,
                               held_out_fraction=0.1, feature_dtype="fp32")
    history = train_feature_draft(target, draft, texts, tmp_path, settings, "tiny-qwen2", progress=False)
    data = torch.load(tmp_path / "features.pt")
    fresh = FeatureStudent(new_feature_draft(target, torch.arange(96), init_layer=None), data,
                           int(data["tokens"].shape[0] * 0.9), tmp_path, FeatureSettings(), "tiny-qwen2")
    assert history[-1]["held_out_agreement"] > fresh.agreement() + 0.1
    loaded = load_feature_draft(tmp_path, target)
    assert loaded.layer.q_proj.bias is not None
    for prompt in ([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 9, 10, 9, 10, 11]):
        expected = _run(target, NoDrafter(), 1, prompt).token_ids
        for k in (1, 3):
            assert _run(target, FeatureDrafter(loaded), k, prompt).token_ids == expected, f"k={k} {prompt}"

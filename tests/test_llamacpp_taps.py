"""The inputs of target layers on llama.cpp (what EAGLE-3 drafts read): recorded by llama.cpp itself, bitwise the
same for a row of a block and the row alone, in block order for trees, leaving the logits as they were; and
EAGLE-3 drafting losslessly on a llama.cpp target from them."""

from __future__ import annotations

import pytest
import torch

from draftlab.api import SpeculativeDecoder
from draftlab.backends.llamacpp import LlamaCppBackend
from draftlab.backends.llamacpp_sequences import LlamaCppSequences
from draftlab.decoding.step import Block
from draftlab.errors import DraftlabError
from draftlab.models import load_model
from tests.tiers import exhaustive

TAPS = (2, 15, 27)  # the layers SmolLM2's shipped EAGLE-3 draft reads
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"


@pytest.fixture(scope="module")
def target():
    return load_model("smollm2-135m@Q4_0_PURE", backend="llamacpp")


@pytest.fixture(scope="module")
def prompt(target):
    return list(target.tokenizer(PROMPT)["input_ids"])


def test_a_blocks_tapped_rows_are_the_rows_alone_and_leave_the_logits_as_they_were(target, prompt):
    backend = LlamaCppBackend(target.model)
    untapped = backend.score_block(Block.chain(prompt)).logits  # [n, V]
    backend.reset()
    block = backend.score_block(Block.chain(prompt), True, taps=TAPS)
    assert block.hidden.shape == (len(prompt), 3 * 576) and torch.isfinite(block.hidden).all()
    assert torch.equal(block.logits, untapped)  # recording the layers' inputs changes no product
    backend.rollback(len(prompt) - 4)
    for i in range(len(prompt) - 4, len(prompt)):  # the block's last rows, one at a time
        alone = backend.score_block(Block.chain(prompt[i:i + 1]), True, taps=TAPS)
        assert torch.equal(alone.hidden[0], block.hidden[i]) and torch.equal(alone.logits[0], block.logits[i])


def test_a_trees_tapped_rows_come_in_block_order(target, prompt):
    backend = LlamaCppBackend(target.model)
    chain = backend.score_block(Block.chain(prompt), True, taps=TAPS).hidden  # [n, D']
    backend.rollback(len(prompt) - 3)
    a, b, c = prompt[-3:]
    wrong = (b + 1) % target.vocab_size
    # the block order puts the wrong branch first; llama.cpp's batch order (first children first) differs from it
    tree = backend.score_block(Block([a, wrong, b, c], (-1, 0, 0, 2)), True, taps=TAPS).hidden  # [4, D']
    assert torch.equal(tree[0], chain[-3])
    assert not torch.equal(tree[1, :576], tree[2, :576])  # layer 2's input differs between the branches
    backend.keep([0, 2, 3])
    assert backend.cache_len == len(prompt)


@pytest.mark.slow
def test_eagle3_drafts_losslessly_on_a_llama_cpp_target(target):
    expected = SpeculativeDecoder.from_names(target, drafter="none", k=1).generate(PROMPT, max_new_tokens=32)
    for spec in ("eagle3", "tree:2x2:eagle3"):
        decoder = SpeculativeDecoder.from_names(target, drafter=spec, k=3)
        result = decoder.generate(PROMPT, max_new_tokens=32)
        assert result.token_ids == expected.token_ids, spec
        assert result.stats.drafted > 0 and result.stats.accepted > 0, spec  # 8-18 of 48-140 accepted here


def test_each_slots_tapped_rows_in_one_decode_of_several_streams_are_its_rows_alone(target, prompt):
    """`draftlab serve`'s backend (a KV stream per slot): two slots' blocks of unequal lengths in one decode (llama.cpp
    splits it into ubatches and puts the rows back in order) give each slot bitwise the tapped inputs and logits of
    its rows scored alone, and a prefill chunk hands over every prompt row's."""
    alone = LlamaCppBackend(target.model)
    whole = alone.score_block(Block.chain(prompt), True, taps=TAPS)  # [n, V], [n, D']
    batch = LlamaCppSequences(target.model, 2, context=512)
    cut = [len(prompt) - 5, len(prompt) - 2]  # where each slot's block starts
    for slot, start in enumerate(cut):
        hidden = batch.prefill(slot, prompt[:start], final=True, with_hidden=True, taps=TAPS)  # [start, D']
        assert torch.equal(hidden, whole.hidden[:start])
    scored = batch.score_blocks({slot: Block.chain(prompt[start:]) for slot, start in enumerate(cut)}, True, TAPS)
    for slot, start in enumerate(cut):
        assert torch.equal(scored[slot].hidden, whole.hidden[start:]), slot
        assert torch.equal(scored[slot].logits, whole.logits[start:]), slot
    plain = batch.score_blocks({0: Block.chain(prompt[:1])})  # untapped again: logits only
    assert plain[0].hidden is None


def test_what_llama_cpp_cannot_hand_over_is_refused_in_one_line(target, prompt):
    backend = LlamaCppBackend(target.model)
    with pytest.raises(DraftlabError, match="not the final hidden states"):
        backend.score_block(Block.chain(prompt), True)
    with pytest.raises(DraftlabError, match="layers 0-29, not \\[2, 30\\]"):  # refused before llama.cpp aborts
        backend.score_block(Block.chain(prompt), True, taps=(2, 30))
    assert backend.cache_len == 0
    with pytest.raises(DraftlabError, match="torch weights"):  # a feature draft reads final hidden states
        SpeculativeDecoder.from_names(target, drafter="designed", k=3)


@pytest.mark.slow
@pytest.mark.parametrize("k", [3, exhaustive(1), exhaustive(6)])
def test_a_random_eagle3_layer_on_a_qwen2_target_in_llama_cpp_is_lossless(tmp_path, k):
    """Qwen2's llama.cpp graph hands over its layers' inputs through draftlab's build (scripts/build-llama-cpp.sh):
    an EAGLE-3 layer of random weights in the real shape, saved and loaded as a draft directory, drafts on the real
    0.5B in llama.cpp and the output is plain decoding's."""
    from draftlab.drafters.eagle3 import Eagle3Layer, Eagle3Shape, _assemble, save_eagle3_draft

    target = load_model("qwen2.5-coder-0.5b", backend="llamacpp")
    torch.manual_seed(0)
    layer = Eagle3Layer(Eagle3Shape.of(target.model.config, intermediate_size=256)).eval().requires_grad_(False)
    vocab_map = torch.arange(0, target.vocab_size, 16)  # [V'] every 16th token id
    save_eagle3_draft(_assemble(target, layer, vocab_map), tmp_path / "draft", target.name)
    expected = SpeculativeDecoder.from_names(target, drafter="none", k=1).generate(PROMPT, max_new_tokens=24)
    decoder = SpeculativeDecoder.from_names(target, drafter=f"model:{tmp_path / 'draft'}", k=k)
    result = decoder.generate(PROMPT, max_new_tokens=24)
    assert result.token_ids == expected.token_ids and result.stats.drafted > 0
    assert decoder.drafter.target_taps == (2, 12, 21)  # [2, L/2, L-3] of its 24 layers

"""The tree-shaped step contract: trees scored in one pass, accepted paths kept, chains as one-path trees.

Also: statistics count only what is committed, and a model draft's incremental
cache proposes exactly what a from-scratch recomputation proposes.
"""

from __future__ import annotations

import pytest
import torch

from draftlab.api import SpeculativeDecoder
from draftlab.backends import make_backend
from draftlab.backends.hf import HFBackend
from draftlab.backends.numerics import causal_mask, tree_mask
from draftlab.drafters.base import PerRequest
from draftlab.drafters import ModelDrafter, NGramDrafter, NoDrafter
from draftlab.drafters.anchored import FeatureDrafter
from draftlab.drafters.feature import new_feature_draft
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.models import load_model
from draftlab.decoding.policy import FixedK
from draftlab.decoding.sampling import SamplingConfig, logits_to_probs
from draftlab.decoding.step import ROOT, Block, Proposal
from tests.conftest import noisy_copy, tiny_model_dir

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
# A tree branching at two depths: root -> {a, b}; a -> {c, d}; b -> {e}; d -> {f}.
TREE_TOKENS = [11, 12, 13, 14, 15, 16]
TREE_PARENTS = (ROOT, ROOT, 0, 0, 1, 3)


def path_to(parents, node):
    """Proposal indices from the root's child down to `node`."""
    path = []
    while node != ROOT:
        path.append(node)
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("kind", ["hf", "fast"])
def test_tree_rows_equal_scoring_each_path_alone(tiny_target, kind):
    backend = make_backend(tiny_target.model, kind=kind)
    backend.reset()
    backend.score(PROMPT[:-1])
    block = Block.of(PROMPT[-1], Proposal(TREE_TOKENS, TREE_PARENTS))
    scores = backend.score_block(block, with_hidden=True)  # [7, V], [7, D]
    assert scores.logits.shape[0] == len(TREE_TOKENS) + 1
    for node in range(len(TREE_TOKENS)):
        path = [PROMPT[-1], *(TREE_TOKENS[i] for i in path_to(TREE_PARENTS, node))]
        alone = make_backend(tiny_target.model, kind=kind)
        alone.reset()
        alone.score(PROMPT[:-1])
        expected = alone.score_block(Block.chain(path), with_hidden=True)
        torch.testing.assert_close(scores.logits[node + 1], expected.logits[-1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(scores.hidden[node + 1], expected.hidden[-1], rtol=1e-5, atol=1e-5)


def test_keep_after_the_cache_grew_inside_a_forward(tiny_target):
    """A cache that grew during a forward holds inference tensors; keeping a side branch of the next block
    must still work (it once crashed the quick study) and leave the cache of a fresh prefill."""
    from draftlab.backends import FastLlamaBackend

    backend = FastLlamaBackend(tiny_target.model, capacity=16)
    prefix = [(i * 7) % 60 for i in range(40)]
    backend.score(prefix)  # 40 > 16: the buffers are reallocated inside the forward
    backend.score_block(Block.of(PROMPT[-1], Proposal(TREE_TOKENS, TREE_PARENTS)))
    accepted = path_to(TREE_PARENTS, 5)
    backend.keep([0, *(i + 1 for i in accepted)])
    probe = [9, 10]
    fresh = FastLlamaBackend(tiny_target.model)
    fresh.score([*prefix, PROMPT[-1], *(TREE_TOKENS[i] for i in accepted)])
    torch.testing.assert_close(backend.score(probe), fresh.score(probe), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["hf", "fast"])
def test_keep_leaves_the_cache_of_a_fresh_prefill_of_the_path(tiny_target, kind):
    backend = make_backend(tiny_target.model, kind=kind)
    backend.reset()
    backend.score(PROMPT[:-1])
    backend.score_block(Block.of(PROMPT[-1], Proposal(TREE_TOKENS, TREE_PARENTS)))
    accepted = path_to(TREE_PARENTS, 5)  # a -> d -> f: block rows 0, 1, 4, 6
    backend.keep([0, *(i + 1 for i in accepted)])
    sequence = [*PROMPT, *(TREE_TOKENS[i] for i in accepted)]
    assert backend.cache_len == len(sequence)
    probe = [9, 10]
    kept_logits = backend.score(probe)
    fresh = make_backend(tiny_target.model, kind=kind)
    fresh.reset()
    fresh.score(sequence)
    torch.testing.assert_close(kept_logits, fresh.score(probe), rtol=1e-5, atol=1e-5)


def test_hf_backend_hidden_states_equal_the_fast_backends(tiny_target):
    """Every backend that says it provides hidden states gives the same ones (after the final norm)."""
    block = Block.chain(PROMPT)
    fast, hf = make_backend(tiny_target.model, kind="fast"), make_backend(tiny_target.model, kind="hf")
    fast.reset()
    hf.reset()
    torch.testing.assert_close(hf.score_block(block, with_hidden=True).hidden,
                               fast.score_block(block, with_hidden=True).hidden, rtol=1e-5, atol=1e-5)


class AsTree(PerRequest):
    """Wraps a drafter and re-expresses its chains as explicit one-path trees (parents 0..n-2)."""

    def __init__(self, drafter):
        self.inner = drafter
        self.name = f"tree({drafter.name})"
        self.reads_target_hidden = drafter.reads_target_hidden
        self.target_taps = drafter.target_taps

    def begin(self, prompt_ids):
        self.inner.begin(prompt_ids)

    def observe(self, target_hidden):
        self.inner.observe(target_hidden)

    def finish(self, context):
        self.inner.finish(context)

    def propose(self, context, k, sampling, generator):
        chain = self.inner.propose(context, k, sampling, generator)
        return Proposal(chain.tokens, tuple(range(-1, len(chain) - 1)), chain.draft_probs)


def drafters(target):
    return {
        "ngram": lambda: NGramDrafter(max_n=3),
        "model": lambda: ModelDrafter(HFBackend(noisy_copy(target, 0.3).model)),
        "feature": lambda: FeatureDrafter(new_feature_draft(target, torch.arange(0, 64, 2))),
    }


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(1.0, top_p=0.9)], ids=["greedy", "sampling"])
@pytest.mark.parametrize("name", ["ngram", "model", "feature"])
def test_chain_as_one_path_tree_gives_identical_output_and_statistics(tiny_target, name, sampling):
    make = drafters(tiny_target)[name]
    config = GenerationConfig(max_new_tokens=40, sampling=sampling, seed=3)
    for prompt in (PROMPT, [9, 10, 9, 10, 9, 10, 11]):
        chain = SpeculativeEngine(make_backend(tiny_target.model, kind="fast"), make(), FixedK(3),
                                  context_length=512).generate(prompt, config)
        tree = SpeculativeEngine(make_backend(tiny_target.model, kind="fast"), AsTree(make()), FixedK(3),
                                 context_length=512).generate(prompt, config)
        assert tree.token_ids == chain.token_ids
        assert tree.stats.accepted_per_step_list == chain.stats.accepted_per_step_list
        assert tree.stats.drafted_per_step_list == chain.stats.drafted_per_step_list


def test_a_one_path_tree_is_verified_like_a_chain():
    one_path = Block.of(5, Proposal([1, 2, 3], (ROOT, 0, 1)))
    assert one_path.is_chain
    assert torch.equal(tree_mask(7, one_path.layout().ancestors), causal_mask(7, 4))
    assert not Block.of(5, Proposal([1, 2, 3], (ROOT, ROOT, 1))).is_chain
    with pytest.raises(Exception, match="parent"):
        Proposal([1, 2], (ROOT, 1))


def test_eos_inside_an_accepted_block_counts_only_committed_tokens(tiny_target):
    """A self-draft accepts all K=4 tokens, but EOS is the 3rd: 3 accepted, not 4."""
    expected = SpeculativeEngine(HFBackend(tiny_target.model), NoDrafter(), FixedK(1), context_length=512).generate(
        PROMPT, GenerationConfig(max_new_tokens=5)).token_ids
    eos = expected[2]
    assert eos not in expected[:2]
    engine = SpeculativeEngine(HFBackend(tiny_target.model), ModelDrafter(HFBackend(tiny_target.model)), FixedK(4),
                               context_length=512)
    stats = engine.generate(PROMPT, GenerationConfig(max_new_tokens=40, eos_token_ids=(eos,))).stats
    assert (stats.new_tokens, stats.steps, stats.drafted, stats.accepted) == (3, 1, 4, 3)
    assert stats.per_position_acceptance() == [1.0, 1.0, 1.0, 0.0]
    assert stats.tokens_per_step == 3.0


def test_stop_string_inside_a_block_with_a_real_tokenizer(tmp_path):
    """Through the API, with a real (word-level) tokenizer: tokens after the stop string are not counted."""
    target = load_model(str(tiny_model_dir(tmp_path / "tiny")))
    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1)
    prompt = "w1 w2 w3 w4 w5"
    expected = plain.generate(prompt, max_new_tokens=6, chat=False)
    words = expected.text.split()
    stop = f"{words[1]} {words[2]}"
    assert stop not in " ".join(words[:2])
    self_draft = SpeculativeDecoder.from_names(target, drafter=f"model:{tmp_path / 'tiny'}", k=5)
    result = self_draft.generate(prompt, max_new_tokens=40, chat=False, stop_strings=[stop])
    stats = result.stats
    assert result.stats.stop_reason == "stop_string"
    assert stats.new_tokens == 3 and stats.accepted == 3 and stats.drafted == 5


class Recording(ModelDrafter):
    """Remembers every context and proposal."""

    calls: list

    def propose(self, context, k, sampling, generator):
        proposal = super().propose(context, k, sampling, generator)
        self.calls.append((list(context), proposal))
        return proposal


@torch.inference_mode()
def recompute(model, context, tokens, sampling):
    """Draft distributions [k, V] for `tokens` after `context`, from a fresh forward of the whole sequence."""
    logits = model(input_ids=torch.tensor([list(context) + list(tokens)])).logits[0]  # [L + k, V]
    rows = logits[len(context) - 1 : len(context) - 1 + len(tokens)]  # [k, V]
    return rows if sampling.greedy else logits_to_probs(rows, sampling)


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(1.0)], ids=["greedy", "sampling"])
@pytest.mark.parametrize("kind", ["hf", "fast"])
def test_model_draft_cache_matches_recomputation_for_every_proposal(tiny_target, sampling, kind):
    draft = noisy_copy(tiny_target, 0.3)
    drafter = Recording(make_backend(draft.model, kind=kind))
    drafter.calls = []
    engine = SpeculativeEngine(HFBackend(tiny_target.model), drafter, FixedK(3), context_length=512)
    stats = engine.generate(PROMPT, GenerationConfig(max_new_tokens=40, sampling=sampling, seed=1)).stats
    assert 0 < stats.acceptance_rate < 1 and len(drafter.calls) > 5  # rejections force catch-up and rollback
    for context, proposal in drafter.calls:
        fresh = recompute(draft.model, context, proposal.tokens, sampling)
        if sampling.greedy:
            assert proposal.tokens == fresh.argmax(-1).tolist()
        else:
            torch.testing.assert_close(proposal.draft_probs, fresh, rtol=1e-4, atol=1e-5)

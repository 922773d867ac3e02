"""Token trees: shapes, consistency with chains, greedy identity and the target's exact joint distribution."""

from __future__ import annotations

import pytest
import torch

from draftlab.backends import FastLlamaBackend, make_backend
from draftlab.backends.hf import HFBackend
from draftlab.drafters import ModelDrafter, NoDrafter, build_layer_draft
from draftlab.drafters.anchored import FeatureDrafter
from draftlab.drafters.feature import new_feature_draft
from draftlab.drafters.tree import TreeDrafter, TreeShape
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.errors import DraftlabError
from draftlab.decoding.policy import AdaptiveConfidence, FixedK
from draftlab.registry import build_drafter, parse_drafter_spec
from draftlab.decoding.sampling import SamplingConfig
from draftlab.decoding.step import ROOT, Proposal
from tests.conftest import noisy_copy, tiny_llama
from tests.test_engine_sampling import K, SAMPLINGS, VOCAB, adversarial, assert_joint_matches, empirical_joint, exact_joint
from tests.tiers import exhaustive, matrix

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 9, 10, 9, 10, 11], [42]]
SHAPES = ["1", "2", "3x2x1", "2x2-5", "dyn-2-6", "1@0.5", "dyn-2-6@0.05", "2@auto"]


def run(target, drafter, k, prompt, backend="fast", max_new_tokens=40, **config):
    engine = SpeculativeEngine(make_backend(target.model, kind=backend), drafter, FixedK(k), context_length=512)
    return engine.generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens, **config))


def test_shapes_parse_and_print():
    assert TreeShape.parse("3x2x1") == TreeShape((3, 2, 1))
    assert TreeShape.parse("3x2x1-10").nodes == 10
    assert TreeShape.parse("dyn-2-8") == TreeShape((2,), expand=2, nodes=8)
    assert TreeShape.parse("1@0.3") == TreeShape((1,), min_prob=0.3)
    assert TreeShape.parse("2@auto") == TreeShape((2,), min_prob=0.3, adaptive=True)
    for text in ("3x2x1", "3x2x1-10", "dyn-2-8", "1", "1@0.3", "dyn-2-8@0.05", "2@auto"):
        assert str(TreeShape.parse(text)) == text
    assert TreeShape.parse("3x2").children(1) == 2 and TreeShape.parse("3x2").children(5) == 1  # then chains
    for bad in ("", "3x", "dyn-2", "0x2", "dyn-x-3", "a", "1@1.5", "2@x"):
        with pytest.raises(DraftlabError):
            TreeShape.parse(bad)


def test_within_cuts_a_tree_by_depth():
    # root children 0 and 1; 2 under 0; 3 under 2; 4 under 1
    proposal = Proposal([10, 11, 12, 13, 14], (ROOT, ROOT, 0, 2, 1), torch.eye(5)[:, :5])
    cut = proposal.within(2)
    assert cut.tokens == [10, 11, 12, 14] and cut.parents == (ROOT, ROOT, 0, 1)
    assert torch.equal(cut.draft_probs, torch.eye(5)[[0, 1, 2, 4]])
    assert proposal.within(3) is proposal
    assert Proposal([5, 6, 7]).within(2).tokens == [5, 6]


def _drafters(target):
    return {
        "layers": lambda: ModelDrafter(FastLlamaBackend(build_layer_draft(target, [0, 1]).model)),
        "layers-hf": lambda: ModelDrafter(HFBackend(build_layer_draft(target, [0, 3]).model)),
        "noisy": lambda: ModelDrafter(FastLlamaBackend(noisy_copy(target, 0.3).model)),
        "feature": lambda: FeatureDrafter(new_feature_draft(target, torch.arange(0, 64, 2))),
    }


@pytest.mark.parametrize("name", ["layers", "layers-hf", "noisy", "feature"])
def test_a_one_branch_tree_is_the_chain(tiny_target, name):
    """Shape '1' grows exactly the chain the drafter proposes itself: same tokens, same probabilities."""
    make = _drafters(tiny_target)[name]
    sampling = SamplingConfig(0.9)
    for greedy in (True, False):
        config = SamplingConfig(0.0) if greedy else sampling
        chains = run_proposals(tiny_target, make(), config, tree=False)
        trees = run_proposals(tiny_target, TreeDrafter(make(), TreeShape((1,)), 64), config, tree=True)
        for chain, tree in zip(chains, trees):
            assert chain.tokens == tree.tokens
            if not greedy:
                torch.testing.assert_close(chain.draft_probs, tree.draft_probs, rtol=1e-5, atol=1e-6)


def run_proposals(target, drafter, sampling, tree):
    """Proposals of depth 4 at three points of one sequence, each from the same seed."""
    backend = FastLlamaBackend(target.model)
    context = list(PROMPTS[0])
    drafter.begin(context)
    proposals = []
    backend.reset()
    for extra in ([], [20, 21], [22]):
        context += extra
        hidden = backend.score_block(_chain(context[backend.cache_len : -1]), with_hidden=True).hidden
        if hidden is not None and len(hidden):
            drafter.observe(hidden)
        proposals.append(drafter.propose(context, 4, sampling, torch.Generator().manual_seed(len(context))))
    return proposals


def _chain(tokens):
    from draftlab.decoding.step import Block

    return Block.chain(tokens)


@pytest.fixture(scope="module")
def baselines(tiny_target):
    return [run(tiny_target, NoDrafter(), 1, p).token_ids for p in PROMPTS]


CASES = [("noisy", shape) for shape in SHAPES] + [
    (name, shape) for name in ("layers", "layers-hf", "feature") for shape in ("2", "3x2x1", "dyn-2-6@0.05")]


@pytest.mark.parametrize("name, shape", CASES)
def test_greedy_tree_output_equals_autoregressive(tiny_target, baselines, name, shape):
    make = _drafters(tiny_target)[name]
    for k in (1, 3):
        for prompt, expected in zip(PROMPTS, baselines):
            result = run(tiny_target, TreeDrafter(make(), TreeShape.parse(shape), 64), k, prompt)
            assert result.token_ids == expected, f"{name} {shape} k={k} prompt={prompt}"


def test_trees_branch_and_accept_more_than_chains(tiny_target):
    """A wide tree of a noisy draft accepts more tokens per step than its chain, and takes side branches."""
    make = _drafters(tiny_target)["noisy"]
    chain = run(tiny_target, make(), 3, PROMPTS[0], max_new_tokens=120)
    tree = run(tiny_target, TreeDrafter(make(), TreeShape.parse("3x2"), 64), 3, PROMPTS[0], max_new_tokens=120)
    assert tree.token_ids == chain.token_ids
    assert tree.stats.steps < chain.stats.steps
    assert max(tree.stats.drafted_per_step_list) > 3  # really a tree: more nodes than levels


def test_dynamic_tree_respects_its_node_budget(tiny_target):
    drafter = TreeDrafter(_drafters(tiny_target)["noisy"](), TreeShape.parse("dyn-2-6"), 64)
    result = run(tiny_target, drafter, 5, PROMPTS[1])
    assert max(result.stats.drafted_per_step_list) <= 6


def test_confidence_stop_drafts_less_when_unsure(tiny_target):
    make = _drafters(tiny_target)["noisy"]
    fixed = run(tiny_target, TreeDrafter(make(), TreeShape.parse("1"), 64), 6, PROMPTS[0])
    stopped = run(tiny_target, TreeDrafter(make(), TreeShape.parse("1@0.6"), 64), 6, PROMPTS[0])
    assert stopped.token_ids == fixed.token_ids
    assert fixed.stats.drafted_per_step_list[0] == 6  # without the stop a chain is always K long (room allowing)
    assert stopped.stats.drafted < fixed.stats.drafted and stopped.stats.acceptance_rate > fixed.stats.acceptance_rate


def test_adaptive_stop_moves_with_acceptance(tiny_target):
    """A draft that is always right drives the threshold down (draft deeper); a poor one drives it up."""
    perfect = TreeDrafter(ModelDrafter(FastLlamaBackend(tiny_target.model)), TreeShape.parse("1@auto"), 64)
    result = run(tiny_target, perfect, 4, PROMPTS[0])
    assert result.stats.acceptance_rate == 1.0 and perfect.min_prob < 0.3
    poor = TreeDrafter(FeatureDrafter(new_feature_draft(tiny_target, torch.arange(0, 64, 2))),
                       TreeShape.parse("1@auto"), 64)
    result = run(tiny_target, poor, 4, PROMPTS[0])
    assert result.stats.acceptance_rate < 0.5 and poor.min_prob != 0.3  # the engine's policy moved it
    policy = AdaptiveConfidence(FixedK(4), poor.confidence_stop())
    policy.begin()
    assert poor.min_prob == 0.3 and policy.next_k() == 4
    policy.observe(2, 0)  # nothing accepted: stop sooner
    assert poor.min_prob == pytest.approx(0.3 * AdaptiveConfidence.UP)
    policy.observe(2, 2)  # the deepest path accepted whole: draft further
    assert poor.min_prob == pytest.approx(0.3 * AdaptiveConfidence.UP * AdaptiveConfidence.DOWN)
    policy.observe(0, 0)  # nothing drafted: no move
    assert poor.min_prob == pytest.approx(0.3 * AdaptiveConfidence.UP * AdaptiveConfidence.DOWN)


def test_tree_specs_in_the_registry(tiny_target):
    plan = parse_drafter_spec("tree:3x2-8:layers:0-1", 4)
    assert plan.kind == "tree" and plan.tree == TreeShape((3, 2), nodes=8) and plan.inner.layers == (0, 1)
    built = build_drafter("tree:2:layers:0-1", tiny_target)
    assert built.drafter.name.startswith("tree:2:")
    with pytest.raises(DraftlabError, match="no logits"):
        build_drafter("tree:2:ngram", tiny_target)
    with pytest.raises(DraftlabError, match="tree shape"):
        parse_drafter_spec("tree:2y:layers:0-1", 4)
    with pytest.raises(DraftlabError, match="chains only"):
        from draftlab.contenders.hf import hf_assist

        hf_assist(parse_drafter_spec("tree:2:layers:0-1", 4), built.model, 2)


@pytest.fixture(scope="module")
def toy():
    target = tiny_llama(vocab=VOCAB, layers=1, seed=5, hidden=16)
    with torch.no_grad():
        target.model.lm_head.weight.mul_(0.15)
    return target


@pytest.mark.parametrize("draft, name, shape", matrix(
    {("noisy", "t1", "2x2"), ("adversarial", "t0.8-top3", "dyn-2-5@0.2")},
    ["noisy", "adversarial"], ["t1", "t0.8-top3"], ["2x2", "dyn-2-5@0.2", "2@auto"]))
@pytest.mark.slow  # statistical: `pytest -m slow`, which CI runs too
def test_tree_sampling_keeps_the_joint_distribution(toy, draft, name, shape):
    """Siblings drawn without replacement, verified by recursive rejection sampling: the target's exact law."""
    sampling = SAMPLINGS[name]
    draft_model = noisy_copy(toy, 0.8, seed=2) if draft == "noisy" else adversarial(toy)
    drafter = TreeDrafter(ModelDrafter(FastLlamaBackend(draft_model.model)), TreeShape.parse(shape), VOCAB)
    engine = SpeculativeEngine(FastLlamaBackend(toy.model), drafter, FixedK(K), context_length=512)
    counts, first_drafted = empirical_joint(engine, sampling)
    assert max(first_drafted) > 1  # the first step really drafted siblings
    assert_joint_matches(counts, exact_joint(toy.model, sampling))


@pytest.mark.parametrize("name", ["t1", exhaustive("t1-top0.85")])
@pytest.mark.slow  # statistical: `pytest -m slow`, which CI runs too
def test_feature_tree_sampling_keeps_the_joint_distribution(toy, name):
    drafter = TreeDrafter(FeatureDrafter(new_feature_draft(toy, torch.arange(0, VOCAB, 2))), TreeShape.parse("2x2"),
                          VOCAB)
    engine = SpeculativeEngine(FastLlamaBackend(toy.model), drafter, FixedK(K), context_length=512)
    counts, _ = empirical_joint(engine, SAMPLINGS[name])
    assert_joint_matches(counts, exact_joint(toy.model, SAMPLINGS[name]))


# Merged trees: an n-gram guide's chain is one branch, the draft's tokens the others.

MERGED = [("noisy", "1"), ("noisy", "2"), ("noisy", "dyn-2-6@0.05"), ("feature", "2x2-6"), ("layers", "2@auto")]


def _merged(make, shape, guide=None):
    from draftlab.drafters.ngram import NGramDrafter

    return TreeDrafter(make(), TreeShape.parse(shape), 64, guide or NGramDrafter(3, 1))


@pytest.mark.parametrize("name, shape", MERGED)
def test_greedy_merged_tree_output_equals_autoregressive(tiny_target, baselines, name, shape):
    make = _drafters(tiny_target)[name]
    for k in (1, 4):
        for prompt, expected in zip(PROMPTS, baselines):
            result = run(tiny_target, _merged(make, shape), k, prompt)
            assert result.token_ids == expected, f"{name} {shape} k={k} prompt={prompt}"


def test_merged_tree_puts_the_guide_chain_first_and_keeps_its_token_out_of_the_siblings(tiny_target):
    from tests.test_staged import ConstantGuess

    make = _drafters(tiny_target)["noisy"]
    alone = make()
    alone.begin(PROMPTS[0])
    top = int(torch.argmax(alone.root_logits(PROMPTS[0])))
    for greedy in (True, False):
        sampling = SamplingConfig(0.0 if greedy else 1.0)
        drafter = _merged(make, "2", ConstantGuess(top))
        drafter.begin(PROMPTS[0])
        proposal = drafter.propose(PROMPTS[0], 3, sampling, torch.Generator().manual_seed(0))
        root = [i for i, p in enumerate(proposal.parents) if p == ROOT]
        assert len(root) == 3 and proposal.tokens[root[0]] == top  # the guide's token, then two of the draft's
        assert top not in [proposal.tokens[i] for i in root[1:]]
        assert [proposal.tokens[i] for i, p in enumerate(proposal.parents) if p == root[0]][0] == top  # its chain
        if not greedy:
            assert proposal.draft_probs[root[0], top] == 1.0  # a one-hot draft
            assert all(float(proposal.draft_probs[i, top]) == 0.0 for i in root[1:])  # drawn without the guide's


def test_merged_tree_accepts_the_guide_where_the_draft_is_wrong(tiny_target):
    """On a repetitive sequence a weak draft's tree gains from the n-gram branch; outputs stay equal."""
    make = _drafters(tiny_target)["feature"]
    prompt = [5, 6, 7, 8, 9] * 6
    tree = run(tiny_target, TreeDrafter(make(), TreeShape.parse("2"), 64), 4, prompt, max_new_tokens=60)
    merged = run(tiny_target, _merged(make, "2"), 4, prompt, max_new_tokens=60)
    assert merged.token_ids == tree.token_ids
    assert merged.stats.steps < tree.stats.steps


def test_merged_specs_in_the_registry(tiny_target):
    plan = parse_drafter_spec("merged:ngram:2-4/tree:2:layers:0-1", 4)
    assert plan.kind == "merged" and plan.helper.ngram == (2, 4) and plan.inner.tree == TreeShape((2,))
    built = build_drafter("merged:ngram/layers:0-1", tiny_target)
    assert built.drafter.name.startswith("merged:ngram:1-3/tree:1:") and built.drafter.shape == TreeShape((1,))
    with pytest.raises(DraftlabError, match="looks its tokens up"):
        build_drafter("merged:layers:0/tree:2:layers:0-1", tiny_target)
    with pytest.raises(DraftlabError, match="no logits"):
        build_drafter("merged:ngram/ngram", tiny_target)
    from draftlab.contenders.hf import hf_assist

    with pytest.raises(DraftlabError, match="chains only"):
        hf_assist(plan, built.model, 2)


@pytest.mark.parametrize("draft, guide, shape", matrix({("noisy", "ngram", "1")},
                                                      ["noisy", "adversarial"], ["ngram", "constant"], ["1", "2x2"]))
@pytest.mark.slow  # statistical: `pytest -m slow`, which CI runs too
def test_merged_tree_sampling_keeps_the_joint_distribution(toy, draft, guide, shape):
    """One-hot guide nodes, then the draft's siblings without the guide's token: the target's exact law."""
    from draftlab.drafters.ngram import NGramDrafter
    from tests.test_staged import ConstantGuess

    sampling = SAMPLINGS["t1"] if shape == "1" else SAMPLINGS["t0.8-top3"]
    draft_model = noisy_copy(toy, 0.8, seed=2) if draft == "noisy" else adversarial(toy)
    helper = NGramDrafter(3, 1) if guide == "ngram" else ConstantGuess(0)
    drafter = TreeDrafter(ModelDrafter(FastLlamaBackend(draft_model.model)), TreeShape.parse(shape), VOCAB, helper)
    engine = SpeculativeEngine(FastLlamaBackend(toy.model), drafter, FixedK(K), context_length=512)
    counts, first_drafted = empirical_joint(engine, sampling)
    assert min(first_drafted) > K  # the guide's branch beside the draft's
    assert_joint_matches(counts, exact_joint(toy.model, sampling))

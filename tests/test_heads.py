"""Decoder heads (Medusa-style): lossless as chains and trees, training, files, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from draftlab.backends import FastLlamaBackend
from draftlab.design.heads import HeadsSettings, HeadsStudent, train_heads
from draftlab.drafters import NoDrafter
from draftlab.drafters.heads import HeadsDrafter, is_heads_draft, load_heads_draft, new_heads_draft, save_heads_draft
from draftlab.drafters.tree import TreeDrafter, TreeShape
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.errors import DraftlabError
from draftlab.decoding.policy import FixedK
from draftlab.registry import build_drafter
from draftlab.decoding.sampling import SamplingConfig
from tests.conftest import tiny_llama
from tests.test_engine_sampling import K, SAMPLINGS, VOCAB, assert_joint_matches, empirical_joint, exact_joint
from tests.tiers import matrix

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 9, 10, 9, 10, 11], [42]]
CUT = torch.arange(0, 64, 2)  # heads that can only propose even token ids


def run(target, drafter, k, prompt, max_new_tokens=40, **config):
    engine = SpeculativeEngine(FastLlamaBackend(target.model), drafter, FixedK(k), context_length=512)
    return engine.generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens, **config))


def random_heads(target, vocab_map, count=4, seed=3, scale=0.5):
    """Heads with random weights: each head guesses something of its own."""
    draft = new_heads_draft(target, vocab_map, count)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.heads.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * scale / param.shape[-1] ** 0.5)
    return draft


@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory):
    """Heads trained for a few seconds on the tiny target's own greedy outputs (from a fixed global seed: the heads'
    initialization draws from it, so what ran before must not change them)."""
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("heads")
    texts = [run(tiny_target, NoDrafter(), 1, [i, i + 1], max_new_tokens=62).token_ids for i in range(40)]
    draft = new_heads_draft(tiny_target, torch.arange(64), 3)
    # a step budget: the same training on every host (the agreement it reaches does not depend on the host's speed)
    settings = HeadsSettings(max_steps=1000, seq_len=32, batch_size=8, lr=1e-2, checkpoint_every_s=0.25,
                             held_out_fraction=0.1, feature_dtype="fp32")
    history = train_heads(tiny_target, draft, texts, out, settings, "tiny", progress=False)
    return draft, history, out


@pytest.fixture(scope="module")
def baselines(tiny_target):
    return [run(tiny_target, NoDrafter(), 1, p).token_ids for p in PROMPTS]


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("heads", ["trained", "random-cut"])
def test_greedy_chain_equals_autoregressive(tiny_target, trained, baselines, k, heads):
    draft = trained[0] if heads == "trained" else random_heads(tiny_target, CUT)
    for prompt, expected in zip(PROMPTS, baselines):
        result = run(tiny_target, HeadsDrafter(draft), k, prompt)
        assert result.token_ids == expected, f"k={k} prompt={prompt}"
        assert max(result.stats.drafted_per_step_list) <= min(k, draft.heads.count)


@pytest.mark.parametrize("shape", ["2", "3x2x1", "2x2-5", "dyn-2-6@0.05"])
def test_greedy_tree_equals_autoregressive(tiny_target, baselines, shape):
    draft = random_heads(tiny_target, CUT)
    for k in (1, 3, 6):
        for prompt, expected in zip(PROMPTS, baselines):
            result = run(tiny_target, TreeDrafter(HeadsDrafter(draft), TreeShape.parse(shape), 64), k, prompt)
            assert result.token_ids == expected, f"{shape} k={k} prompt={prompt}"
            assert max(result.stats.depth_per_step_list) <= min(k, 4)


def test_a_one_branch_tree_is_the_chain(tiny_target):
    from tests.test_trees import run_proposals

    draft = random_heads(tiny_target, CUT)
    for sampling in (SamplingConfig(0.0), SamplingConfig(0.9)):
        chains = run_proposals(tiny_target, HeadsDrafter(draft), sampling, tree=False)
        trees = run_proposals(tiny_target, TreeDrafter(HeadsDrafter(draft), TreeShape((1,)), 64), sampling, tree=True)
        for chain, tree in zip(chains, trees):
            assert chain.tokens == tree.tokens and len(chain.tokens) == 4
            if not sampling.greedy:
                torch.testing.assert_close(chain.draft_probs, tree.draft_probs)


def test_all_nodes_of_a_tree_level_read_the_same_head(tiny_target):
    """Heads do not see the drafted path: the children of every node at one depth are the same tokens."""
    from tests.test_trees import run_proposals

    proposals = run_proposals(tiny_target, TreeDrafter(HeadsDrafter(random_heads(tiny_target, CUT)),
                                                       TreeShape((2, 2)), 64), SamplingConfig(0.0), tree=True)
    for proposal in proposals:
        tokens, parents = proposal.tokens, proposal.tree
        first, second = [i for i, p in enumerate(parents) if p == -1]
        children = lambda node: [tokens[i] for i, p in enumerate(parents) if p == node]  # noqa: E731
        assert children(first) == children(second) and len(children(first)) == 2


def test_training_raises_agreement_and_acceptance(tiny_target, trained):
    draft, history, out = trained
    assert len(history) >= 2
    data = torch.load(out / "features.pt")
    untrained = HeadsStudent(new_heads_draft(tiny_target, torch.arange(64), 3), data,
                             int(data["tokens"].shape[0] * 0.9), out, HeadsSettings(), "tiny")
    before, after = untrained.agreements(), draft.made["held_out_agreement_per_head"]
    assert len(after) == 3 and after[0] > before[0] + 0.1, (before, after)
    assert all(a >= b - 0.02 for a, b in zip(after, before)), (before, after)  # no head got worse
    fresh = run(tiny_target, HeadsDrafter(new_heads_draft(tiny_target, torch.arange(64), 3)), 3, PROMPTS[0])
    result = run(tiny_target, HeadsDrafter(draft), 3, PROMPTS[0])
    assert 0 < result.stats.acceptance_rate < 1
    assert result.stats.acceptance_rate > fresh.stats.acceptance_rate


def test_save_load_round_trip_and_registry(tiny_target, trained):
    draft, history, out = trained
    assert is_heads_draft(out)
    loaded = load_heads_draft(out, tiny_target)
    assert loaded.made["train"]["history"] == history and loaded.heads.count == 3
    for key, value in draft.heads.state_dict().items():  # saved in bf16
        assert torch.equal(loaded.heads.state_dict()[key], value.to(torch.bfloat16).float()), key
    built = build_drafter(f"model:{out}", tiny_target)
    assert isinstance(built.drafter, HeadsDrafter) and built.model is None
    tree = build_drafter(f"tree:2x2:model:{out}", tiny_target)
    assert run(tiny_target, tree.drafter, 3, PROMPTS[1]).token_ids == run(tiny_target, NoDrafter(), 1, PROMPTS[1]).token_ids


def test_training_resumes_from_the_checkpoint(tiny_target, trained, capsys):
    draft, history, out = trained
    settings = HeadsSettings(max_steps=1200, seq_len=32, batch_size=8, lr=1e-2, checkpoint_every_s=0.25,
                             held_out_fraction=0.1, feature_dtype="fp32")
    more = train_heads(tiny_target, draft, [], out, settings, "tiny", progress=False)  # cached features
    assert f"resuming from step {history[-1]['step']}" in capsys.readouterr().out
    assert more[: len(history)] == history and more[-1]["step"] > history[-1]["step"]


def test_errors(tiny_target, tmp_path):
    save_heads_draft(random_heads(tiny_target, CUT), tmp_path / "h", "tiny")
    with pytest.raises(DraftlabError, match="another shape"):
        load_heads_draft(tmp_path / "h", tiny_llama(hidden=48))
    with pytest.raises(DraftlabError, match="tokens"):
        load_heads_draft(tmp_path / "h", tiny_llama(vocab=32))
    with pytest.raises(DraftlabError, match="at least one head"):
        new_heads_draft(tiny_target, CUT, 0)
    with pytest.raises(DraftlabError):
        HeadsSettings(decay=0.0)
    (tmp_path / "h" / "weights.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(DraftlabError, match="damaged"):
        load_heads_draft(tmp_path / "h", tiny_target)


@pytest.mark.parametrize("name, shape", matrix({("t1", "2x2")}, ["t1", "t0.8-top3"], [None, "2x2"]))
@pytest.mark.slow  # statistical: `pytest -m slow`, which CI runs too
def test_heads_keep_the_joint_distribution(name, shape):
    """Half-vocabulary random heads (forcing residual draws), as a chain and a tree: the target's exact law."""
    toy = tiny_llama(vocab=VOCAB, layers=1, seed=5, hidden=16)
    with torch.no_grad():
        toy.model.lm_head.weight.mul_(0.15)
    heads = HeadsDrafter(random_heads(toy, torch.arange(0, VOCAB, 2), count=K, scale=2.0))
    drafter = heads if shape is None else TreeDrafter(heads, TreeShape.parse(shape), VOCAB)
    engine = SpeculativeEngine(FastLlamaBackend(toy.model), drafter, FixedK(K), context_length=512)
    counts, first_drafted = empirical_joint(engine, SAMPLINGS[name])
    assert max(first_drafted) >= K
    assert_joint_matches(counts, exact_joint(toy.model, SAMPLINGS[name]))


@pytest.mark.slow
def test_design_heads_command_trains_on_a_feature_drafts_features(trained, tmp_path):
    """`draftlab design heads --features DIR` reuses cached target features; the heads work through the API."""
    from draftlab.contenders.plain import autoregressive
    from draftlab.api import SpeculativeDecoder
    from tests.conftest import tiny_model_dir

    _, _, source = trained  # its features.pt: the same format a feature draft caches
    model = tiny_model_dir(tmp_path / "tiny")  # the same weights as tiny_target, with a tokenizer
    out = tmp_path / "heads"
    command = [sys.executable, "-m", "draftlab.cli", "design", "heads", "--target", str(model), "--features",
               str(source), "--heads", "2", "--vocab", "40", "--out", str(out), "--budget", "2",
               "--checkpoint-every", "1", "--seq-len", "32", "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "output rows cover" in done.stdout and "heads 1..2" in done.stdout
    record = json.loads((out / "draftlab_draft.json").read_text())
    assert record["heads"] == 2 and record["vocab_size"] == 40 and len(record["made"]["held_out_agreement_per_head"]) == 2
    decoder = SpeculativeDecoder.from_names(str(model), drafter=f"model:{out}", k=3)
    expected = autoregressive(decoder).generate("w1 w2 w3", max_new_tokens=20, chat=False).token_ids
    assert decoder.generate("w1 w2 w3", max_new_tokens=20, chat=False).token_ids == expected
    missing = [*command[: command.index("--features") + 1], str(tmp_path / "nowhere"),
               *command[command.index("--features") + 2 :]]
    refused = subprocess.run(missing, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "no cached target features" in refused.stderr

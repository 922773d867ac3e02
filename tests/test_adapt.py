"""Online adaptation: the draft learns from the target's own hidden states, and outputs stay the target's."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from draftlab.api import SpeculativeDecoder
from draftlab.backends import FastLlamaBackend
from draftlab.drafters import NoDrafter
from draftlab.drafters.adapt import AdaptingDrafter, AdaptSettings
from draftlab.drafters.anchored import FeatureDrafter
from draftlab.drafters.feature import new_feature_draft, save_feature_draft
from draftlab.drafters.heads import HeadsDrafter, new_heads_draft
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.errors import DraftlabError
from draftlab.decoding.policy import FixedK
from draftlab.registry import adapt_spec, build_drafter, parse_drafter_spec
from tests.conftest import tiny_llama
from tests.test_engine_sampling import K, SAMPLINGS, VOCAB, assert_joint_matches, empirical_joint, exact_joint
from tests.tiers import exhaustive

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 9, 10, 9, 10, 11], [42, 17, 5], [30, 31, 32, 33]]
FAST = AdaptSettings(lr=3e-3, every=8, steps=2, window=32, batch=2)


def engine_for(target, drafter, k=3):
    return SpeculativeEngine(FastLlamaBackend(target.model), drafter, FixedK(k), context_length=512)


def adapting(target, settings=FAST):
    source = FeatureDrafter(new_feature_draft(target, torch.arange(64)))
    return AdaptingDrafter(source, source, settings, "tiny", "new")


def test_options_parse_and_bad_options_fail_in_one_line():
    assert AdaptSettings.parse("") == AdaptSettings()
    settings = AdaptSettings.parse("lr=2e-3,every=16,steps=2")
    assert (settings.lr, settings.every, settings.steps) == (2e-3, 16, 2)
    assert settings.label == "lr=0.002,every=16,steps=2"
    plan = parse_drafter_spec("adapt:every=16/tree:2x2:designed")
    assert plan.kind == "adapt" and plan.adapt.every == 16 and plan.inner.kind == "tree"
    assert parse_drafter_spec("adapt/designed").inner.kind == "designed"
    assert adapt_spec("designed", "") == "adapt/designed" and adapt_spec("designed", None) == "designed"
    for bad in ("adapt:rate=1/designed", "adapt:every=x/designed", "adapt:every=0/designed"):
        with pytest.raises(DraftlabError) as info:
            parse_drafter_spec(bad)
        assert "\n" not in str(info.value)


def test_drafts_without_a_feature_layer_are_refused(tiny_target):
    with pytest.raises(DraftlabError, match="adapt learns feature drafts and decoder heads"):
        build_drafter("adapt/ngram", tiny_target)


def test_the_drafter_counts_what_the_verifier_accepted(tiny_target):
    """The engine hands each verdict to the drafter: its own count equals the run's accepted tokens."""
    drafter = adapting(tiny_target)
    runs = [engine_for(tiny_target, drafter).generate(p, GenerationConfig(max_new_tokens=30)) for p in PROMPTS]
    assert drafter.requests == [(r.stats.drafted, r.stats.accepted) for r in runs]
    assert any(r.stats.accepted for r in runs)


@pytest.mark.parametrize("reread", [0, 1])
def test_greedy_output_equals_plain_decoding_while_the_draft_learns(tiny_target, reread):
    drafter = adapting(tiny_target, replace(FAST, reread=reread))
    start = {k: v.clone() for k, v in drafter.source.draft.layer.state_dict().items()}
    engine, plain = engine_for(tiny_target, drafter), engine_for(tiny_target, NoDrafter(), 1)
    for prompt in PROMPTS * 2:
        config = GenerationConfig(max_new_tokens=40)
        assert engine.generate(prompt, config).token_ids == plain.generate(prompt, config).token_ids
    assert drafter.learner.steps >= 2 * len(PROMPTS) * 2 and len(drafter.requests) == 2 * len(PROMPTS)
    changed = [k for k, v in drafter.source.draft.layer.state_dict().items() if not torch.equal(v, start[k])]
    assert "fc.weight" in changed and "q_proj.weight" in changed


@pytest.mark.slow
def test_acceptance_rises_on_a_stream_it_learns_from(tiny_target):
    """A draft that starts from a copy of the target's last layer learns the tiny target's own continuations."""
    static = FeatureDrafter(new_feature_draft(tiny_target, torch.arange(64)))
    learning = adapting(tiny_target)
    stream = [[i, i + 1, (3 * i) % 64] for i in range(0, 48, 4)]

    def acceptance(drafter, prompts):
        runs = [engine_for(tiny_target, drafter).generate(p, GenerationConfig(max_new_tokens=40)) for p in prompts]
        return sum(r.stats.accepted for r in runs) / sum(r.stats.drafted for r in runs)

    before = acceptance(static, stream)
    acceptance(learning, stream * 2)  # two passes to learn
    after = acceptance(learning.forgetful(), stream)
    assert after > before + 0.1, (before, after)
    assert learning.acceptance(len(stream)) > learning.acceptance() - 1e-9


def test_decoder_heads_adapt_losslessly_and_save_as_heads(tiny_target, tmp_path):
    source = HeadsDrafter(new_heads_draft(tiny_target, torch.arange(64), 3))
    drafter = AdaptingDrafter(source, source, FAST, "tiny", "heads")
    start = {k: v.clone() for k, v in drafter.source.draft.heads.state_dict().items()}
    engine, plain = engine_for(tiny_target, drafter), engine_for(tiny_target, NoDrafter(), 1)
    for prompt in PROMPTS:
        config = GenerationConfig(max_new_tokens=40)
        assert engine.generate(prompt, config).token_ids == plain.generate(prompt, config).token_ids
    assert drafter.learner.steps > 0
    assert any(not torch.equal(v, start[k]) for k, v in drafter.source.draft.heads.state_dict().items())
    out = drafter.save_learned(tmp_path / "heads")
    assert json.loads((out / "draftlab_draft.json").read_text())["made"]["adapt"]["base"] == "heads"
    reloaded = build_drafter(f"model:{out}", tiny_target).drafter
    forked = drafter.fork()  # a sweep cell's own: the base weights, shared target tensors
    assert forked.source.draft.head is drafter.source.draft.head
    assert all(torch.equal(v, start[k]) for k, v in forked.source.draft.heads.state_dict().items())
    ours = engine_for(tiny_target, drafter.forgetful()).generate(PROMPTS[0], GenerationConfig(max_new_tokens=30))
    theirs = engine_for(tiny_target, reloaded).generate(PROMPTS[0], GenerationConfig(max_new_tokens=30))
    assert ours.stats.accepted_per_step_list == theirs.stats.accepted_per_step_list


def test_warm_up_views_learn_nothing(tiny_target):
    drafter = adapting(tiny_target)
    view = drafter.forgetful()
    assert view is drafter.inner
    engine_for(tiny_target, view).generate(PROMPTS[0], GenerationConfig(max_new_tokens=30))
    assert drafter.learner.steps == 0 and drafter.requests == []


def test_save_writes_a_draft_that_reloads_and_drafts_the_same(tiny_target, tmp_path):
    drafter = adapting(tiny_target)
    engine = engine_for(tiny_target, drafter)
    for prompt in PROMPTS:
        engine.generate(prompt, GenerationConfig(max_new_tokens=30))
    out = drafter.save_learned(tmp_path / "adapted")
    record = json.loads((out / "draftlab_draft.json").read_text())["made"]["adapt"]
    assert record["base"] == "new" and record["requests"] == len(PROMPTS) and record["steps"] == drafter.learner.steps
    assert 0 <= record["acceptance_last"] <= 1 and record["positions"] > 0
    reloaded = build_drafter(f"model:{out}", tiny_target).drafter
    for prompt in PROMPTS:
        ours = engine_for(tiny_target, drafter.forgetful()).generate(prompt, GenerationConfig(max_new_tokens=30))
        theirs = engine_for(tiny_target, reloaded).generate(prompt, GenerationConfig(max_new_tokens=30))
        assert ours.stats.accepted_per_step_list == theirs.stats.accepted_per_step_list
    again = AdaptingDrafter(reloaded, reloaded, FAST, "tiny", "reloaded")
    engine_for(tiny_target, again).generate(PROMPTS[0], GenerationConfig(max_new_tokens=20))
    made = json.loads((again.save_learned(tmp_path / "twice") / "draftlab_draft.json").read_text())["made"]
    assert made["adapt"]["previous"]["requests"] == len(PROMPTS)


def test_a_damaged_adapted_draft_is_refused(tiny_target, tmp_path):
    out = save_feature_draft(new_feature_draft(tiny_target, torch.arange(64)), tmp_path / "d", "tiny")
    (out / "weights.safetensors").write_bytes(b"not weights")
    with pytest.raises(DraftlabError):
        build_drafter(f"adapt/model:{out}", tiny_target)


def test_the_api_adapts_and_saves(tmp_path):
    from tests.conftest import tiny_model_dir

    path = tiny_model_dir(tmp_path / "tiny")
    target = SpeculativeDecoder.from_names(str(path), drafter="none", k=1).target
    draft = save_feature_draft(new_feature_draft(target, torch.arange(64)), tmp_path / "feature", target.name)
    decoder = SpeculativeDecoder.from_names(target, drafter=f"model:{draft}", k=2, adapt=FAST)
    assert decoder.drafter.name.startswith("adapt:lr=0.003")
    decoder.generate("w1 w2 w3 w4", max_new_tokens=24, chat=False)
    assert decoder.drafter.learner.steps > 0
    assert (tmp_path / "out" / "weights.safetensors").exists() is False
    decoder.save_draft(str(tmp_path / "out"))
    assert (tmp_path / "out" / "weights.safetensors").exists()
    with pytest.raises(DraftlabError, match="does not adapt"):
        SpeculativeDecoder.from_names(target, drafter="ngram", k=2).save_draft(str(tmp_path / "x"))


@pytest.mark.parametrize("name", ["t1", exhaustive("t1-top0.85")])
@pytest.mark.slow  # statistical: `pytest -m slow`, which CI runs too
def test_adaptation_keeps_the_joint_distribution(name):
    """A half-vocabulary feature draft that takes an optimizer step every position: what it proposes changes all
    the time, and the joint law of the first K+1 tokens stays the target's."""
    toy = tiny_llama(vocab=VOCAB, layers=1, seed=5, hidden=16)
    with torch.no_grad():
        toy.model.lm_head.weight.mul_(0.15)
    settings = AdaptSettings(lr=1e-2, every=1, window=8, batch=2, buffer=64)
    source = FeatureDrafter(new_feature_draft(toy, torch.arange(0, VOCAB, 2)))
    drafter = AdaptingDrafter(source, source, settings, "toy", "new")
    engine = SpeculativeEngine(FastLlamaBackend(toy.model), drafter, FixedK(K), context_length=512)
    counts, first_drafted = empirical_joint(engine, SAMPLINGS[name])
    assert set(first_drafted) == {K} and drafter.learner.steps > 1000
    assert_joint_matches(counts, exact_joint(toy.model, SAMPLINGS[name]))

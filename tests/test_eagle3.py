"""EAGLE-3 drafts: lossless in the engine (chains and trees, greedy and sampling), training-time test consistent with
drafting, training, reproducible step budgets, files."""

from __future__ import annotations

import hashlib

import pytest
import torch

from draftlab.backends import FastLlamaBackend
from draftlab.backends.slots import BackendSlots
from draftlab.backends.hf import HFBackend
from draftlab.design.eagle3 import Eagle3Settings, Eagle3Student, train_eagle3_draft, unrolled
from draftlab.drafters import NoDrafter
from draftlab.drafters.anchored import AnchoredDrafter
from draftlab.drafters.eagle3 import Eagle3Shape, is_eagle3_draft, load_eagle3_draft, new_eagle3_draft
from draftlab.drafters.tree import TreeDrafter, TreeShape
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.errors import DraftlabError
from draftlab.decoding.kchoice import LoadK
from draftlab.decoding.policy import FixedK
from draftlab.registry import build_drafter
from draftlab.decoding.step import Block
from tests.conftest import tiny_llama
from tests.test_engine_sampling import (K, LENGTH, PROMPT, SAMPLINGS, VOCAB, assert_joint_matches, empirical_joint,
                                        exact_joint)
from tests.tiers import exhaustive

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 9, 10, 9, 10, 11], [42]]
TAPS = (0, 1, 2)


def run(target, drafter, k, prompt, max_new_tokens=40, backend=FastLlamaBackend, **config):
    engine = SpeculativeEngine(backend(target.model), drafter, FixedK(k), context_length=512)
    return engine.generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens, **config))


def texts(target, count=40):
    return [run(target, NoDrafter(), 1, [i, i + 1], max_new_tokens=62).token_ids for i in range(count)]


@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory):
    """An EAGLE-3 draft trained for 40 steps on the tiny target's own greedy outputs."""
    out = tmp_path_factory.mktemp("eagle3")
    draft = new_eagle3_draft(tiny_target, torch.arange(64), aux_layers=TAPS)
    settings = Eagle3Settings(max_steps=40, seq_len=32, batch_size=8, lr=3e-3, checkpoint_every_s=2.0,
                              held_out_fraction=0.1, feature_dtype="fp32")
    history = train_eagle3_draft(tiny_target, draft, texts(tiny_target), out, settings, "tiny", progress=False)
    return draft, history, out


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("vocab", ["full", "cut"])
def test_eagle3_greedy_equals_autoregressive(tiny_target, trained, k, vocab):
    draft = trained[0] if vocab == "full" else new_eagle3_draft(tiny_target, torch.arange(0, 64, 2), aux_layers=TAPS)
    for prompt in PROMPTS:
        expected = run(tiny_target, NoDrafter(), 1, prompt).token_ids
        result = run(tiny_target, AnchoredDrafter(draft, "eagle3"), k, prompt)
        assert result.token_ids == expected, f"k={k} prompt={prompt}"


@pytest.mark.parametrize("shape", ["2x2", "3x2x1", "dyn-2-6@0.05"])
def test_eagle3_trees_greedy_equal_autoregressive(tiny_target, trained, shape):
    for backend in (FastLlamaBackend, HFBackend):
        for prompt in PROMPTS:
            expected = run(tiny_target, NoDrafter(), 1, prompt, backend=backend).token_ids
            drafter = TreeDrafter(AnchoredDrafter(trained[0], "eagle3"), TreeShape.parse(shape), 64)
            result = run(tiny_target, drafter, 3, prompt, backend=backend)
            assert result.token_ids == expected, f"shape={shape} prompt={prompt} backend={backend.__name__}"


def test_training_time_test_drafts_what_the_drafter_drafts(tiny_target, trained):
    """The unrolled training forward and the cached drafter agree: at the last real position, step j's output is
    what the drafter's j-th drafted token is chosen from (greedy, fed the drafter's own tokens)."""
    draft = trained[0]
    context = texts(tiny_target, 1)[0][:30]
    backend = FastLlamaBackend(tiny_target.model)
    taps = backend.score_block(Block.chain(context[:-1]), with_hidden=True, taps=draft.taps).hidden  # [29, 3D]
    drafter = AnchoredDrafter(draft, "eagle3")
    drafter.begin(context)
    drafter.observe(taps)
    from draftlab.decoding.sampling import SamplingConfig

    proposal = drafter.propose(context, 3, SamplingConfig(0.0), None).tokens
    tokens = torch.tensor([context + proposal[:2]])  # the drafted tokens are what step 1, 2 read
    padded_taps = torch.cat([taps, taps.new_zeros(3, taps.shape[1])])[None]  # taps beyond the context are unread
    with torch.no_grad():
        outputs = unrolled(draft, padded_taps.float(), tokens, 3)
    last = len(context) - 2  # the newest real pair: (taps of x_{n-1}, x_n)
    chosen = [int(draft.vocab_map[draft.logits(outputs[j][0, last]).argmax()]) for j in range(3)]
    assert chosen == proposal


def test_training_raises_agreement_and_acceptance(tiny_target, trained):
    draft, history, out = trained
    assert len(history) >= 1 and history[-1]["step"] == 40
    assert len(history[-1]["held_out_agreement_by_depth"]) == 3
    fresh = new_eagle3_draft(tiny_target, torch.arange(64), aux_layers=TAPS)
    data = torch.load(out / "eagle3_features.pt")
    untrained = Eagle3Student(fresh, data, int(data["tokens"].shape[0] * 0.9), out, Eagle3Settings(), "tiny")
    assert history[-1]["held_out_agreement"] > untrained.agreement() + 0.1
    before = run(tiny_target, AnchoredDrafter(fresh, "eagle3"), 3, PROMPTS[0])
    after = run(tiny_target, AnchoredDrafter(draft, "eagle3"), 3, PROMPTS[0])
    assert 0 < after.stats.acceptance_rate < 1  # both verification paths are exercised
    assert after.stats.acceptance_rate > before.stats.acceptance_rate


def test_a_step_budget_makes_the_same_draft_twice(tiny_target, tmp_path):
    sequences = texts(tiny_target, 20)
    settings = Eagle3Settings(max_steps=6, seq_len=32, batch_size=4, checkpoint_every_s=1000, held_out_fraction=0.1,
                              feature_dtype="fp32")
    digests = []
    for name in ("a", "b"):
        draft = new_eagle3_draft(tiny_target, torch.arange(64), aux_layers=TAPS)
        train_eagle3_draft(tiny_target, draft, sequences, tmp_path / name, settings, "tiny", progress=False)
        digests.append(hashlib.sha256((tmp_path / name / "weights.safetensors").read_bytes()).hexdigest())
    assert digests[0] == digests[1]


def test_saved_draft_loads_back_and_drafts_the_same(tiny_target, trained):
    draft, _, out = trained
    assert is_eagle3_draft(out)
    loaded = load_eagle3_draft(out, tiny_target)
    assert loaded.taps == TAPS and torch.equal(loaded.vocab_map, draft.vocab_map)
    built = build_drafter(f"model:{out}", tiny_target)
    assert built.tree_source is built.drafter and built.learnable is None
    for prompt in PROMPTS[:2]:
        ours = run(tiny_target, AnchoredDrafter(draft, "eagle3"), 3, prompt)
        theirs = run(tiny_target, built.drafter, 3, prompt)
        assert ours.token_ids == theirs.token_ids
        assert ours.stats.acceptance_rate == theirs.stats.acceptance_rate


def test_a_built_draft_counts_its_weights_and_the_target_parts_it_reads(tiny_target, trained):
    draft, _, out = trained
    own = sum(p.numel() for p in draft.layer.parameters())
    built = build_drafter(f"model:{out}", tiny_target)
    assert built.parameters == own + draft.embed.numel() + draft.head.numel() > own  # as a layer draft's count
    assert build_drafter(f"tree:2x2:model:{out}", tiny_target).parameters == built.parameters
    assert build_drafter("ngram", tiny_target).parameters == 0
    layers = build_drafter("layers:0-1", tiny_target)
    assert layers.parameters == layers.model.num_parameters() > 0


def test_bad_drafts_and_shapes_are_refused(tiny_target, trained, tmp_path):
    with pytest.raises(DraftlabError, match="exactly 3 target layers"):
        Eagle3Shape.of(tiny_target.model.config, aux_layers=(0, 1))
    with pytest.raises(DraftlabError, match="must lie in"):
        Eagle3Shape.of(tiny_target.model.config, aux_layers=(0, 1, 9))
    other = tiny_llama(layers=6, seed=3, hidden=48)
    with pytest.raises(DraftlabError, match="another shape|other"):
        load_eagle3_draft(trained[2], other)
    (tmp_path / "draftlab_draft.json").write_text((trained[2] / "draftlab_draft.json").read_text())
    (tmp_path / "weights.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(DraftlabError, match="damaged"):
        load_eagle3_draft(tmp_path, tiny_target)
    with pytest.raises(DraftlabError, match="no eagle3 draft ships"):
        build_drafter("eagle3", tiny_target)


def test_eagle3_finds_the_draft_built_for_a_target_none_ships_for(tiny_target, trained, tmp_path, monkeypatch):
    from draftlab.drafters.shipped import built_draft_dir

    monkeypatch.setenv("DRAFTLAB_CACHE", str(tmp_path))
    with pytest.raises(DraftlabError, match=f"nor was one built in {built_draft_dir(tiny_target.name, 'eagle3')}"):
        build_drafter("eagle3", tiny_target)
    built = built_draft_dir(tiny_target.name, "eagle3")
    built.mkdir(parents=True)
    for name in ("draftlab_draft.json", "weights.safetensors"):
        (built / name).write_bytes((trained[2] / name).read_bytes())
    drafter = build_drafter("eagle3", tiny_target).drafter
    assert drafter.name == "eagle3" and drafter.target_taps == TAPS
    ours = run(tiny_target, AnchoredDrafter(trained[0], "eagle3"), 3, PROMPTS[0])
    assert run(tiny_target, drafter, 3, PROMPTS[0]).token_ids == ours.token_ids


@pytest.mark.parametrize("name", ["t1", exhaustive("t1-top0.85")])  # CI keeps [t1]
@pytest.mark.slow  # statistical: `pytest -m slow`, which CI runs too
def test_eagle3_keeps_the_joint_distribution(name):
    """K=3 drafts from a half-vocabulary EAGLE-3 draft (forcing residual draws) keep the target's joint law."""
    toy = tiny_llama(vocab=VOCAB, layers=3, seed=5, hidden=16)
    with torch.no_grad():
        toy.model.lm_head.weight.mul_(0.15)
    draft = new_eagle3_draft(toy, torch.arange(0, VOCAB, 2), aux_layers=(0, 1, 2))
    engine = SpeculativeEngine(FastLlamaBackend(toy.model), AnchoredDrafter(draft, "eagle3"), FixedK(K),
                               context_length=512)
    counts, first_drafted = empirical_joint(engine, SAMPLINGS[name])
    assert set(first_drafted) == {K}
    assert_joint_matches(counts, exact_joint(toy.model, SAMPLINGS[name]))


def test_runs_in_flight_draft_each_position_in_one_forward_and_decode_as_alone(tiny_target, trained):
    """`draftlab serve`'s step with an EAGLE-3 draft per request (`AnchoredDrafter.beside`): each run's draft takes
    its prompt in as the target prefills it, each step anchors each run on its new states, and each further draft
    position of all runs is one forward of the layer (3 runs at K=3: 2 forwards in the first step, not 6; then 3
    anchors and 2 forwards a step); every run's greedy tokens are plain decoding's alone."""
    prompts = PROMPTS[:2] + [[5, 6, 7, 5, 6]]
    slots = BackendSlots(lambda: FastLlamaBackend(tiny_target.model), 3, 512)
    engine = SpeculativeEngine(slots.view(0), AnchoredDrafter(trained[0], "eagle3"), context_length=512,
                               sequences=slots, chooser=LoadK.fixed(3))
    config = GenerationConfig(max_new_tokens=24)
    forwards = []
    hook = trained[0].layer.register_forward_hook(lambda module, args, out: forwards.append(tuple(out.shape[:2])))
    try:
        runs = [engine.start(prompt, config, lane=engine.lane_for(s)) for s, prompt in enumerate(prompts)]
        assert forwards == [(1, len(prompt) - 1) for prompt in prompts]  # each prompt taken in at its prefill
        forwards.clear()
        engine.step(runs)
        assert forwards == [(3, 1)] * 2
        forwards.clear()
        stepped = engine.step(runs)
    finally:
        hook.remove()
    anchors = sorted(shape for shape in forwards if shape[0] == 1)
    assert len(anchors) == 3 and forwards.count((3, 1)) == 2 and all(d == 3 for d in stepped.drafted)
    while not all(r.done for r in runs):
        engine.step([r for r in runs if not r.done])
    for served, prompt in zip(runs, prompts):
        assert served.new == run(tiny_target, NoDrafter(), 1, prompt, max_new_tokens=24).token_ids


@pytest.mark.slow  # statistical: `pytest -m slow`, which CI runs too
def test_eagle3_runs_in_flight_keep_the_joint_distribution():
    """Two runs stepped together, each drafting K=3 from a half-vocabulary EAGLE-3 draft in one forward per position
    (`AnchoredDrafter.propose_all`, its probabilities taken per run): each run's joint law is the target's."""
    toy = tiny_llama(vocab=VOCAB, layers=3, seed=5, hidden=16)
    with torch.no_grad():
        toy.model.lm_head.weight.mul_(0.15)
    draft = new_eagle3_draft(toy, torch.arange(0, VOCAB, 2), aux_layers=(0, 1, 2))
    slots = BackendSlots(lambda: FastLlamaBackend(toy.model), 2, 512)
    engine = SpeculativeEngine(slots.view(0), AnchoredDrafter(draft, "eagle3"), context_length=512, sequences=slots,
                               chooser=LoadK.fixed(K))
    lanes = [engine.lane_for(s) for s in range(2)]
    sampling, counts = SAMPLINGS["t1"], {}
    for seed in range(0, 3000, 2):
        runs = [engine.start(PROMPT, GenerationConfig(max_new_tokens=LENGTH, sampling=sampling, seed=seed + s),
                             lane=lane) for s, lane in enumerate(lanes)]
        first = engine.step(runs)
        assert first.drafted == [K, K]
        while not all(r.done for r in runs):
            engine.step([r for r in runs if not r.done])
        for r in runs:
            key = tuple(engine.finish(r).token_ids[:LENGTH])
            counts[key] = counts.get(key, 0) + 1
    assert_joint_matches(counts, exact_joint(toy.model, sampling))

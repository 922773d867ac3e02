"""Feature drafts (EAGLE-style): lossless in the engine, consistent caches, training, files."""

from __future__ import annotations

import pytest
import torch

from draftlab.backends.hf import HFBackend
from draftlab.design.feature import FeatureSettings, FeatureStudent, train_feature_draft
from draftlab.drafters import NoDrafter
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.errors import DraftlabError
from draftlab.backends import FastLlamaBackend
from draftlab.drafters.anchored import FeatureDrafter
from draftlab.drafters.feature import is_feature_draft, load_feature_draft, new_feature_draft
from draftlab.decoding.policy import FixedK
from draftlab.decoding.step import Block
from tests.conftest import tiny_llama
from tests.test_engine_sampling import K, SAMPLINGS, VOCAB, assert_joint_matches, empirical_joint, exact_joint
from tests.tiers import exhaustive

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 9, 10, 9, 10, 11], [42]]
CUT = torch.arange(0, 64, 2)  # a draft that can only propose even token ids


def run(target, drafter, k, prompt, max_new_tokens=40, **config):
    engine = SpeculativeEngine(FastLlamaBackend(target.model), drafter, FixedK(k), context_length=512)
    return engine.generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens, **config))


@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory):
    """A feature draft trained for a few seconds on the tiny target's own greedy outputs."""
    out = tmp_path_factory.mktemp("feature")
    texts = [run(tiny_target, NoDrafter(), 1, [i, i + 1], max_new_tokens=62).token_ids for i in range(40)]
    draft = new_feature_draft(tiny_target, torch.arange(64))
    # a step budget: the same training on every host (the agreement it reaches does not depend on the host's speed)
    settings = FeatureSettings(max_steps=400, seq_len=32, batch_size=8, lr=3e-3, checkpoint_every_s=0.25,
                               held_out_fraction=0.1, feature_dtype="fp32")
    history = train_feature_draft(tiny_target, draft, texts, out, settings, "tiny", progress=False)
    return draft, history, out


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("vocab", ["full", "cut"])
def test_feature_draft_greedy_equals_autoregressive(tiny_target, trained, k, vocab):
    draft = trained[0] if vocab == "full" else new_feature_draft(tiny_target, CUT)
    for prompt in PROMPTS:
        expected = run(tiny_target, NoDrafter(), 1, prompt).token_ids
        result = run(tiny_target, FeatureDrafter(draft), k, prompt)
        assert result.token_ids == expected, f"k={k} prompt={prompt}"


def test_training_raises_agreement_and_acceptance(tiny_target, trained):
    draft, history, out = trained
    assert len(history) >= 2
    data = torch.load(out / "features.pt")
    untrained_student = FeatureStudent(new_feature_draft(tiny_target, torch.arange(64)), data,
                                       int(data["tokens"].shape[0] * 0.9), out, FeatureSettings(), "tiny")
    assert history[-1]["held_out_agreement"] > untrained_student.agreement() + 0.1
    untrained = run(tiny_target, FeatureDrafter(new_feature_draft(tiny_target, torch.arange(64))), 3, PROMPTS[0])
    result = run(tiny_target, FeatureDrafter(draft), 3, PROMPTS[0])
    assert 0 < result.stats.acceptance_rate < 1  # both verification paths are exercised
    assert result.stats.acceptance_rate > untrained.stats.acceptance_rate


class Recording(FeatureDrafter):
    """Remembers every context and proposal, to replay them without a cache."""

    def __init__(self, draft):
        super().__init__(draft)
        self.calls = []

    def propose(self, context, k, sampling, generator):
        proposal = super().propose(context, k, sampling, generator)
        self.calls.append((list(context), proposal.tokens))
        return proposal


@torch.inference_mode()
def greedy_without_cache(target, draft, context, k):
    """What the draft proposes when everything is recomputed from scratch for this context."""
    hidden = FastLlamaBackend(target.model).score_block(Block.chain(context[:-1]), with_hidden=True).hidden  # [L-1, D]
    features, ids, tokens = hidden, list(context[1:]), []
    for _ in range(k):
        predicted = draft.predict(features[None], torch.tensor([ids]))[0]  # [n, D]
        token = int(draft.vocab_map[draft.logits(predicted[-1]).argmax()])
        tokens.append(token)
        features, ids = torch.cat([features, predicted[-1:]]), ids + [token]
    return tokens


def test_incremental_cache_matches_recomputation(tiny_target, trained):
    drafter = Recording(trained[0])
    run(tiny_target, drafter, 3, PROMPTS[0])
    assert len(drafter.calls) > 5
    for context, proposed in drafter.calls:
        assert proposed == greedy_without_cache(tiny_target, trained[0], context, len(proposed))


def test_save_load_round_trip(tiny_target, trained):
    draft, _, out = trained
    assert is_feature_draft(out)
    loaded = load_feature_draft(out, tiny_target)
    assert loaded.made["train"]["history"] == trained[1]
    torch.testing.assert_close(loaded.vocab_map, draft.vocab_map)
    saved, back = draft.layer.state_dict(), loaded.layer.state_dict()
    assert saved.keys() == back.keys()
    for key in saved:  # saved in bf16: the loaded weights are the saved ones rounded to bf16
        assert torch.equal(back[key], saved[key].to(torch.bfloat16).to(back[key].dtype)), key
    assert any(not torch.equal(back[k], new_feature_draft(tiny_target, draft.vocab_map).layer.state_dict()[k])
               for k in back)  # and they are the trained ones, not a fresh initialisation
    original = run(tiny_target, FeatureDrafter(draft), 3, PROMPTS[1])
    again = run(tiny_target, FeatureDrafter(loaded), 3, PROMPTS[1])
    assert again.token_ids == original.token_ids
    # bf16 files: agreement on the drafted tokens, not bit equality
    assert abs(again.stats.acceptance_rate - original.stats.acceptance_rate) < 0.2


def test_training_resumes_from_the_checkpoint(tiny_target, trained, capsys):
    draft, history, out = trained
    settings = FeatureSettings(max_steps=500, seq_len=32, batch_size=8, lr=3e-3, checkpoint_every_s=0.25,
                               held_out_fraction=0.1, feature_dtype="fp32")
    more = train_feature_draft(tiny_target, draft, [], out, settings, "tiny", progress=False)  # cached features
    assert f"resuming from step {history[-1]['step']}" in capsys.readouterr().out
    assert more[: len(history)] == history and more[-1]["step"] > history[-1]["step"]


class NoHiddenBackend(HFBackend):
    """A backend that says it cannot return hidden states."""

    provides_hidden = False


def test_errors(tiny_target, tmp_path):
    draft = new_feature_draft(tiny_target, CUT)
    with pytest.raises(DraftlabError, match="hidden states"):
        SpeculativeEngine(NoHiddenBackend(tiny_target.model), FeatureDrafter(draft), FixedK(2))
    other = tiny_llama(hidden=48)
    from draftlab.drafters.feature import save_feature_draft

    save_feature_draft(draft, tmp_path / "d", "tiny")
    with pytest.raises(DraftlabError, match="another shape"):
        load_feature_draft(tmp_path / "d", other)
    with pytest.raises(DraftlabError):
        FeatureSettings(seq_len=2)


@pytest.mark.parametrize("name", ["t1", exhaustive("t1-top0.85")])
@pytest.mark.slow  # statistical: `pytest -m slow`, which CI runs too
def test_feature_draft_keeps_the_joint_distribution(name):
    """K=3 drafts from a half-vocabulary feature draft (forcing residual draws) keep the target's joint law."""
    toy = tiny_llama(vocab=VOCAB, layers=1, seed=5, hidden=16)
    with torch.no_grad():
        toy.model.lm_head.weight.mul_(0.15)
    draft = new_feature_draft(toy, torch.arange(0, VOCAB, 2))
    engine = SpeculativeEngine(FastLlamaBackend(toy.model), FeatureDrafter(draft), FixedK(K), context_length=512)
    counts, first_drafted = empirical_joint(engine, SAMPLINGS[name])
    assert set(first_drafted) == {K}
    assert_joint_matches(counts, exact_joint(toy.model, SAMPLINGS[name]))


@pytest.mark.slow
def test_design_feature_command_builds_a_usable_draft(tmp_path):
    """`draftlab design feature` end to end on a tiny model, then the draft through the API."""
    import json
    import subprocess
    import sys

    from draftlab.contenders.plain import autoregressive
    from draftlab.api import SpeculativeDecoder
    from tests.conftest import tiny_model_dir

    model = tiny_model_dir(tmp_path / "tiny")
    prompts = tmp_path / "text.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{(i * 7 + j * j) % 60}" for j in range(40))}) + "\n"
                               for i in range(20)))
    out = tmp_path / "feature"
    command = [sys.executable, "-m", "draftlab.cli", "design", "feature", "--target", str(model), "--datasets",
               str(prompts), "--generate", "4", "--max-new-tokens", "8", "--vocab", "40", "--out", str(out),
               "--budget", "3", "--checkpoint-every", "1", "--seq-len", "16", "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "output rows cover" in done.stdout and "held-out agreement" in done.stdout
    record = json.loads((out / "draftlab_draft.json").read_text())
    assert record["vocab_size"] == 40 and record["made"]["text"]["generate"] == 4
    decoder = SpeculativeDecoder.from_names(str(model), drafter=f"model:{out}", k=3)
    expected = autoregressive(decoder).generate("w1 w2 w3", max_new_tokens=20, chat=False).token_ids
    assert decoder.generate("w1 w2 w3", max_new_tokens=20, chat=False).token_ids == expected
    other = [*command[:command.index("--generate") + 1], "5", *command[command.index("--generate") + 2:]]
    refused = subprocess.run(other, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "other text" in refused.stderr
    # a second round: new prompts (a range), the first round's text reused, its weights as the start
    second = [sys.executable, "-m", "draftlab.cli", "design", "feature", "--target", str(model), "--datasets",
              f"{prompts}:10-20", "--generate", "10", "--max-new-tokens", "8", "--reuse-text", str(out), "--init",
              str(out), "--out", str(tmp_path / "round2"), "--budget", "2", "--seq-len", "16", "--no-progress"]
    done = subprocess.run(second, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    made = json.loads((tmp_path / "round2" / "draftlab_draft.json").read_text())["made"]
    assert made["init"] == f"feature draft {out}" and made["text"]["tokens"] > record["made"]["text"]["tokens"]


def test_calibrate_charges_a_feature_draft_its_drafting_time(tmp_path):
    """Every drafter's cost is measured the same way: a feature draft is not free."""
    from draftlab.files.datasets import Prompt
    from draftlab.drafters.feature import save_feature_draft
    from draftlab.models import load_model
    from draftlab.perf.calibrate import CalibrationSettings, calibrate
    from tests.conftest import tiny_model_dir

    target = load_model(str(tiny_model_dir(tmp_path / "tiny")))
    save_feature_draft(new_feature_draft(target, torch.arange(64)), tmp_path / "f", "tiny")
    prompts = [Prompt(f"p{i}", "chat", " ".join(f"w{(i * 5 + j) % 60}" for j in range(16)), chat=False)
               for i in range(2)]
    profile = calibrate(target, [f"model:{tmp_path / 'f'}", "ngram"], prompts,
                        CalibrationSettings(k_max=3, max_new_tokens=32, repeats=2), progress=False)
    feature, ngram = profile.drafts
    assert feature.t_draft(1) > 0 and feature.t_draft(3) > feature.t_draft(1)
    assert ngram.t_draft(3) > 0
    # a model draft drafts every position it has room for: only the steps at the end of a run are cut short
    assert min(feature.drafted_at_least) > 0.8


def test_correlate_reads_a_feature_draft(trained, tmp_path):
    """`design correlate` scores a feature draft's perplexity and TAR instead of refusing it."""
    from draftlab.design.correlate import measure
    from draftlab.models import load_model
    from tests.conftest import tiny_model_dir

    _, _, out = trained
    target = load_model(str(tiny_model_dir(tmp_path / "tiny")))  # the same weights as tiny_target, with a tokenizer
    held_out = [[(i * 7 + j) % 64 for j in range(24)] for i in range(3)]
    (quality,) = measure(target, [f"model:{out}"], held_out, [], [PROMPTS[0]], 3, 16, progress=False)
    assert quality.layers == 1 and 1.0 < quality.perplexity < 64.0 * 4
    assert quality.tokens_per_step > 1.0

"""Bad input gets a clear DraftlabError; spec strings and prompt sets parse as documented."""

from __future__ import annotations

import json

import pytest

from draftlab.api import parse_drafter_spec, parse_layers
from draftlab.files.datasets import Prompt, balanced, load_prompts
from draftlab.drafters import NGramDrafter, build_layer_draft, check_compatible
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.errors import DraftlabError
from draftlab.models import ModelSpec, convert_gguf, resolve_directory
from draftlab.decoding.policy import DynamicK, FixedK
from draftlab.decoding.sampling import SamplingConfig
from tests.conftest import tiny_llama


def test_drafter_specs():
    assert parse_drafter_spec("ngram").ngram == (1, 3)
    assert parse_drafter_spec("ngram:4").ngram == (1, 4)
    assert parse_drafter_spec("ngram:2-5").ngram == (2, 5)
    assert parse_drafter_spec("none").kind == "none"
    assert parse_drafter_spec("model:/x/y").model == "/x/y"
    assert parse_drafter_spec("layers:0-3").layers == (0, 1, 2, 3)
    for bad in ("layers:", "ngram:x", "foo", "model:", "ngram:3-1", "ngram:0", "ngram:0-2"):
        with pytest.raises(DraftlabError):
            parse_drafter_spec(bad)


def test_layer_lists():
    assert parse_layers("0-3,26-29") == [0, 1, 2, 3, 26, 27, 28, 29]
    assert parse_layers("0-29:10") == [0, 10, 20]
    assert parse_layers("0,-1", num_layers=30) == [0, 29]
    with pytest.raises(DraftlabError):
        parse_layers("a-b")


def test_ngram_drafter_copies_latest_continuation():
    drafter = NGramDrafter(max_n=2)
    context = [1, 2, 3, 9, 1, 2, 4, 5, 6, 1, 2]
    assert drafter.propose(context, 3, SamplingConfig(), None).tokens == [4, 5, 6]
    assert drafter.propose([7, 8, 9], 3, SamplingConfig(), None).tokens == []
    assert drafter.propose([5, 5], 4, SamplingConfig(), None).tokens == [5]
    with pytest.raises(DraftlabError):
        NGramDrafter(max_n=1, min_n=2)


def test_k_and_sampling_validation():
    for bad in (lambda: FixedK(0), lambda: DynamicK(0), lambda: SamplingConfig(-0.1),
                lambda: SamplingConfig(1.0, top_p=0.0), lambda: SamplingConfig(1.0, top_k=-1),
                lambda: GenerationConfig(max_new_tokens=0), lambda: GenerationConfig(max_new_tokens=float("nan")),
                lambda: GenerationConfig(max_new_tokens=2.5), lambda: GenerationConfig(max_new_tokens=True),
                lambda: GenerationConfig(seed=float("nan")), lambda: SamplingConfig(float("nan"))):
        with pytest.raises(DraftlabError):
            bad()


def test_empty_prompt_and_context_overflow(tiny_backend):
    engine = SpeculativeEngine(tiny_backend, context_length=64)
    with pytest.raises(DraftlabError, match="empty"):
        engine.generate([], GenerationConfig())
    with pytest.raises(DraftlabError, match="reduce --max-new-tokens to 54"):
        engine.generate(list(range(10)), GenerationConfig(max_new_tokens=60))
    with pytest.raises(DraftlabError, match="shorten the prompt"):
        engine.generate(list(range(70)), GenerationConfig(max_new_tokens=1))


def test_generation_fills_the_context_exactly(tiny_target):
    from draftlab.drafters import ModelDrafter
    from draftlab.backends import make_backend

    engine = SpeculativeEngine(make_backend(tiny_target.model), ModelDrafter(make_backend(tiny_target.model)),
                               FixedK(8), context_length=40)
    result = engine.generate(list(range(1, 11)), GenerationConfig(max_new_tokens=30))
    assert result.stats.new_tokens == 30


def test_layer_draft_validation_and_no_mutation(tiny_target):
    layers_before = tiny_target.model.config.num_hidden_layers
    draft = build_layer_draft(tiny_target, [0, 2])
    assert draft.model.config.num_hidden_layers == 2
    assert tiny_target.model.config.num_hidden_layers == layers_before
    shared = draft.model.model.layers[1].mlp.up_proj.weight
    assert shared.data_ptr() == tiny_target.model.model.layers[2].mlp.up_proj.weight.data_ptr()
    for bad in ([], [0, 0], [4], [-1]):
        with pytest.raises(DraftlabError):
            build_layer_draft(tiny_target, bad)


def test_vocabulary_mismatch_is_refused(tiny_target):
    with pytest.raises(DraftlabError, match="same vocabulary"):
        check_compatible(tiny_target, tiny_llama(vocab=80))


def test_model_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTLAB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(DraftlabError, match="unknown model"):
        resolve_directory("no-such-model")
    with pytest.raises(DraftlabError, match="GGUF file not found"):
        resolve_directory(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DraftlabError, match="no config.json"):
        resolve_directory(str(tmp_path / "empty"))
    garbage = tmp_path / "broken.gguf"
    garbage.write_bytes(b"this is not a gguf file" * 10)
    with pytest.raises(DraftlabError, match="cannot read GGUF"):
        convert_gguf(garbage)
    with pytest.raises(DraftlabError, match="unknown dtype"):
        ModelSpec("x", dtype="int3").torch_dtype()


def test_user_prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "a", "category": "x"}) + "\n\n" + json.dumps({"prompt": "b", "id": "q2"}) + "\n")
    prompts = load_prompts(str(path))
    assert [(p.text, p.category) for p in prompts] == [("a", "x"), ("b", "custom")] and prompts[1].id == "q2"
    path.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(DraftlabError, match="prompts.jsonl:1"):
        load_prompts(str(path))
    with pytest.raises(DraftlabError, match="no prompt set"):
        load_prompts(str(tmp_path / "nope.jsonl"))


def test_balanced_limit_covers_categories():
    prompts = [Prompt(str(i), c, "t") for i, c in enumerate("aaaabbbc")]
    assert [p.category for p in balanced(prompts, 3)] == ["a", "b", "c"]
    assert len(balanced(prompts, None)) == 8


def test_text_selection_names_counts_and_ranges():
    from draftlab.design.corpus import _selection

    assert _selection("questions", 7) == ("questions", 0, 7)
    assert _selection("questions:40", 7) == ("questions", 0, 40)
    assert _selection("questions:960-2160", 7) == ("questions", 960, 1200)
    assert _selection("data/my:file.jsonl", 7) == ("data/my:file.jsonl", 0, 7)
    with pytest.raises(DraftlabError, match="A < B"):
        _selection("math:10-5", None)

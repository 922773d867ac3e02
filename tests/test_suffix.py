"""Suffix decoding's drafter and its cross-request cache, on token ids and a tiny model (no download)."""

from __future__ import annotations

import json

import pytest

from tests.required import ARCTIC, unless

from draftlab.measure import RunSettings
from draftlab.drafters import suffix
from draftlab.drafters.suffix import SuffixCache, SuffixDrafter, SuffixOptions
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.errors import DraftlabError
from draftlab.decoding.policy import FixedK
from draftlab.registry import parse_drafter_spec
from draftlab.decoding.sampling import SamplingConfig

pytestmark = unless(suffix.available(), ARCTIC, suffix.INSTALL_HINT)

GREEDY = SamplingConfig()
TEXT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


def run(drafter: SuffixDrafter, prompt: list[int], response: list[int], k: int = 8) -> list[int]:
    """Feed a request through the drafter as the engine does (committing `response`); tokens proposed per step."""
    drafter.begin(prompt)
    context, proposed = list(prompt), []
    for token in response:
        proposed.append(len(drafter.propose(context, k, GREEDY, None)))
        context.append(token)
    drafter.finish(context)
    return proposed


def test_options_parse_and_bad_options_fail_in_one_line():
    assert SuffixOptions.parse("") == SuffixOptions()
    options = SuffixOptions.parse("depth=32,factor=2,offset=1,min_prob=0,tree,responses=5,cache=some/dir")
    assert options == SuffixOptions(32, 2.0, 1.0, 0.0, True, 5, "some/dir")
    assert parse_drafter_spec("suffix:chain,responses=0").suffix == SuffixOptions(responses=0)
    for bad in ("depth=x", "speed=3", "tree=1", "depth=0", "min_prob=2", "cache="):
        with pytest.raises(DraftlabError, match="suffix option") as info:
            SuffixOptions.parse(bad)
        assert "\n" not in str(info.value)


def test_a_copy_in_the_prompt_is_proposed_as_long_as_the_match():
    drafter = SuffixDrafter(SuffixOptions(min_prob=0.0, responses=0))
    drafter.begin(TEXT + [1, 2])
    assert drafter.propose(TEXT + [1, 2, 5], 16, GREEDY, None).tokens == [6]  # a match of 1 speculates 1
    assert drafter.propose(TEXT + [1, 2, 5, 6, 7], 16, GREEDY, None).tokens == TEXT[3:6]
    assert drafter.propose(TEXT + [1, 2, 5, 6, 7], 2, GREEDY, None).tokens == TEXT[3:5]  # K caps it
    assert drafter.propose(TEXT + [1, 2, 99], 16, GREEDY, None).tokens == []  # nothing matches: nothing drafted


def test_earlier_responses_make_later_requests_warm_and_the_bound_holds():
    warm = SuffixDrafter(SuffixOptions(responses=2))
    cold = SuffixDrafter(SuffixOptions(responses=0))
    answer = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]
    for request in range(4):
        warm_drafted = run(warm, [request], answer)
        cold_drafted = run(cold, [request], answer)
        assert warm.cache.held == min(request + 1, 2) and cold.cache.held == 0
    assert sum(warm_drafted) > 2 * sum(cold_drafted)


def test_an_abandoned_request_is_not_kept():
    drafter = SuffixDrafter()
    drafter.begin([1, 2, 3])
    drafter.propose([1, 2, 3, 4], 4, GREEDY, None)
    drafter.begin([7])  # the first generation raised: its response is not stored
    drafter.finish([7, 8])
    assert drafter.cache.held == 1 and list(drafter.cache._held) == [[8]]


def test_the_cache_is_saved_appended_reloaded_and_compacted(tmp_path):
    store = tmp_path / "cache"
    drafter = SuffixDrafter(SuffixOptions(responses=3, cache=str(store)), tokenizer_id="tok-a")
    for request in range(8):
        run(drafter, [request], [60 + request, 61, 62, 63])
    assert len((store / suffix.RESPONSES_FILE).read_text().splitlines()) == 8  # one line appended per response
    with open(store / suffix.RESPONSES_FILE, "a") as f:
        f.write("[1, 2")  # a line a kill cut short
    reloaded = SuffixDrafter(SuffixOptions(responses=3, cache=str(store)), tokenizer_id="tok-a")
    assert reloaded.cache.held == 3 and list(reloaded.cache._held)[0] == [65, 61, 62, 63]
    assert len((store / suffix.RESPONSES_FILE).read_text().splitlines()) == 3  # compacted on load
    assert run(reloaded, [99], [61, 62, 63, 64]) == [0, 1, 1, 0]  # it drafts what it learned before
    assert run(SuffixDrafter(SuffixOptions(responses=3)), [99], [61, 62, 63, 64]) == [0, 0, 0, 0]
    assert json.loads((store / suffix.META_FILE).read_text())["tokenizer"] == "tok-a"
    with pytest.raises(DraftlabError, match="another tokenizer"):
        SuffixDrafter(SuffixOptions(cache=str(store)), tokenizer_id="tok-b")


def test_save_writes_a_directory_that_loads(tmp_path):
    cache = SuffixCache(responses=10)
    request = cache.start([1, 2])
    cache.extend(request, [3, 4, 5])
    cache.stop(request, [3, 4, 5])
    cache.save(tmp_path / "saved")
    assert SuffixCache(responses=10, store=tmp_path / "saved").held == 1


def test_a_missing_library_fails_with_one_line_naming_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_arctic(name, *args, **kwargs):
        if name.startswith("arctic_inference"):
            raise ImportError("No module named 'arctic_inference'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_arctic)
    with pytest.raises(DraftlabError, match="arctic-inference==0.3.0") as info:
        SuffixDrafter()
    assert "\n" not in str(info.value) and not suffix.available()


@pytest.mark.parametrize("spec", ["suffix", "suffix:tree,min_prob=0"])
def test_greedy_output_equals_plain_decoding_on_a_tiny_model_cold_and_warm(tiny_target, spec):
    from draftlab.backends import FastLlamaBackend
    from draftlab.registry import build_drafter

    backend = FastLlamaBackend(tiny_target.model)
    plain = SpeculativeEngine(backend, None, FixedK(1), context_length=512)
    drafter = build_drafter(spec, tiny_target).drafter
    prompts = [[1, 2, 3, 4, 5, 6, 1, 2, 3], [9, 8, 7, 9, 8, 7, 9], [1, 2, 3]]
    config = GenerationConfig(max_new_tokens=40)
    accepted = 0
    for k in (4, 8, 16, 24):
        engine = SpeculativeEngine(backend, drafter, FixedK(k), context_length=512)
        for prompt in prompts:
            out = engine.generate(prompt, config)
            assert out.token_ids == plain.generate(prompt, config).token_ids, f"{spec} k={k}"
            accepted += out.stats.accepted
    assert accepted > 0 and drafter.cache.held == 12


def test_a_race_never_times_a_prompt_with_its_own_earlier_answer(tmp_path):
    """The tuner's race repeats its prompts each round: a suffix candidate sees them as one stream per round."""
    from draftlab.api import SpeculativeDecoder
    from draftlab.measure import EncodedPrompt
    from draftlab.models import load_model
    from draftlab.perf.halving import run_round
    from tests.conftest import tiny_model_dir

    target = load_model(str(tiny_model_dir(tmp_path / "tiny")), dtype="fp32")
    decoders = {"suffix": SpeculativeDecoder.from_names(target, drafter="suffix", k=8)}
    prompts = [EncodedPrompt("a", "", [1, 2, 3, 4, 5]), EncodedPrompt("b", "", [6, 7, 8, 9])]
    rounds = [run_round(decoders, ["suffix"], prompts, RunSettings(24)).records["suffix"] for _ in range(2)]
    assert [r.token_ids for r in rounds[0]] == [r.token_ids for r in rounds[1]]
    assert [r.stats.cache_held for r in rounds[1]] == [0, 1]  # each round: a stream from an empty cache
    assert decoders["suffix"].drafter.held() == 0  # the decoder's own drafter learned nothing
    recalled = decoders["suffix"].drafter.fork()
    recalled.load_state({"responses": [r.token_ids for r in rounds[0]]})
    assert recalled.held() == 2 and decoders["suffix"].drafter.held() == 0
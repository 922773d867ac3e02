"""A new engine is one `backends.engines` entry and one contender module: a fake one, registered in those two
places only, is raced by a real study on a tiny model, compared with its own plain decoding and reported."""

from __future__ import annotations

import json

from draftlab.backends import engines
from draftlab.contenders.methods import choices, method_of
from draftlab.study.answer.results import StudyResults
from draftlab.study.run.config import SweepConfig
from draftlab.study.run.store import ResultsStore
from draftlab.study.run.sweep import run_sweep
from tests.conftest import tiny_model_dir
from tests.study import fake_engine

FAKE = engines.Engine("fake", "a fake engine", "", runs_gguf=False, torch_drafts=True, numerics=(),
                      methods_from="tests.study.fake_engine")


def test_a_study_races_an_engine_registered_in_two_places(tmp_path, monkeypatch):
    assert "fake-lookup" not in choices()
    monkeypatch.setattr(engines, "ENGINES", (*engines.ENGINES, FAKE))
    assert "fake-lookup" in choices() and method_of("fake-plain") is fake_engine.FAKE_PLAIN

    model = tiny_model_dir(tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{(i * 3 + j % 5) % 60}" for j in range(16)),
                                           "category": "code", "id": f"q{i}"}) + "\n" for i in range(3)))
    config = SweepConfig(targets=(str(model),), drafters=("ngram",), ks=(2, 3), methods=("fake-lookup",),
                         datasets=(str(prompts),), limit=3, max_new_tokens=16, warmup=0, dtype="fp32",
                         host_baselines=False, race_after=0, budget_s=0.0, preflight_s=0.0)
    fake_engine.CALLS.clear()
    store = ResultsStore(tmp_path / "study.sqlite")
    added = run_sweep(config, store, progress=False)

    rows = store.rows()
    by_method = {method: [r for r in rows if r["method"] == method] for method in ("ar", "fake-plain", "fake-lookup")}
    assert added == len(rows) == 3 * (1 + 1 + 2)  # prompts x (draftlab's plain, the fake's plain, its lookup at 2 Ks)
    assert len(by_method["fake-plain"]) == 3 and len(by_method["fake-lookup"]) == 6
    assert len(fake_engine.CALLS) >= 9  # every record of the fake engine came from its own contender
    # its outputs are compared with its own plain decoding and with draftlab's: the same greedy tokens
    # its speculation is checked against its own plain decoding (a peer's plain decoding rounds as its engine does:
    # not judged); this fake runs draftlab's decoder, so both give draftlab's greedy tokens
    assert all(r["identical"] for r in by_method["fake-lookup"])
    assert all(r["identical"] is None for r in by_method["fake-plain"])
    plain_sha = {r["prompt_id"]: r["output_sha"] for r in by_method["ar"]}
    assert all(r["output_sha"] == plain_sha[r["prompt_id"]] for r in by_method["fake-plain"] + by_method["fake-lookup"])
    store.close()

    results = StudyResults.load(tmp_path / "study.sqlite")
    lookups = [s for s in results.summaries if s.method == "fake-lookup"]
    assert {s.k for s in lookups} == {2, 3}
    assert all(s.engine_speedup is not None and s.engine_plain_tokens_per_s for s in lookups)

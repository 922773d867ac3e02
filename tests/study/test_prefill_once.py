"""Each engine prefills each prompt once, timed apart; every cell then decodes from that prefill, so its record is
the engine's prefill plus its own decode, whatever the number of cells."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from draftlab.study.run.store import ResultsStore
from draftlab.study.run.sweep import SweepConfig, run_sweep
from tests.conftest import tiny_model_dir


@pytest.mark.parametrize("ks", [(1,), (1, 2, 3, 4)])
def test_a_study_prefills_once_per_engine_and_prompt_whatever_its_cells(tmp_path, ks):
    model = tiny_model_dir(tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{(i * 5 + j) % 60}" for j in range(40)),
                                           "category": "chat", "id": f"q{i}"}) + "\n" for i in range(3)))
    config = SweepConfig(targets=(str(model),), drafters=("ngram", "layers:0-1"), ks=ks, methods=("sps", "asg"),
                         datasets=(str(prompts),), limit=3, max_new_tokens=12, warmup=1, baseline_every=2,
                         host_baselines=True, dtype="fp32", preflight_s=0)
    store = ResultsStore(tmp_path / "s.sqlite")
    run_sweep(config, store, progress=False)
    prefills, rows = store.prefills(), store.rows()
    store.close()
    engines = {p["engine"] for p in prefills}
    assert "draftlab" in engines and "hf" in engines  # draftlab's cells and HF's (plain and assisted)
    # One prefill per (engine, prompt): the cells of an engine (K, drafts, the baseline's re-checks) decode from it.
    assert Counter((p["engine"], p["prompt_id"]) for p in prefills) == {
        (engine, f"q{i}"): 1 for engine in engines for i in range(3)}
    assert all(p["prompt_tokens"] > 30 and p["seconds"] > 0 for p in prefills)
    # A record is one request: its engine's prefill of the prompt plus its decode.
    prefill_of = {(p["engine"], p["prompt_id"]): p["seconds"] for p in prefills}
    ours = [r for r in rows if r["method"] in ("ar", "sps")]
    assert len(ours) == 3 * (1 + 2 * len(ks))
    assert all(r["prefill_s"] == prefill_of[("draftlab", r["prompt_id"])] for r in ours)
    assert all(r["wall_s"] > r["prefill_s"] for r in ours)  # the prefill, then a decode after it
    # HF's generate prefills again in each call: its key's prefill, timed apart, is what the loop takes off its run
    assert all(r["prefill_s"] == prefill_of[("hf", r["prompt_id"])] for r in rows if r["method"] in ("hf", "asg"))
    # Greedy equality is kept: every lossless cell decodes what plain decoding does from the same prefill.
    assert all(r["identical"] == 1 for r in ours)

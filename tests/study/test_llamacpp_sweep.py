"""A real sweep of the embedded GGUF on both engines: draftlab's torch backend and llama.cpp, with llama-cpp-python's
own plain decoding and prompt lookup beside draftlab's, and the answer naming the fastest engine."""

from __future__ import annotations

import pytest

from draftlab.study.run import sweep
from draftlab.study.answer.recommend import engine_answer, recommend
from draftlab.study.answer.report import Drift, load_study, summarize
from draftlab.study.answer.tables import optimal_table
from draftlab.study.run.store import ResultsStore

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    config = sweep.SweepConfig(targets=("smollm2-135m", "llamacpp:smollm2-135m"), drafters=("ngram", "layers:0-3"),
                               ks=(2,), methods=("sps", "lcp"), datasets=("humaneval",), limit=2, max_new_tokens=16,
                               warmup=0, baseline_every=0, dtype="fp32", host_baselines=True, preflight_s=0)
    store = ResultsStore(root / "study.sqlite")
    sweep.run_sweep(config, store, progress=False)
    store.close()
    return root / "study.sqlite"


@pytest.mark.slow
def test_each_engine_runs_its_own_cells(study, capsys):
    rows, params, envs = load_study(study)
    on_llamacpp = [r for r in rows if r["target"] == "llamacpp:smollm2-135m"]
    methods = {(r["method"], r["drafter"]) for r in on_llamacpp}
    assert {("ar", "none"), ("llama", "none"), ("sps", "ngram"), ("sps", "layers:0-3"), ("lcp", "ngram"),
            ("plain", "llama.cpp repack")} == methods  # the layer draft from a GGUF of the target's first 4 layers
    assert all(r["backend"] == "llamacpp" and r["dtype"] == "gguf" for r in on_llamacpp)
    on_torch = {(r["method"], r["drafter"]) for r in rows if r["target"] == "smollm2-135m"}
    # llama.cpp's default kernels run once, on the llama.cpp target
    assert ("sps", "layers:0-3") in on_torch and ("plain", "llama.cpp repack") not in on_torch
    assert params["llamacpp:smollm2-135m::layers:0-3"] < params["llamacpp:smollm2-135m"]  # the draft's own count
    assert not any(m in ("lcp", "llama") for m, _ in on_torch)
    assert all(r["identical"] for r in on_llamacpp if r["method"] == "sps")  # lossless on llama.cpp
    assert all(r["identical"] is not None for r in on_llamacpp if r["method"] == "lcp")  # vs its own generate
    assert any("llama.cpp" in env["numerics"] for env in envs)


@pytest.mark.slow
def test_the_answer_is_one_use_line_per_model_naming_the_engine(study):
    rows, params, _ = load_study(study)
    summaries = summarize(rows)
    (use,) = recommend(summaries, Drift(2, 0.02))  # one model on two engines: one answer
    assert use.startswith("Use ") and " for smollm2-135m on this machine: " in use  # whichever engine is faster here
    assert " on llama.cpp" in use or " on draftlab's torch backend" in use
    assert "end to end, 16-token outputs" in use  # by decode, or by end to end where another engine answers sooner
    assert "tok/s against" in use or ("which decodes faster" in use and "but prefills in" in use)
    sentences = engine_answer(summaries)
    phases = [s for s in sentences if s.startswith("Prefill and decode apart for smollm2-135m")]
    assert len(phases) == 1 and "llama.cpp (draftlab):" in phases[0] and "s a prompt, then" in phases[0]
    lcp = [r for r in optimal_table(summaries, params) if r.method == "lcp"]
    assert lcp and lcp[0].engine_plain_tokens_per_s  # llama-cpp-python's lookup against its own plain decoding

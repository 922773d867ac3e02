"""Lossy cells are reported, never ranked; AsG is measured against HF's own plain decoding.

A real sweep on a tiny model, with HF assisted generation forced lossy at one K: its
output is altered after HF returns it, as a drifted bf16 run would alter it.
"""

from __future__ import annotations

import json
import os

import pytest

from draftlab.backends.routes import CPU_DTYPES_ENV, candidate_dtypes

from draftlab.contenders import hf
from draftlab.study.answer import plots
from draftlab.study.run import sweep
from draftlab.study.answer.page import build_report
from draftlab.study.answer.recommend import recommend
from draftlab.study.answer.report import ALL, load_checks, load_study, summarize
from draftlab.study.answer.tables import lossy_cells, optimal_table
from draftlab.study.answer.report import baseline_drift
from draftlab.study.run.store import ResultsStore
from tests.conftest import tiny_model_dir

LOSSY_K = 2


@pytest.fixture(scope="module")
def lossy_study(tmp_path_factory):
    root = tmp_path_factory.mktemp("lossy")
    model = tiny_model_dir(root / "tiny")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"prompt": " ".join(f"w{(i * 5 + j) % 60}" for j in range(10)), "category": "code", "id": f"q{i}"})
        + "\n" for i in range(2)))
    real_generate = hf.hf_generate

    def drifting_hf_generate(target, prompt_ids, config, assist=None):
        tokens = real_generate(target, prompt_ids, config, assist)
        if assist is not None and assist.k == LOSSY_K:
            tokens = tokens[:-1] + [(tokens[-1] + 1) % 60]  # the last token differs from plain decoding
        return tokens

    config = sweep.SweepConfig(targets=(str(model),), drafters=("ngram",), ks=(1, LOSSY_K), methods=("sps", "asg"),
                               datasets=(str(prompts),), limit=2, max_new_tokens=12, warmup=0, baseline_every=0)
    store = ResultsStore(root / "study.sqlite")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf, "hf_generate", drifting_hf_generate)
        sweep.run_sweep(config, store, progress=False)
    store.close()
    return root / "study.sqlite"


@pytest.mark.slow
def test_hf_plain_decoding_runs_beside_asg_and_is_its_reference(lossy_study):
    rows, _, _ = load_study(lossy_study)
    assert sum(r["method"] == "hf" for r in rows) == 2  # one per prompt
    plain = [r for r in rows if r["method"] == "plain"]  # the host's other modes of plain decoding
    # the host's dtypes, whichever they are (fp16 too where the CPU multiplies it natively, or DRAFTLAB_CPU_DTYPES)
    # each other dtype's fastest route; in the baseline's dtype, its fastest route where that is not the baseline's
    own = {r["dtype"] for r in rows if r["method"] == "ar"}
    assert {r["dtype"] for r in plain} <= set(candidate_dtypes()) and all(r["identical"] is None for r in plain)
    assert {r["dtype"] for r in plain} >= set(candidate_dtypes()) - own
    forced = os.environ.get(CPU_DTYPES_ENV)
    if forced:  # CI's stage with another host kind's set: the study timed exactly that set
        assert {r["dtype"] for r in plain} | own == set(forced.split(","))
    asg_ok = [r for r in rows if r["method"] == "asg" and r["k"] == 1]
    assert asg_ok and all(r["identical"] for r in asg_ok)  # compared with HF's own plain decoding
    assert not any(r["identical"] for r in rows if r["method"] == "asg" and r["k"] == LOSSY_K)


@pytest.mark.slow
def test_lossy_cells_are_listed_not_ranked(lossy_study, tmp_path):
    rows, params, _ = load_study(lossy_study)
    summaries = summarize(rows, load_checks(lossy_study))
    ranked = optimal_table(summaries, params)
    assert all(not (r.method == "asg" and r.k == LOSSY_K) for r in ranked)
    asg = next(r for r in ranked if r.method == "asg")
    assert asg.k == 1 and asg.engine_plain_tokens_per_s > 0  # HF's own plain decoding speed
    assert asg.engine_speedup == pytest.approx(asg.tokens_per_s / asg.engine_plain_tokens_per_s)
    lossy = lossy_cells(summaries)
    assert [(s.method, s.k, s.prompts - s.identical) for s in lossy] == [("asg", LOSSY_K, 2)]
    assert all(s.dataset == ALL for s in lossy)
    assert not any("K=2 (AsG)" in s for s in recommend(summaries, baseline_drift(rows, [])))
    assert all(s.host_speedup is not None and s.host_speedup <= s.speedup + 1e-9 for s in summaries if s.speedup)
    page = build_report(lossy_study, tmp_path / "report").read_text()
    assert "Lossy cells (not ranked)" in page and "2/2" in page


@pytest.mark.slow
def test_sps_vs_asg_plot_leaves_lossy_pairs_out(lossy_study, tmp_path, monkeypatch):
    rows, _, _ = load_study(lossy_study)
    group = [s for s in summarize(rows) if s.dataset == ALL]
    drawn = []
    monkeypatch.setattr(plots, "finish", lambda fig, ax, *a, **k: drawn.append(
        [t.get_text() for t in ax.get_xticklabels()]) or True)
    assert plots._sps_vs_asg(group, tmp_path / "p.png", "t")
    assert drawn == [["ngram\nK=1"]]

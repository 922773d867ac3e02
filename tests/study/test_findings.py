"""The seeds' findings beside a study: verdicts from hand-built cells with known answers."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from draftlab.errors import DraftlabError
from draftlab.study.answer import findings as f
from draftlab.study.answer.page import build_report
from draftlab.study.answer.results import ReportInputs
from draftlab.study.answer.report import CellSummary, load_study, summarize
from tests.study.test_report import study  # noqa: F401  (the hand-built database fixture)


def cell(method, drafter, k, speedup, dataset="code", tokens_per_s=None):
    return CellSummary("tgt", method, drafter, k, dataset, 0.0, 2, 200, 10.0, tokens_per_s or 10.0 * speedup,
                       100.0 / speedup, None, None, None, None, None, speedup=speedup)


def test_optimal_k_inside_outside_and_unmeasured():
    inside = [cell("sps", "ngram", k, s) for k, s in ((1, 1.1), (3, 1.3), (4, 1.2))]
    assert f.optimal_k(inside).verdict == f.AGREES
    mixed = inside + [cell("sps", "ngram", 1, 1.5, dataset="chat"), cell("sps", "ngram", 4, 1.1, dataset="chat")]
    finding = f.optimal_k(mixed)
    assert finding.verdict == f.PARTLY and "1 of 2 categories" in finding.measured
    assert f.optimal_k([cell("sps", "ngram", 1, 1.1), cell("sps", "ngram", 2, 1.2)]).verdict == f.NOT_MEASURED
    assert f.optimal_k([cell("sps", "ngram", 1, 1.5), cell("sps", "ngram", 3, 1.2)]).verdict == f.DISAGREES


def test_smallest_draft_needs_two_sized_drafts():
    params = {"tgt::small": 10, "tgt::big": 40}
    cells = [cell("sps", "small", 3, 1.4), cell("sps", "big", 3, 1.2), cell("sps", "ngram", 3, 2.0)]
    finding = f.smallest_draft(cells, params)
    assert finding.verdict == f.AGREES and "1 of 1" in finding.measured  # n-gram has no size: not compared
    assert f.smallest_draft([cell("sps", "small", 3, 1.0), cell("sps", "big", 3, 1.2)], params).verdict == f.DISAGREES
    assert f.smallest_draft(cells[:1], params).verdict == f.NOT_MEASURED


def test_depth_and_width_from_a_microbenchmark():
    def row(series, layers, hidden, ms):
        return {"series": series, "layers": layers, "hidden": hidden, "ms_per_token": ms}

    gpu_like = [row("fixed_width", 2, 64, 1.0), row("fixed_width", 8, 64, 4.0),
                row("fixed_depth", 4, 64, 2.0), row("fixed_depth", 4, 256, 2.2)]
    assert f.depth_not_width(gpu_like).verdict == f.AGREES
    cpu_like = gpu_like[:2] + [row("fixed_depth", 4, 64, 2.0), row("fixed_depth", 4, 256, 7.0)]
    finding = f.depth_not_width(cpu_like)
    assert finding.verdict == f.DISAGREES and "4x the width cost 3.50x" in finding.measured
    assert f.depth_not_width(None).verdict == f.NOT_MEASURED
    assert f.depth_not_width(gpu_like[:2]).verdict == f.NOT_MEASURED


def test_accuracy_against_tar():
    def result(spearman):
        drafts = [{"draft": f"d{i}", "mmlu_accuracy": 0.3, "tokens_per_step": 1.5} for i in range(4)]
        return {"drafts": drafts, "correlations": {"mmlu_accuracy": {"pearson": spearman, "spearman": spearman},
                                                   "log_perplexity": {"pearson": -0.9, "spearman": -0.8}}}

    assert f.accuracy_not_tar(result(0.2)).verdict == f.AGREES
    assert f.accuracy_not_tar(result(0.9)).verdict == f.DISAGREES
    assert f.accuracy_not_tar({"drafts": [], "correlations": {}}).verdict == f.NOT_MEASURED


def test_model_error_against_three_and_a_half_percent():
    def comparison(error):
        return SimpleNamespace(draft="ngram", k=2, simplified_error=error, measured_tokens_per_s=10.0,
                               simplified_tokens_per_s=10.0 * (1 + error))

    assert f.model_error([comparison(0.01), comparison(0.03)]).verdict == f.AGREES
    assert f.model_error([comparison(0.01), comparison(0.05)]).verdict == f.PARTLY
    finding = f.model_error([comparison(0.08), comparison(0.12)])
    assert finding.verdict == f.DISAGREES and "10.0% on average and 12.0% at most" in finding.measured
    assert f.model_error(None).verdict == f.NOT_MEASURED


def test_sps_against_asg_on_the_same_pairs():
    cells = [cell("sps", "layers:0-1", 3, 1.2), cell("asg", "layers:0-1", 3, 1.0),
             cell("sps", "layers:0-1", 4, 1.1), cell("asg", "layers:0-1", 4, 1.3), cell("sps", "ngram", 3, 2.0)]
    finding = f.sps_beats_asg(cells)
    assert finding.verdict == f.PARTLY and "1 of 2 pairs" in finding.measured
    assert f.sps_beats_asg(cells[:2]).verdict == f.AGREES
    assert f.sps_beats_asg(cells[-1:]).verdict == f.NOT_MEASURED


@pytest.mark.slow
def test_report_shows_the_findings(study, tmp_path):  # noqa: F811
    micro = tmp_path / "microbench.json"
    micro.write_text(json.dumps([{"series": "fixed_width", "layers": 2, "hidden": 64, "ms_per_token": 1.0},
                                 {"series": "fixed_width", "layers": 8, "hidden": 64, "ms_per_token": 4.0},
                                 {"series": "fixed_depth", "layers": 4, "hidden": 64, "ms_per_token": 2.0},
                                 {"series": "fixed_depth", "layers": 4, "hidden": 256, "ms_per_token": 7.0}]))
    page = build_report(study, tmp_path / "report", ReportInputs(microbench=micro)).read_text()
    assert "The seeds' findings beside ours" in page
    assert page.index("The seeds' findings") < page.index("<h2>Figures</h2>")
    rows, params, _ = load_study(study)
    found = {x.claim: x for x in f.seeds_findings(f.Evidence(summarize(rows), params))}
    assert len(found) == 6
    sps_asg = found["SpS is faster than AsG on the same draft and K."]
    assert sps_asg.verdict == f.DISAGREES and "0 of 1 pairs" in sps_asg.measured  # both at 12.5 tok/s: not faster
    assert "4x the width cost 3.50x" in page
    with pytest.raises(DraftlabError, match="cannot read the microbenchmark"):
        build_report(study, tmp_path / "again", ReportInputs(microbench=tmp_path / "missing.json"))
    done = subprocess.run([sys.executable, "-m", "draftlab.cli", "report", "--db", str(study), "--out",
                           str(tmp_path / "cli"), "--microbench", str(micro)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "== The seeds' findings beside ours ==" in done.stdout and "[disagrees] Draft latency" in done.stdout

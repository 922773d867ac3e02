"""The report's numbers come from the records: a hand-built database with known answers."""

from __future__ import annotations

import pytest

from draftlab.study.answer.page import build_report
from draftlab.study.answer.results import ReportInputs
from draftlab.study.answer.report import load_study, summarize
from draftlab.study.answer.tables import format_optimal, optimal_table
from draftlab.study.run.store import Cell, Record, ResultsStore


def cell(method, drafter="none", k=0, dataset="code"):
    return Cell("tgt", drafter, k, method, dataset, 0.0, 100)


def record(c, prompt, wall, steps=0, accepted=(), drafted=(), identical=True):
    return Record(c, prompt, c.dataset, 100, steps, sum(drafted), sum(accepted), list(accepted), list(drafted),
                  0.0, 0.1 * wall, 0.8 * wall, 0.1 * wall, wall, "sha", identical)


@pytest.fixture()
def study(tmp_path):
    store = ResultsStore(tmp_path / "study.sqlite")
    run = store.start_run({"device": "cpu"})
    store.set_params("tgt", 100)
    store.set_params("tgt::layers:0-1", 25)
    for prompt in ("p1", "p2"):
        store.add(record(cell("ar"), prompt, 10.0, steps=100), run)  # 10 tok/s
    # ngram K=2: 20 tok/s on both prompts -> speedup 2.0
    for prompt in ("p1", "p2"):
        store.add(record(cell("sps", "ngram", 2), prompt, 5.0, steps=50, accepted=[1] * 50, drafted=[2] * 50), run)
    # ngram K=4: 25 and 12.5 tok/s -> 20 s of baseline time in 12 s -> 1.667
    store.add(record(cell("sps", "ngram", 4), "p1", 4.0, steps=40, accepted=[2] * 40, drafted=[4] * 40), run)
    store.add(record(cell("sps", "ngram", 4), "p2", 8.0, steps=40, accepted=[2] * 40, drafted=[4] * 40,
                     identical=False), run)
    # layers K=3: 12.5 tok/s -> 1.25; AsG layers K=3: 16 s for 200 tokens -> 1.25
    for prompt in ("p1", "p2"):
        store.add(record(cell("sps", "layers:0-1", 3), prompt, 8.0, steps=60, accepted=[1] * 60, drafted=[3] * 60), run)
        store.add(record(cell("asg", "layers:0-1", 3), prompt, 8.0), run)
    store.close()
    return tmp_path / "study.sqlite"


def test_optimal_table_from_records(study):
    rows, params, _ = load_study(study)
    table = {(r.dataset, r.method): r for r in optimal_table(summarize(rows), params)}
    sps = table[("code", "sps")]
    assert (sps.drafter, sps.k) == ("ngram", 2)
    assert sps.speedup == pytest.approx(2.0)
    assert sps.scaling is None  # n-gram has no parameters
    asg = table[("code", "asg")]
    assert (asg.drafter, asg.k, asg.speedup, asg.scaling) == ("layers:0-1", 3, pytest.approx(1.25), 4.0)
    assert table[("code", "ar")].speedup == pytest.approx(1.0)
    assert ("all", "sps") not in table  # one dataset: its "all" rows would only repeat it
    text = format_optimal(list(table.values()))
    assert "ngram" in text and "2.000x" in text


def test_cell_summaries(study):
    rows, _, _ = load_study(study)
    by_key = {(s.method, s.drafter, s.k, s.dataset): s for s in summarize(rows)}
    k4 = by_key[("sps", "ngram", 4, "code")]
    assert k4.speedup == pytest.approx(20 / 12)
    assert (k4.speedup_min, k4.speedup_max) == (pytest.approx(1.25), pytest.approx(2.5))
    assert k4.tokens_per_step == pytest.approx(200 / 80)
    assert k4.acceptance_rate == pytest.approx(0.5)
    assert k4.per_position_acceptance == [1.0, 1.0, 0.0, 0.0]
    assert k4.identical == 1
    assert by_key[("asg", "layers:0-1", 3, "code")].tokens_per_step is None


def test_report_files(study, tmp_path):
    page = build_report(study, tmp_path / "report")
    html = page.read_text()
    assert "Optimal configuration" in html and "class='lossy'" in html
    pngs = sorted(p.name for p in page.parent.glob("*.png"))
    assert len(pngs) == 5
    for name in pngs:
        assert name in html
        assert (page.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (page.parent / "optimal.csv").read_text().startswith("target,dataset")


def test_report_with_profile_checks_the_model(study, tmp_path):
    from draftlab.perf.calibrate import Profile
    from draftlab.perf.throughput import DraftProfile, TargetProfile

    # decode time = wall - prefill(0): ngram K=2 measured 200 tokens / 10 s = 20 tok/s
    target = TargetProfile("tgt", {1: 0.1, 2: 0.1, 3: 0.1, 4: 0.1, 5: 0.1})
    profile = Profile(target, [DraftProfile("ngram", 0.0, [1.0, 1.0, 0.5, 0.5]),
                               DraftProfile("layers:0-1", 0.01, [0.5, 0.3, 0.2])])
    profile.save(tmp_path / "profile.json")
    assert Profile.load(tmp_path / "profile.json").target.score_s[3] == 0.1
    page = build_report(study, tmp_path / "report", ReportInputs(profile=tmp_path / "profile.json")).read_text()
    assert "Performance model" in page and "predicted_vs_measured.png" in page and "What-if" in page
    assert (tmp_path / "report" / "predicted_vs_measured.png").exists()


def test_recommendation_names_the_measured_best_lossless_configuration(study, tmp_path):
    from draftlab.study.answer.recommend import recommend
    from draftlab.study.answer.report import Drift

    rows, _, _ = load_study(study)
    sentences = recommend(summarize(rows), Drift(2, 0.02))
    assert len(sentences) == 1
    # ngram K=4 measured 1.67x but one output differed: never recommended; ngram K=2 is the best lossless one
    assert sentences[0].startswith("Use ngram at K=2 (SpS) on draftlab's torch backend for tgt on this machine: "
                                   "2.00x (2 prompts: too few for an interval) plain decoding on draftlab's torch backend")
    assert "every output identical to plain decoding (2/2)" in sentences[0]
    assert "1 configuration(s) produced output different" in sentences[0]
    assert sentences[0] in build_report(study, tmp_path / "report").read_text().replace("&#x27;", "'")


def _judged(cells):
    """Hand-built summaries, judged against their model's reference plain decoding as `summarize` judges them."""
    from draftlab.study.answer.host import add_host_speedups

    add_host_speedups(cells, {})
    return cells


def _summary(method, drafter, k, speedup, identical=2, width=0.05):
    from draftlab.study.answer.report import ALL, CellSummary

    return CellSummary("tgt", method, drafter, k, ALL, 0.0, 2, 200, 10.0, 20.0 * speedup, 50.0, None, None, None,
                       None, None, speedup=speedup, speedup_min=speedup - 0.1, speedup_max=speedup + 0.1,
                       speedup_low=speedup - width, speedup_high=speedup + width, identical=identical)


def test_recommendation_says_plain_decoding_when_nothing_wins():
    from draftlab.study.answer.recommend import recommend
    from draftlab.study.answer.report import Drift

    cells = [_summary("ar", "none", 0, 1.0), _summary("sps", "ngram", 3, 0.9), _summary("asg", "ngram", 3, 0.8)]
    (sentence,) = recommend(_judged(cells), Drift(2, 0.03))
    assert sentence.startswith("Use plain decoding on draftlab's torch backend for tgt on this machine: no "
                               "configuration beat it")
    assert "ngram at K=3 (SpS) on draftlab's torch backend, ran at 0.90x (2 prompts: too few for an interval)" in sentence


def test_a_gain_whose_paired_interval_includes_1x_is_not_the_answer():
    from draftlab.study.answer.recommend import recommend
    from draftlab.study.answer.report import Drift

    sure = recommend(_judged([_summary("ar", "none", 0, 1.0), _summary("sps", "designed", 1, 1.08)]), Drift(2, 0.2))[0]
    assert sure.startswith("Use designed at K=1 (SpS) on draftlab's torch backend for tgt on this machine: "
                           "1.08x (2 prompts: too few for an interval)")
    unsure = recommend(_judged([_summary("ar", "none", 0, 1.0), _summary("sps", "designed", 1, 1.08, width=0.12)]),
                       Drift(2, 0.2))[0]
    assert unsure.startswith("Use plain decoding on draftlab's torch backend for tgt on this machine: no "
                             "configuration beat it surely (the interval of the best includes 1.0x)")
    assert "machine's drift during the study: 20%" in unsure
    assert "drift" not in recommend(_judged([_summary("sps", "designed", 1, 1.08, width=0.12)]), Drift(2, 0.05))[0]


def test_per_position_acceptance_of_a_tree_counts_levels_not_nodes(tmp_path):
    store = ResultsStore(tmp_path / "study.sqlite")
    run = store.start_run({})
    tree = cell("sps", "tree:2x2:ngram", 2)
    # 10 steps of a 2x2 tree (6 nodes on 2 levels): the path accepted 2, 1, 0 levels deep
    accepted = [2] * 5 + [1] * 3 + [0] * 2
    store.add(Record(tree, "p1", "code", 100, 10, 60, sum(accepted), accepted, [6] * 10, wall_s=1.0,
                     levels_per_step=[[2, 4]] * 10), run)
    store.close()
    rows, _, _ = load_study(tmp_path / "study.sqlite")
    (summary,) = [s for s in summarize(rows) if s.dataset == "code"]
    assert summary.per_position_acceptance == [pytest.approx(0.8), pytest.approx(0.5)]


def test_report_command_prints_the_recommendation(study, tmp_path, capsys):
    from draftlab.cli import main

    assert main(["report", "--db", str(study), "--out", str(tmp_path / "r")]) in (0, None)
    out = capsys.readouterr().out
    assert "report: " in out and "Use ngram at K=2 (SpS) on draftlab's torch backend for tgt on this machine" in out


@pytest.mark.parametrize("spec_seconds, expected", [
    (8.0, "Use plain decoding on draftlab's torch backend (fp32 linear) for tgt on this machine: no configuration "
          "beat it"),
    (4.0, "Use ngram at K=2 (SpS) on draftlab's torch backend for tgt on this machine: 1.25x (2 prompts: too few for an interval) plain "
          "decoding on draftlab's torch backend (fp32 linear), decoding 25.0 tok/s against 20.0"),
])
def test_the_answer_is_judged_against_the_fastest_plain_decoding_on_the_host(tmp_path, spec_seconds, expected):
    """Plain decoding in another mode ran twice as fast as the study's own: speedups are stated against it."""
    from dataclasses import replace

    from draftlab.study.answer.recommend import recommend
    from draftlab.study.answer.report import Drift

    store = ResultsStore(tmp_path / "study.sqlite")
    run = store.start_run({})
    for prompt in ("p1", "p2"):
        store.add(record(cell("ar"), prompt, 10.0, steps=100), run)  # 10 tok/s
        fast = replace(cell("plain", "fp32 linear"), dtype="fp32")
        store.add(record(fast, prompt, 5.0, steps=100, identical=None), run)  # 20 tok/s
        store.add(record(cell("sps", "ngram", 2), prompt, spec_seconds, steps=50, accepted=[1] * 50,
                         drafted=[2] * 50), run)
    store.close()
    rows, params, _ = load_study(tmp_path / "study.sqlite")
    summaries = summarize(rows)
    (sentence,) = recommend(summaries, Drift(2, 0.02))
    assert sentence.startswith(expected)
    plain = next(r for r in optimal_table(summaries, params) if r.method == "plain")
    assert plain.drafter == "fp32 linear" and plain.speedup == pytest.approx(2.0)  # shown beside the others


def test_raw_rates_that_disagree_with_the_paired_ratio_are_said_to_drift(study):
    """The Use line's two decode rates were timed minutes apart; where their ratio is not the paired one (which
    cancels the machine's drift through the re-timed baseline), the line says so, and only then."""
    from dataclasses import replace

    from draftlab.study.answer.recommend import _paces

    rows, _, _ = load_study(study)
    plain = next(s for s in summarize(rows) if s.method == "ar" and s.dataset == "all")
    best = replace(plain, method="sps", decode_tokens_per_s=plain.decode_tokens_per_s * 1.02)
    assert _paces(best, plain, 1.02).endswith("(paired per prompt)")
    drifted = _paces(best, plain, 1.26)
    assert "(paired per prompt; these rates were timed minutes apart" in drifted and "drift" in drifted
    other_target = replace(plain, target="other")  # compared by rates on each prompt: nothing to explain
    assert _paces(best, other_target, 1.26).endswith("(paired per prompt)")


def test_the_study_exports_its_fastest_lossless_configuration(study):
    """ngram K=2 (2.0x, every output identical) is exported; K=4 differed once, so it never is."""
    from draftlab.deploy import export
    from draftlab.study.answer.recommend import fastest_lossless

    rows, _, _ = load_study(study)
    (choice,) = fastest_lossless(summarize(rows))
    assert (choice.target, choice.draft, choice.k) == ("tgt", "ngram", 2)
    assert '"num_speculative_tokens":2' in export(choice, "vllm")


def test_predict_names_a_route_or_context_unlike_the_studys(tmp_path):
    """A profile of another route, or timed at another context, is not compared with the study (no error figure)."""
    from draftlab.perf.calibrate import Profile
    from draftlab.perf.throughput import TargetProfile
    from draftlab.study.answer.transfer import unlike_study

    store = ResultsStore(tmp_path / "study.sqlite")
    run = store.start_run({"device": "cpu", "numerics": "fp32 exact-wm/2 (measured: fastest)"})
    store.add(record(cell("ar"), "p1", 1.0), run)
    store.close()
    db = tmp_path / "study.sqlite"
    like = Profile(TargetProfile("shape:tgt fp32 on cpu (fp32 exact-wm/2 (measured: fastest))", {1: 0.01}), [], 300)
    assert unlike_study(like, db, 320) == ""
    other = Profile(TargetProfile("shape:tgt fp32 on cpu (fp32 exact-wm/4)", {1: 0.01}), [], 256)
    said = unlike_study(other, db, 600)
    assert "route fp32 exact-wm/4, the study's torch target fp32 exact-wm/2" in said and "~600" in said


def test_fewer_than_four_paired_prompts_give_no_interval():
    from draftlab.study.answer.summary import interval_words

    assert interval_words(0.9, 1.3, 3) == "3 prompts: too few for an interval"
    assert interval_words(0.9, 1.3, 1) == "1 prompt: too few for an interval"
    assert interval_words(0.9, 1.3, 4) == "0.90-1.30" and interval_words(0.9, 1.3, 8, " - ") == "0.90 - 1.30"

"""One list orders the study's answer: `draftlab report` prints the same sections, in the same order, as its page."""

from __future__ import annotations

import re

from draftlab.cli.main import main
from draftlab.study.answer.results import ReportInputs, StudyResults
from draftlab.study.answer.sections import SECTIONS, sections_of
from draftlab.study.run.store import Cell, Record, ResultsStore


def _study(path):
    """Plain decoding, a lossless and a lossy n-gram cell, one cell the race dropped: most sections have a say."""
    store = ResultsStore(path)
    run = store.start_run({"device": "cpu"})
    store.set_params("tgt", 100)
    cells = {"ar": Cell("tgt", "none", 0, "ar", "code", 0.0, 64), "k2": Cell("tgt", "ngram", 2, "sps", "code", 0.0, 64),
             "k4": Cell("tgt", "ngram", 4, "sps", "code", 0.0, 64), "k6": Cell("tgt", "ngram", 6, "sps", "code", 0.0, 64)}
    for prompt, (ar, k2, k4) in {"p1": (8.0, 5.0, 4.0), "p2": (8.4, 5.5, 6.0), "p3": (7.9, 5.1, 4.4)}.items():
        for name, wall in (("ar", ar), ("k2", k2), ("k4", k4)):
            c = cells[name]
            steps = 64 if not c.k else 32
            store.add(Record(c, prompt, "code", 64, steps, c.k * steps, steps, [1] * steps if c.k else [],
                             [c.k] * steps if c.k else [], 0.0, 0.1 * wall, 0.8 * wall, 0.1 * wall, wall, "sha",
                             name != "k4" or prompt == "p1"), run)
    store.add(Record(cells["k6"], "p1", "code", 64, 32, 192, 32, [1] * 32, [6] * 32, 0.0, 0.9, 7.2, 0.9, 9.0, "sha",
                     True), run)
    store.add_skip(cells["k6"], "p2", "dropped by the race after 1 prompt(s)", run)
    store.close()
    return path


def test_the_terminal_and_the_page_hold_the_same_sections_in_one_order(tmp_path, capsys):
    db = _study(tmp_path / "study.sqlite")
    assert main(["report", "--db", str(db), "--out", str(tmp_path / "report"), "--export", "vllm"]) == 0
    printed = re.findall(r"^== (.+) ==$", capsys.readouterr().out, flags=re.M)
    page = (tmp_path / "report" / "index.html").read_text()
    titles = re.findall(r"<h2>(.+?)</h2>", page)
    assert printed == titles
    expected = [s.title for s in sections_of(StudyResults.load(db, ReportInputs(export=("vllm",)), tmp_path / "r"))]
    assert printed == expected and len(expected) >= 9
    for title in ("The answer", "Lossy cells (not ranked)", "Cells not measured on every prompt (not ranked)",
                  "Exports", "Figures", "Every cell"):
        assert title in printed
    order = [make.__name__ for make in SECTIONS]
    assert order.index("answer_section") < order.index("optimal_section") < order.index("cells_section")

"""The study report as files: index.html (the sections of `draftlab.study.answer.sections`, in their one order), the
figures it shows, and cells.csv, optimal.csv and load.csv beside it.

Built from the database alone, so it can be redrawn at any time.
"""

from __future__ import annotations

import html
from pathlib import Path

from draftlab.files.safeio import write_atomic
from draftlab.study.answer.report import write_csv
from draftlab.study.answer.results import ReportInputs, StudyResults
from draftlab.study.answer.sections import Section, sections_of

STYLE = """body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}th{background:#eee}tr.lossy{background:#fcc}
tr.disagrees{background:#fde}tr.agrees{background:#efe}p.noisy{background:#fcc;padding:4px}
p.answer{font-size:16px;font-weight:bold}img{max-width:100%;border:1px solid #ddd;margin-bottom:1em}"""
INTRO = ("Speedups are decode tokens/s over plain decoding on the same prompts in the same study, paired per prompt; "
         "the range is their 95% interval. Scaling = target parameters / draft parameters ('-' for drafts without "
         "parameters, such as n-gram lookup). SpS = draftlab's engine, AsG = Hugging Face assisted generation with the "
         "same draft and K, HF = Hugging Face generate without an assistant: 'own plain' is the method's own engine's "
         "plain decoding, 'vs own' the speedup over it, 'vs fastest plain' the speedup over the fastest plain decoding "
         "timed on this host. Only cells whose every greedy output equals plain decoding on their engine are ranked.")


def build_report(db: str | Path, out: str | Path, inputs: ReportInputs = ReportInputs()) -> Path:
    """Load the study at `db` and write its report into `out` (`write_report`); return the HTML path."""
    out = Path(out)
    results = StudyResults.load(db, inputs, figures_dir=out)
    return write_report(results, sections_of(results), out)


def write_report(results: StudyResults, sections: list[Section], out: Path) -> Path:
    """Write index.html of `sections` and the CSVs of the study's cells into `out`; return the HTML path.

    With a calibration profile, the page also checks the performance model against the records; the seeds'
    findings are set beside the study's cells, and beside `design microbench`'s and `design correlate`'s files
    when given (`ReportInputs`)."""
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "cells.csv", results.summaries)
    write_csv(out / "optimal.csv", results.optimal)
    write_csv(out / "load.csv", results.served)
    page = out / "index.html"
    write_atomic(page, page_html(results.db, sections))
    return page


def page_html(db: Path, sections: list[Section]) -> str:
    """The whole page: a heading, what the figures mean, then each section under its title."""
    text = lambda words: html.escape(words, quote=False)  # noqa: E731  (text, not an attribute)
    body = "".join(f"<h2>{text(s.title)}</h2>" + (f"<p>{text(s.note)}</p>" if s.note else "") + s.html
                   for s in sections)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>draftlab study report</title>"
            f"<style>{STYLE}</style></head><body><h1>draftlab study report</h1><p>Database: "
            f"<code>{html.escape(str(db))}</code>. {html.escape(INTRO, quote=False)}</p>{body}</body></html>")

"""The study's tables as HTML, for the sections that have more columns than a terminal holds."""

from __future__ import annotations

import html

from draftlab.study.answer.findings import Finding
from draftlab.study.answer.summary import CellSummary, interval_words
from draftlab.study.answer.tables import OptimalRow

esc = html.escape
LEFT = " style='text-align:left'"


def pre(text: str) -> str:
    """Preformatted text (a table laid out for the terminal)."""
    return f"<pre>{esc(text, quote=False)}</pre>"


def paragraphs(lines: list[str], css: str = "") -> str:
    klass = f" class='{css}'" if css else ""
    return "".join(f"<p{klass}>{esc(line, quote=False)}</p>" for line in lines)


def table(header: list[str], rows: list[list[str]], row_classes: list[str] | None = None) -> str:
    """An HTML table of already formatted cells (escaped here); the first column aligns left."""
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join(
        f"<tr class='{css}'>" + "".join(f"<td{LEFT if i == 0 else ''}>{esc(c)}</td>" for i, c in enumerate(cells))
        + "</tr>"
        for cells, css in zip(rows, row_classes or [""] * len(rows)))
    return f"<table><tr>{head}</tr>{body}</table>"


def _num(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def optimal_html(rows: list[OptimalRow]) -> str:
    header = ["target", "dataset", "temp", "method", "draft", "K", "speedup", "95% interval", "tok/s", "scaling",
              "own plain tok/s", "vs own", "vs fastest plain"]
    return table(header, [[
        r.target, r.dataset, f"{r.temperature:g}", r.method.upper(), r.drafter, str(r.k), f"{r.speedup:.3f}x",
        interval_words(r.speedup_low, r.speedup_high, r.prompts, " - "), f"{r.tokens_per_s:.1f}", _num(r.scaling, ".2f", "x"),
        _num(r.engine_plain_tokens_per_s, ".1f"), _num(r.engine_speedup, ".3f", "x"),
        f"{_num(r.host_speedup, '.3f', 'x')} ({interval_words(r.host_low, r.host_high, r.prompts, ' - ')})"]
        for r in rows])


def lossy_html(cells: list[CellSummary]) -> str:
    rows = [[s.target, s.dataset, s.method.upper(), s.drafter, str(s.k), f"{s.prompts - s.identical}/{s.prompts}",
             f"{s.tokens_per_s:.1f}"] for s in cells]
    return table(["target", "dataset", "method", "draft", "K", "outputs differed", "tok/s"], rows,
                 ["lossy"] * len(rows))


def cells_html(summaries: list[CellSummary]) -> str:
    """Every cell: rows in red produced output different from the baseline."""
    header = ["target", "dataset", "temp", "method", "draft", "K", "prompts", "tok/s", "ms/token", "speedup",
              "min / median / max", "TAR", "accept", "ms/step d / t / o", "identical"]
    rows = [[
        s.target, s.dataset, f"{s.temperature:g}", s.method.upper(), s.drafter, str(s.k), str(s.prompts),
        f"{s.tokens_per_s:.1f}", f"{s.ms_per_token:.1f}", f"{s.speedup:.3f}x",
        f"{s.speedup_min:.2f} / {s.speedup_median:.2f} / {s.speedup_max:.2f}", _num(s.tokens_per_step, ".2f"),
        _num(s.acceptance_rate, ".1%"),
        f"{_num(s.draft_ms_per_step, '.1f')} / {_num(s.target_ms_per_step, '.1f')} / {_num(s.overhead_ms_per_step, '.1f')}",
        "-" if s.identical is None else f"{s.identical}/{s.prompts}"] for s in summaries]
    return table(header, rows, ["lossy" if s.lossy else "" for s in summaries])


def findings_html(findings: list[Finding]) -> str:
    """The seeds' findings beside this study's measurements, with the cells behind each."""
    rows = "".join(
        f"<tr class='{f.verdict.replace(' ', '-')}'><td style='text-align:left'>{esc(f.claim)}<br><small>{esc(f.source)}"
        f"</small></td><td>{esc(f.verdict)}</td><td style='text-align:left'>{esc(f.measured)}"
        + (f"<details><summary>{len(f.evidence)} cells</summary>{'<br>'.join(esc(e) for e in f.evidence)}</details>"
           if f.evidence else "") + "</td></tr>"
        for f in findings)
    return f"<table><tr><th>finding</th><th>here</th><th>measured</th></tr>{rows}</table>"


def images_html(figures: list[tuple[str, str]]) -> str:
    return "".join(f"<h3>{esc(title)}</h3><img src='{esc(name)}' alt='{esc(title)}'>" for name, title in figures)

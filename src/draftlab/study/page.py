"""The study report as an HTML page: the answer, the optimal table, lossy cells, the seeds' findings, figures, every cell.

Built from the database alone (see `draftlab.study.report`), so it can be redrawn at any time.
"""

from __future__ import annotations

import html
from pathlib import Path

from draftlab.study.report import (
    CellSummary, Drift, baseline_drift, load_checks, load_study, on_shared_prompts, summarize, write_csv,
)
from draftlab.study.tables import OptimalRow, lossy_cells, optimal_table
from draftlab.study.answer import deploy_notes, engine_answer, left_out_notes, numerics_notes, recommend
from draftlab.study.learning import format_learning, learning_rows
from draftlab.study.race import load_skips, skipped_cells
from draftlab.study.serving import draw_load, format_load, load_summaries, server_answer
from draftlab.study.weight_types import file_bytes, format_weight_types, weight_type_answer, weight_type_rows
from draftlab.contenders.methods import method_of
from draftlab.perf.calibrate import Profile
from draftlab.perf.present import format_what_if, plot_comparison
from draftlab.perf.validate import error_summary, format_predictions, predictions
from draftlab.study import plots
from draftlab.study.findings import gather_evidence, seeds_findings


def build_report(db: str | Path, out: str | Path, profile_path: str | Path | None = None,
                 microbench_path: str | Path | None = None, correlate_path: str | Path | None = None) -> Path:
    """Write index.html, the PNGs and CSVs it shows, into `out`; return the HTML path.

    With a calibration profile, the page also checks the performance model against the
    records (predicted vs measured, errors of both formulas) and shows the what-if tables.
    The seeds' findings are set beside the study's cells, and beside the microbenchmark
    (`design microbench`'s microbench.json) and the correlation (`design correlate`'s
    correlate.json) when given.
    """
    rows, params, envs = load_study(db)
    checks = load_checks(db)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summaries = summarize(rows, checks)
    optimal = optimal_table(summaries, params)
    write_csv(out / "cells.csv", summaries)
    write_csv(out / "optimal.csv", optimal)
    load = load_summaries(rows)
    write_csv(out / "load.csv", [s for s in load if method_of(s.method).served])
    figures = plots.draw_all(summarize(on_shared_prompts(rows), checks), out) + draw_load(load, out)
    evidence = gather_evidence(summaries, params, rows, profile_path, microbench_path, correlate_path)
    model_section = _model_section(profile_path, evidence.comparisons, out) if profile_path else ""
    findings = seeds_findings(evidence)
    drift = baseline_drift(rows, checks)
    page = _html(db, summaries, optimal, figures, envs, drift, answer_lines(db, rows, checks, envs, table=False))
    page = page.replace("<h2>Figures</h2>", _skips_section(load_skips(db)) + "<h2>Figures</h2>")
    types = format_weight_types(weight_type_rows(summaries, rows, file_bytes))
    if types:
        page = page.replace("<h2>Figures</h2>", f"<h2>Weight types</h2><pre>{html.escape(types)}</pre><h2>Figures</h2>")
    served = format_load(load)
    if served:  # llama-server's configurations per concurrency
        page = page.replace("<h2>Figures</h2>", f"<h2>llama-server per concurrency</h2><pre>{html.escape(served)}"
                                                "</pre><h2>Figures</h2>")
    learning = format_learning(learning_rows(summaries, rows))
    if learning:  # suffix cells: cold and warm per workload
        page = page.replace("<h2>Figures</h2>", f"<h2>Drafts that learn across requests</h2><pre>{html.escape(learning)}"
                                                "</pre><h2>Figures</h2>")
    page = page.replace("<h2>Figures</h2>", _findings_section(findings) + "<h2>Figures</h2>")
    page = page.replace("<h2>Every cell</h2>", model_section + "<h2>Every cell</h2>")
    (out / "index.html").write_text(page, encoding="utf-8")
    return out / "index.html"


def _skips_section(skips: list[dict]) -> str:
    """Cells not measured on every prompt (dropped by the race, or a peer that could not run a prompt)."""
    rows = "".join(f"<tr><td style='text-align:left'>{html.escape(cell)}</td><td>{count}</td>"
                   f"<td style='text-align:left'>{html.escape(reason)}</td></tr>"
                   for cell, count, reason in skipped_cells(skips))
    return ("<h2>Cells not measured on every prompt (not ranked)</h2><p>Dropped by the race once they trailed the "
            "fastest cell by more than the margin, or skipped where their library could not run a prompt.</p><table>"
            f"<tr><th>cell</th><th>prompts skipped</th><th>why (first)</th></tr>{rows}</table>") if rows else ""


def _findings_section(findings) -> str:
    """The seeds' findings beside this study's measurements, as an HTML table."""
    esc = html.escape
    rows = "".join(
        f"<tr class='{f.verdict.replace(' ', '-')}'><td style='text-align:left'>{esc(f.claim)}<br><small>{esc(f.source)}"
        f"</small></td><td>{esc(f.verdict)}</td><td style='text-align:left'>{esc(f.measured)}"
        + (f"<details><summary>{len(f.evidence)} cells</summary>{'<br>'.join(esc(e) for e in f.evidence)}</details>"
           if f.evidence else "") + "</td></tr>"
        for f in findings)
    return ("<h2>The seeds' findings beside ours</h2><p>Each finding of the two studies behind draftlab (GPUs, "
            "models of 70M-65B parameters) against what this study measured on this machine.</p>"
            f"<table><tr><th>finding</th><th>here</th><th>measured</th></tr>{rows}</table>")


def _model_section(profile_path, comparisons: list, out: Path) -> str:
    """Performance model vs measurement, and what-if analyses, as HTML."""
    profile = Profile.load(profile_path)
    errors = error_summary(comparisons)
    plot_comparison(comparisons, out / "predicted_vs_measured.png")
    preds = predictions(profile)
    table = html.escape(format_predictions(preds, profile.target.autoregressive_tokens_per_s))
    what_if = html.escape(format_what_if(preds))
    return (
        "<h2>Performance model</h2>"
        f"<p>Decode throughput (prefill excluded) of {errors['cells']} SpS cells against the calibration profile "
        f"<code>{html.escape(str(profile_path))}</code>. TAR / (t_target + t_draft): mean error "
        f"{errors['simplified_mean_error']:.1%}, max {errors['simplified_max_error']:.1%}. Leviathan et al.: mean "
        f"{errors['leviathan_mean_error']:.1%}, max {errors['leviathan_max_error']:.1%}. The measured throughput "
        f"falls inside the predicted interval in {errors['inside_interval']:.0%} of cells.</p>"
        f"{_large_errors(comparisons)}"
        "<img src='predicted_vs_measured.png' alt='predicted vs measured throughput'>"
        f"<h3>Predictions</h3><pre>{table}</pre><h3>What-if</h3><pre>{what_if}</pre>"
    )


def _large_errors(comparisons) -> str:
    """A list of the cells the model missed by more than 10%, each with its cause."""
    items = "".join(f"<li>{html.escape(c.draft)} K={c.k}: {c.simplified_error:.0%} off "
                    f"(interval {c.interval[0]:.1f}-{c.interval[1]:.1f}, measured {c.measured_tokens_per_s:.1f}): "
                    f"{html.escape(c.cause)}</li>" for c in comparisons if c.cause)
    return f"<p>Cells missed by more than 10%:</p><ul>{items}</ul>" if items else ""


def answer_lines(db, rows: list[dict], checks: list[dict], envs: list[dict], table: bool = True,
                 output_tokens: int | None = None) -> list[str]:
    """The study's answer, as the terminal and the report say it: prefill and decode per engine, one "Use" line
    per model (across its engines), why the Deploy line's engine differs, the numerics, llama-server's per
    concurrency (`table`: with its table) and the Deploy line, the weight types, the engines left out.
    `output_tokens`: the output length the end-to-end times assume (the study's own when None)."""
    summaries = summarize(rows, checks)
    drift = baseline_drift(rows, checks)
    return (engine_answer(summaries) + recommend(summaries, drift, output_tokens) + numerics_notes(envs)
            + deploy_notes(summaries) + server_answer(rows, table=table, margin=drift.typical)
            + weight_type_answer(summaries, rows, table=table) + left_out_notes(db))


def _html(db, summaries: list[CellSummary], optimal: list[OptimalRow], figures: list[tuple[str, str]], envs,
          drift: Drift, sentences: list[str]) -> str:
    esc = html.escape
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    answer = "".join(f"<p class='answer'>{esc(sentence)}</p>" for sentence in sentences)
    opt_rows = "".join(
        f"<tr><td>{esc(r.target)}</td><td>{esc(r.dataset)}</td><td>{r.temperature:g}</td><td>{r.method.upper()}</td>"
        f"<td>{esc(r.drafter)}</td><td>{r.k}</td><td>{r.speedup:.3f}x</td><td>{r.speedup_low:.2f} - {r.speedup_high:.2f}</td>"
        f"<td>{r.tokens_per_s:.1f}</td><td>{f'{r.scaling:.2f}x' if r.scaling else '-'}</td>"
        f"<td>{fmt(r.engine_plain_tokens_per_s, '.1f')}</td><td>{fmt(r.engine_speedup, '.3f')}x</td>"
        f"<td>{fmt(r.host_speedup, '.3f')}x ({r.host_low:.2f} - {r.host_high:.2f})</td></tr>"
        for r in optimal
    )
    lossy_rows = "".join(
        f"<tr class='lossy'><td>{esc(s.target)}</td><td>{esc(s.dataset)}</td><td>{s.method.upper()}</td>"
        f"<td>{esc(s.drafter)}</td><td>{s.k}</td><td>{s.prompts - s.identical}/{s.prompts}</td>"
        f"<td>{s.tokens_per_s:.1f}</td></tr>" for s in lossy_cells(summaries))
    lossy = ("<h2>Lossy cells (not ranked)</h2><p>Greedy outputs that differed from plain decoding on the cell's own "
             "engine; their speed is not a speculative speedup and is left out of the table and plots above.</p>"
             "<table><tr><th>target</th><th>dataset</th><th>method</th><th>draft</th><th>K</th><th>outputs differed</th>"
             f"<th>tok/s</th></tr>{lossy_rows}</table>") if lossy_rows else ""
    cell_rows = "".join(
        f"<tr class='{'lossy' if s.lossy else ''}'>"
        f"<td>{esc(s.target)}</td><td>{esc(s.dataset)}</td><td>{s.temperature:g}</td><td>{s.method.upper()}</td>"
        f"<td>{esc(s.drafter)}</td><td>{s.k}</td><td>{s.prompts}</td><td>{s.tokens_per_s:.1f}</td>"
        f"<td>{s.ms_per_token:.1f}</td><td>{s.speedup:.3f}x</td><td>{s.speedup_min:.2f} / {s.speedup_median:.2f} / {s.speedup_max:.2f}</td>"
        f"<td>{fmt(s.tokens_per_step, '.2f')}</td><td>{fmt(s.acceptance_rate, '.1%')}</td>"
        f"<td>{fmt(s.draft_ms_per_step, '.1f')} / {fmt(s.target_ms_per_step, '.1f')} / {fmt(s.overhead_ms_per_step, '.1f')}</td>"
        f"<td>{'-' if s.identical is None else f'{s.identical}/{s.prompts}'}</td></tr>"
        for s in summaries
    )
    images = "".join(f"<h3>{esc(title)}</h3><img src='{esc(name)}' alt='{esc(title)}'>" for name, title in figures)
    env = "".join(f"<li><code>{esc(str(e))}</code></li>" for e in envs)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>draftlab study report</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1400px}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}th{{background:#eee}}tr.lossy{{background:#fcc}}tr.disagrees{{background:#fde}}tr.agrees{{background:#efe}}p.noisy{{background:#fcc;padding:4px}}p.answer{{font-size:16px;font-weight:bold}}
img{{max-width:100%;border:1px solid #ddd;margin-bottom:1em}}</style></head><body>
<h1>draftlab study report</h1><p>Database: <code>{esc(str(db))}</code>. Speedups are decode tokens/s over the autoregressive
baseline on the same prompts in the same study, paired per prompt; the range is their 95% interval. Scaling = target parameters / draft
parameters ("-" for drafts without parameters, such as n-gram lookup). SpS = draftlab's engine, AsG = Hugging Face
assisted generation with the same draft and K, HF = Hugging Face generate without an assistant (AsG's own plain
decoding): "own plain" is the method's own engine's plain decoding, "vs own" the speedup over it, "vs fastest
plain" the speedup over the fastest plain decoding timed on this host (PLAIN rows: other dtypes and routes). Only cells whose
every greedy output equals plain decoding on their engine are ranked.</p>
<h2>Recommendation</h2>{answer}
<p class='{'noisy' if drift.noisy else ''}'>{esc(drift.describe())}.</p>
<h2>Optimal configuration per category</h2><table><tr><th>target</th><th>dataset</th><th>temp</th><th>method</th><th>draft</th><th>K</th>
<th>speedup</th><th>95% interval</th><th>tok/s</th><th>scaling</th><th>own plain tok/s</th><th>vs own</th><th>vs fastest plain</th></tr>{opt_rows}</table>
{lossy}
<h2>Figures</h2>{images}
<h2>Every cell</h2><p>Rows in red produced output different from the baseline (greedy only; "-" when not defined).
Time split per step: draft / target / overhead (ms).</p>
<table><tr><th>target</th><th>dataset</th><th>temp</th><th>method</th><th>draft</th><th>K</th><th>prompts</th><th>tok/s</th>
<th>ms/token</th><th>speedup</th><th>min / median / max</th><th>TAR</th><th>accept</th><th>ms/step d / t / o</th><th>identical</th></tr>
{cell_rows}</table><h2>Environment</h2><ul>{env}</ul></body></html>"""

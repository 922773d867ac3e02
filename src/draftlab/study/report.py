"""From records to answers: per-cell aggregates, the optimal-configuration table, plots, HTML.

Everything here is computed from the database alone, so a report can be
rebuilt at any time, on any machine, from a study file.
"""

from __future__ import annotations

import csv
import html
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from draftlab.errors import DraftlabError
from draftlab.study.store import ResultsStore

ALL = "all"
NOISY_DRIFT = 0.10  # a baseline that moved more than this (relative) during the study makes it noisy


@dataclass
class CellSummary:
    """Aggregates of one cell (or of one configuration over all datasets, dataset='all')."""

    target: str
    method: str
    drafter: str
    k: int
    dataset: str
    temperature: float
    prompts: int
    new_tokens: int
    wall_s: float
    tokens_per_s: float
    ms_per_token: float
    tokens_per_step: float | None  # TAR; None for asg (HF does not report steps)
    acceptance_rate: float | None
    draft_ms_per_step: float | None
    target_ms_per_step: float | None
    overhead_ms_per_step: float | None
    speedup: float = 0.0  # tokens/s over the ar cell's on the same prompts
    speedup_min: float = 0.0
    speedup_median: float = 0.0
    speedup_max: float = 0.0
    identical: int | None = None  # outputs equal to ar (greedy only)
    per_position_acceptance: list[float] = field(default_factory=list)

    @property
    def config_key(self) -> tuple:
        return (self.target, self.method, self.drafter, self.k, self.temperature)


def summarize(rows: list[dict], checks: list[dict] = ()) -> list[CellSummary]:
    """One summary per (cell) and per (configuration, dataset='all').

    `checks`: re-timings of the baseline (`ResultsStore.baseline_checks`); each record is then compared with
    the baseline measured closest in time on its prompt, so that drift during the study cancels.
    """
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        config = (row["target"], row["method"], row["drafter"], row["k"], row["temperature"])
        groups[config + (row["dataset"],)].append(row)
        groups[config + (ALL,)].append(row)
    baseline_speed = nearest_baseline(rows, checks)
    return [_summarize_group(key, group, baseline_speed) for key, group in sorted(groups.items(), key=_sort_key)]


def prompt_key(row: dict) -> tuple:
    return (row["target"], row["dataset"], row["temperature"], row["prompt_id"])


def _baseline_timings(rows: list[dict], checks: list[dict]) -> dict[tuple, list[tuple[float | None, float]]]:
    """Per prompt, every (finished_at, tokens/s) of its baseline: the ar record and its re-checks."""
    timings: dict[tuple, list[tuple[float | None, float]]] = defaultdict(list)
    for r in [*(r for r in rows if r["method"] == "ar"), *checks]:
        if r["wall_s"] > 0:
            timings[prompt_key(r)].append((r.get("finished_at"), r["new_tokens"] / r["wall_s"]))
    return timings


def nearest_baseline(rows: list[dict], checks: list[dict]) -> Callable[[dict], float | None]:
    """record -> the baseline's tokens/s on its prompt measured closest in time (the ar record if times are unknown)."""
    timings = _baseline_timings(rows, checks)

    def speed(row: dict) -> float | None:
        known = timings.get(prompt_key(row))
        if not known:
            return None
        at = row.get("finished_at")
        timed = [(t, v) for t, v in known if t is not None]
        if at is None or not timed:
            return known[0][1]
        return min(timed, key=lambda tv: abs(tv[0] - at))[1]

    return speed


@dataclass(frozen=True)
class Drift:
    """How much the baseline moved during a study: the largest relative spread of one prompt's re-timings.

    The median over prompts beside it tells a machine that was noisy throughout (median close to the largest)
    from one disturbed once (a small median under one large spread); the NOISY flag follows the largest.
    """

    prompts: int  # prompts whose baseline was timed more than once
    spread: float  # max over prompts of (fastest - slowest) / median baseline tokens/s
    typical: float = 0.0  # the median over prompts of the same spread

    @property
    def noisy(self) -> bool:
        """True when the machine's speed moved enough to shift ratios measured against one baseline."""
        return self.spread > NOISY_DRIFT

    def describe(self) -> str:
        """One sentence for the terminal and the report."""
        if not self.prompts:
            return "baseline drift: not measured (no baseline re-checks in this study)"
        verdict = ("NOISY: the machine's speed moved during the study; each speedup is against the baseline "
                   "measured closest in time, but treat differences below the drift as noise"
                   if self.noisy else "quiet")
        return (f"baseline drift: {self.spread:.1%} over {self.prompts} prompt(s), median {self.typical:.1%} "
                f"({verdict})")


def baseline_drift(rows: list[dict], checks: list[dict]) -> Drift:
    """The study's drift from its baseline re-checks."""
    spreads = [
        (max(speeds) - min(speeds)) / statistics.median(speeds)
        for speeds in ([v for _, v in timings] for timings in _baseline_timings(rows, checks).values())
        if len(speeds) > 1
    ]
    return Drift(len(spreads), max(spreads, default=0.0), statistics.median(spreads) if spreads else 0.0)


def _sort_key(item):
    (target, method, drafter, k, temperature, dataset), _ = item
    return (target, dataset, temperature, {"ar": 0, "sps": 1, "asg": 2}.get(method, 3), drafter, k)


def _summarize_group(key: tuple, rows: list[dict], baseline_speed: Callable[[dict], float | None]) -> CellSummary:
    target, method, drafter, k, temperature, dataset = key
    new_tokens = sum(r["new_tokens"] for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    steps = sum(r["steps"] for r in rows)
    drafted = sum(r["drafted"] for r in rows)
    per_step = lambda name: 1000 * sum(r[name] for r in rows) / steps if steps else None  # noqa: E731
    summary = CellSummary(
        target, method, drafter, k, dataset, temperature, len(rows), new_tokens, wall,
        tokens_per_s=new_tokens / wall if wall else 0.0,
        ms_per_token=1000 * wall / new_tokens if new_tokens else 0.0,
        tokens_per_step=new_tokens / steps if steps else None,
        acceptance_rate=sum(r["accepted"] for r in rows) / drafted if drafted else None,
        draft_ms_per_step=per_step("draft_s"),
        target_ms_per_step=1000 * sum(r["target_s"] + r["prefill_s"] for r in rows) / steps if steps else None,
        overhead_ms_per_step=per_step("overhead_s"),
        per_position_acceptance=_per_position(rows),
    )
    _add_speedups(summary, rows, baseline_speed)
    known = [r["identical"] for r in rows if r["identical"] is not None]
    summary.identical = sum(known) if known else None
    return summary


def _add_speedups(summary: CellSummary, rows: list[dict], baseline_speed: Callable[[dict], float | None]) -> None:
    """Overall speedup (total tokens/s over the baseline's on the same prompts) and its spread over prompts."""
    matched = [(r, baseline_speed(r)) for r in rows]
    matched = [(r, base) for r, base in matched if base and r["wall_s"] > 0]
    if not matched:
        return
    per_prompt = [(r["new_tokens"] / r["wall_s"]) / base for r, base in matched]
    base_time = sum(r["new_tokens"] / base for r, base in matched)  # the baseline's time for the same tokens
    summary.speedup = base_time / sum(r["wall_s"] for r, _ in matched)
    summary.speedup_min, summary.speedup_max = min(per_prompt), max(per_prompt)
    summary.speedup_median = statistics.median(per_prompt)


def _depths(row: dict) -> list[int]:
    """Each step's drafted depth: its number of tree levels, or its drafted count for a chain."""
    return [len(levels) for levels in row.get("levels_per_step") or []] or row["drafted_per_step"]


def _per_position(rows: list[dict]) -> list[float]:
    """P(depth i accepted | drafted to depth i): a tree's positions are its levels."""
    drafted_at: dict[int, int] = defaultdict(int)
    accepted_at: dict[int, int] = defaultdict(int)
    for row in rows:
        for depth, accepted in zip(_depths(row), row["accepted_per_step"]):
            for i in range(depth):
                drafted_at[i] += 1
                accepted_at[i] += i < accepted
    return [accepted_at[i] / drafted_at[i] for i in range(len(drafted_at))]


@dataclass(frozen=True)
class OptimalRow:
    """The best configuration of one method for one target and dataset, as in the first study's table."""

    target: str
    dataset: str
    temperature: float
    method: str
    drafter: str
    k: int
    speedup: float
    speedup_min: float
    speedup_max: float
    tokens_per_s: float
    scaling: float | None  # target params / draft params; None when the draft has no parameters


def optimal_table(summaries: list[CellSummary], params: dict[str, int]) -> list[OptimalRow]:
    """Per (target, dataset, temperature) and method, the (draft, K) with the highest speedup."""
    best: dict[tuple, CellSummary] = {}
    for s in summaries:
        key = (s.target, s.dataset, s.temperature, s.method)
        if key not in best or s.speedup > best[key].speedup:
            best[key] = s
    rows = []
    for (target, dataset, temperature, method), s in best.items():
        draft_params = params.get(f"{target}::{s.drafter}")
        scaling = 1.0 if method == "ar" else (params[target] / draft_params if draft_params and target in params else None)
        rows.append(OptimalRow(target, dataset, temperature, method, s.drafter, s.k, s.speedup, s.speedup_min,
                               s.speedup_max, s.tokens_per_s, scaling))
    datasets_per_target = defaultdict(set)
    for r in rows:
        datasets_per_target[r.target].add(r.dataset)
    # With a single dataset, its 'all' rows would only repeat it.
    rows = [r for r in rows if r.dataset != ALL or len(datasets_per_target[r.target]) > 2]
    order = {"ar": 0, "sps": 1, "asg": 2}
    return sorted(rows, key=lambda r: (r.target, r.dataset != ALL, r.dataset, r.temperature, order.get(r.method, 3)))


def format_optimal(rows: list[OptimalRow]) -> str:
    """The optimal table as text, for a terminal or a closing note; columns as wide as their longest name."""
    width = lambda name, values: max([len(name), *map(len, values)]) + 2  # noqa: E731
    target_w = width("target", [r.target for r in rows])
    dataset_w = width("dataset", [r.dataset for r in rows])
    draft_w = width("draft", [r.drafter for r in rows])
    header = (f"{'target':<{target_w}}{'dataset':<{dataset_w}}{'temp':>5}  {'method':<7}{'draft':<{draft_w}}{'K':>3}"
              f"{'speedup':>9}  {'(min-max)':<12}{'tok/s':>7}{'scaling':>9}")
    lines = [header]
    for r in rows:
        scaling = f"{r.scaling:.2f}x" if r.scaling else "-"
        lines.append(
            f"{r.target:<{target_w}}{r.dataset:<{dataset_w}}{r.temperature:>5.2f}  "
            f"{r.method.upper() if r.method != 'ar' else 'AR':<7}{r.drafter:<{draft_w}}{r.k:>3}{r.speedup:>8.3f}x  "
            f"{r.speedup_min:.2f}-{r.speedup_max:<7.2f}{r.tokens_per_s:>7.1f}{scaling:>9}"
        )
    return "\n".join(lines)


def _identical_text(s: CellSummary) -> str:
    if s.identical is None:
        return "outputs sampled, so not compared token by token"
    if s.identical == s.prompts:
        return f"every output identical to plain decoding ({s.identical}/{s.prompts})"
    return f"only {s.identical}/{s.prompts} outputs identical to plain decoding"


def _lossy(s: CellSummary) -> bool:
    return s.identical is not None and s.identical < s.prompts


def recommend(summaries: list[CellSummary], drift: Drift) -> list[str]:
    """One sentence per target and temperature: which draft and K to use here, or plain decoding.

    Judged on each configuration's speedup over all the study's prompts (dataset 'all'); configurations
    whose greedy output differed from plain decoding are never recommended. A gain smaller than the
    baseline's drift on a noisy machine is said to be within the noise.
    """
    groups: dict[tuple, list[CellSummary]] = defaultdict(list)
    for s in summaries:
        if s.dataset == ALL and s.method != "ar" and s.speedup > 0:
            groups[(s.target, s.temperature)].append(s)
    temperatures = defaultdict(set)
    for target, temperature in groups:
        temperatures[target].add(temperature)
    sentences = []
    for (target, temperature), cells in sorted(groups.items()):
        where = target + (f" at temperature {temperature:g}" if len(temperatures[target]) > 1 else "")
        lossless = [s for s in cells if not _lossy(s)]
        lossy = len(cells) - len(lossless)
        warning = (f" ({lossy} configuration(s) produced output different from plain decoding and were not "
                   "considered: see the report)") if lossy else ""
        if not lossless:
            sentences.append(f"Use plain decoding for {where}: every configuration measured differed from it{warning}.")
            continue
        best = max(lossless, key=lambda s: s.speedup)
        measured = (f"{best.speedup:.2f}x plain decoding, {best.speedup_min:.2f}-{best.speedup_max:.2f}x over "
                    f"{best.prompts} prompts, {best.tokens_per_s:.1f} tok/s")
        name = f"{best.drafter} at K={best.k} ({'SpS' if best.method == 'sps' else 'AsG'})"
        if best.speedup <= 1.0:
            sentences.append(f"Use plain decoding for {where} on this machine: no configuration beat it "
                             f"(the best, {name}, ran at {measured}; {_identical_text(best)}){warning}.")
            continue
        noise = (f"; the gain is within the machine's drift during the study ({drift.spread:.0%}), so confirm it "
                 "on a quiet machine" if drift.noisy and best.speedup - 1.0 <= drift.spread else "")
        sentences.append(f"Use {name} for {where} on this machine: {measured}; {_identical_text(best)}"
                         f"{noise}{warning}.")
    return sentences


def load_study(db: str | Path) -> tuple[list[dict], dict[str, int], list[dict]]:
    """Records, parameter counts and environments of a study database."""
    if not Path(db).exists():
        raise DraftlabError(f"study database not found: {db}")
    store = ResultsStore(db)
    try:
        rows, params, envs = store.rows(), store.params(), store.environments()
    finally:
        store.close()
    if not rows:
        raise DraftlabError(f"{db} holds no records yet; run `draftlab sweep --db {db}` first")
    return rows, params, envs


def load_checks(db: str | Path) -> list[dict]:
    """The baseline re-checks of a study database (empty for studies made before they existed)."""
    store = ResultsStore(db)
    try:
        return store.baseline_checks()
    finally:
        store.close()


def write_csv(path: Path, items: list) -> None:
    """Dataclass instances (or dicts) to CSV."""
    dicts = [asdict(i) if not isinstance(i, dict) else i for i in items]
    if not dicts:
        return
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dicts[0]))
        writer.writeheader()
        writer.writerows(dicts)


def build_report(db: str | Path, out: str | Path, profile_path: str | Path | None = None,
                 microbench_path: str | Path | None = None, correlate_path: str | Path | None = None) -> Path:
    """Write index.html, the PNGs and CSVs it shows, into `out`; return the HTML path.

    With a calibration profile, the page also checks the performance model against the
    records (predicted vs measured, errors of both formulas) and shows the what-if tables.
    The seeds' findings are set beside the study's cells, and beside the microbenchmark
    (`design microbench`'s microbench.json) and the correlation (`design correlate`'s
    correlate.json) when given.
    """
    from draftlab.study import plots
    from draftlab.study.findings import gather_evidence, seeds_findings

    rows, params, envs = load_study(db)
    checks = load_checks(db)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summaries = summarize(rows, checks)
    optimal = optimal_table(summaries, params)
    write_csv(out / "cells.csv", summaries)
    write_csv(out / "optimal.csv", optimal)
    figures = plots.draw_all(summaries, out)
    evidence = gather_evidence(summaries, params, rows, profile_path, microbench_path, correlate_path)
    model_section = _model_section(profile_path, evidence.comparisons, out) if profile_path else ""
    findings = seeds_findings(evidence)
    drift = baseline_drift(rows, checks)
    page = _html(db, summaries, optimal, figures, envs, drift, recommend(summaries, drift))
    page = page.replace("<h2>Figures</h2>", _findings_section(findings) + "<h2>Figures</h2>")
    page = page.replace("<h2>Every cell</h2>", model_section + "<h2>Every cell</h2>")
    (out / "index.html").write_text(page, encoding="utf-8")
    return out / "index.html"


def comparisons_of(profile_path, rows: list[dict]) -> list:
    """The performance model's predictions (from a calibration profile) beside the measured records."""
    from draftlab.perf.calibrate import Profile
    from draftlab.perf.tuner import compare

    return compare(Profile.load(profile_path), rows)


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
    from draftlab.perf.calibrate import Profile
    from draftlab.perf.tuner import error_summary, format_predictions, format_what_if, plot_comparison, predictions

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


def _html(db, summaries: list[CellSummary], optimal: list[OptimalRow], figures: list[tuple[str, str]], envs,
          drift: Drift, sentences: list[str]) -> str:
    esc = html.escape
    answer = "".join(f"<p class='answer'>{esc(sentence)}</p>" for sentence in sentences)
    opt_rows = "".join(
        f"<tr><td>{esc(r.target)}</td><td>{esc(r.dataset)}</td><td>{r.temperature:g}</td><td>{r.method.upper()}</td>"
        f"<td>{esc(r.drafter)}</td><td>{r.k}</td><td>{r.speedup:.3f}x</td><td>{r.speedup_min:.2f} - {r.speedup_max:.2f}</td>"
        f"<td>{r.tokens_per_s:.1f}</td><td>{f'{r.scaling:.2f}x' if r.scaling else '-'}</td></tr>"
        for r in optimal
    )
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    cell_rows = "".join(
        f"<tr class='{'lossy' if s.identical is not None and s.identical < s.prompts else ''}'>"
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
<h1>draftlab study report</h1><p>Database: <code>{esc(str(db))}</code>. Speedups are tokens/s over the autoregressive
baseline on the same prompts in the same study; the range is min - max over prompts. Scaling = target parameters / draft
parameters ("-" for drafts without parameters, such as n-gram lookup). SpS = draftlab's engine, AsG = Hugging Face
assisted generation with the same draft and K.</p>
<h2>Recommendation</h2>{answer}
<p class='{'noisy' if drift.noisy else ''}'>{esc(drift.describe())}.</p>
<h2>Optimal configuration per category</h2><table><tr><th>target</th><th>dataset</th><th>temp</th><th>method</th><th>draft</th><th>K</th>
<th>speedup</th><th>min - max</th><th>tok/s</th><th>scaling</th></tr>{opt_rows}</table>
<h2>Figures</h2>{images}
<h2>Every cell</h2><p>Rows in red produced output different from the baseline (greedy only; "-" when not defined).
Time split per step: draft / target / overhead (ms).</p>
<table><tr><th>target</th><th>dataset</th><th>temp</th><th>method</th><th>draft</th><th>K</th><th>prompts</th><th>tok/s</th>
<th>ms/token</th><th>speedup</th><th>min / median / max</th><th>TAR</th><th>accept</th><th>ms/step d / t / o</th><th>identical</th></tr>
{cell_rows}</table><h2>Environment</h2><ul>{env}</ul></body></html>"""

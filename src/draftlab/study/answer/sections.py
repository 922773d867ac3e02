"""The sections of a study's answer, in the one order the terminal, `draftlab report` and the HTML page print them.

Each section is a function `section(results) -> Section | None` (None: nothing to say for this study). `SECTIONS`
is the only place their order is written; `terminal_lines` and `draftlab.study.answer.page` render the same list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from draftlab.deploy import export
from draftlab.errors import DraftlabError
from draftlab.perf.present import format_what_if
from draftlab.perf.validate import error_summary, format_predictions, predictions
from draftlab.study.answer import html_tables as h
from draftlab.study.answer.findings import format_findings
from draftlab.study.answer.learning import format_learning, learning_rows
from draftlab.study.answer.recommend import (deploy_notes, engine_answer, fastest_lossless, left_out_notes,
                                             numerics_notes, recommend)
from draftlab.study.answer.results import StudyResults
from draftlab.contenders.draftlab_serve import SERVE_DEPLOY
from draftlab.study.answer.serve_deploy import drafter_rows, serve_sentences
from draftlab.study.answer.serving import format_load, server_answer, server_deployables
from draftlab.study.answer.tables import format_lossy, format_optimal, lossy_cells
from draftlab.study.answer.weight_types import file_bytes, format_weight_types, weight_type_rows, weight_type_sentences


@dataclass(frozen=True)
class Section:
    """One part of the answer: its title, a note under it, its lines for a terminal and its HTML."""

    title: str
    lines: list[str]
    html: str
    note: str = ""


def drift_section(r: StudyResults) -> Section:
    line = r.drift.describe()
    return Section("Baseline drift", [line], h.paragraphs([line], "noisy" if r.drift.noisy else ""))


def answer_section(r: StudyResults) -> Section:
    """Prefill and decode per engine, one Use line per model, and numerics that are exact only up to rounding."""
    lines = (engine_answer(r.summaries) + recommend(r.summaries, r.drift, r.inputs.output_tokens)
             + numerics_notes(r.envs))
    return Section("The answer", lines, h.paragraphs(lines, "answer"))


def deploy_section(r: StudyResults) -> Section | None:
    notes = deploy_notes(r.summaries, r.drift, r.inputs.output_tokens, r.served_as,
                         drafter_rows(r.load_summaries, r.drift.typical))
    answered = any(SERVE_DEPLOY in line for line in notes)  # the Use line's answer already on draftlab serve
    served = ([] if answered else serve_sentences(r.load_summaries, r.drift.typical)) + server_answer(
        r.load_summaries, r.drift.typical)
    deploys = [line for line in notes if line.startswith("Deploy ")]  # a vLLM answer's own command
    lines = (notes if any(line.startswith("Deploy ") for line in served) else deploys) + served
    return Section("Deploy", lines, h.paragraphs(lines, "answer")) if lines else None


def concurrency_section(r: StudyResults) -> Section | None:
    text = format_load(r.load_summaries)
    return Section("Served engines per concurrency", text.splitlines(), h.pre(text),
                   "Aggregate tok/s; identical: to the same server's plain decoding; = draftlab: to draftlab's plain "
                   "decoding of the target (greedy); x: over the same server's plain decoding at that level, paired "
                   "per prompt.") if text else None


def weight_types_section(r: StudyResults) -> Section | None:
    found = weight_type_rows(r.summaries, r.rows, file_bytes)
    if not found:
        return None
    text = format_weight_types(found)
    sentences = weight_type_sentences(found)
    return Section("Weight types", sentences + text.splitlines(), h.paragraphs(sentences) + h.pre(text),
                   "Greedy; '= shipped': plain outputs equal to the shipped type's.")


def left_out_section(r: StudyResults) -> Section | None:
    lines = left_out_notes(r.left_out)
    return Section("Engines left out", lines, h.paragraphs(lines)) if lines else None


def optimal_section(r: StudyResults) -> Section | None:
    if not r.optimal:
        return None
    return Section("Optimal configuration per category", format_optimal(r.optimal).splitlines(),
                   h.optimal_html(r.optimal), "Speedups are decode tokens/s over plain decoding on the same prompts, "
                   "paired per prompt, with their 95% interval; 'vs fastest plain': over the fastest plain decoding "
                   "timed on this host. Only cells whose every greedy output equals plain decoding are ranked.")


def learning_section(r: StudyResults) -> Section | None:
    text = format_learning(learning_rows(r.summaries, r.rows))
    return Section("Drafts that learn across requests", text.splitlines(), h.pre(text),
                   "Suffix decoding per workload; later: tokens per step over the later half of the prompts."
                   ) if text else None


def lossy_section(r: StudyResults) -> Section | None:
    cells = lossy_cells(r.summaries)
    return Section("Lossy cells (not ranked)", format_lossy(cells).splitlines(), h.lossy_html(cells),
                   "Greedy outputs that differed from plain decoding on the cell's own engine: their speed is not a "
                   "speculative speedup.") if cells else None


def skips_section(r: StudyResults) -> Section | None:
    cells = skipped_cells(r.skips)
    if not cells:
        return None
    lines = [f"{cell}: {count} prompt(s) skipped, {reason}" for cell, count, reason in cells]
    return Section("Cells not measured on every prompt (not ranked)", lines,
                   h.table(["cell", "prompts skipped", "why (first)"], [[c, str(n), why] for c, n, why in cells]),
                   "Dropped by the race once they trailed the fastest cell by more than the margin, or skipped where "
                   "their library could not run a prompt.")


def skipped_cells(skips: list[dict]) -> list[tuple[str, int, str]]:
    """(cell, prompts skipped, first reason) per cell, in the order they were first skipped."""
    by_cell: dict[str, list[dict]] = {}
    for skip in skips:
        by_cell.setdefault(skip["cell"], []).append(skip)
    return [(_cell_words(key), len(items), items[0]["reason"]) for key, items in by_cell.items()]


def _cell_words(key: str) -> str:
    """'target|method|drafter|k=K|dataset|...' -> 'target METHOD drafter K=K (dataset)'."""
    target, method, drafter, k, dataset, *_ = key.split("|")
    return f"{target} {method.upper()} {drafter} {k.upper()} ({dataset})"


def exports_section(r: StudyResults) -> Section | None:
    """The configuration to deploy in each engine the reader asked for: llama-server's chosen configuration where the
    study ran it (with its K per batch size), else the study's fastest lossless configuration."""
    if not r.inputs.export:
        return None
    choices = server_deployables(r.rows, r.drift.typical) or fastest_lossless(r.summaries)
    lines = [] if choices else ["the study holds no configuration measured on every prompt"]
    for choice in choices:
        lines.append(f"{choice.target} {choice.draft} K={choice.k}:")
        lines += [f"{engine}: {_exported(choice, engine)}" for engine in r.inputs.export]
    return Section("Exports", lines, h.pre("\n".join(lines)))


def _exported(choice, engine: str) -> str:
    try:
        return export(choice, engine)
    except DraftlabError as exc:
        return f"not exported: {exc}"


def findings_section(r: StudyResults) -> Section:
    return Section("The seeds' findings beside ours", format_findings(r.findings).splitlines(),
                   h.findings_html(r.findings), "Each finding of the two studies behind draftlab (GPUs, models of "
                   "70M-65B parameters) against what this study measured on this machine.")


def model_section(r: StudyResults) -> Section | None:
    """The performance model against the records, with a calibration profile: errors, predictions and what-ifs."""
    if r.inputs.profile is None:
        return None
    errors = error_summary(r.evidence.comparisons)
    preds = predictions(r.profile)
    summary = (f"Decode throughput of {errors['cells']} SpS cells against the calibration profile {r.inputs.profile}: "
               f"TAR / (t_target + t_draft) mean error {errors['simplified_mean_error']:.1%}, max "
               f"{errors['simplified_max_error']:.1%}; Leviathan et al. mean {errors['leviathan_mean_error']:.1%}, max "
               f"{errors['leviathan_max_error']:.1%}; the measured throughput falls inside the predicted interval in "
               f"{errors['inside_interval']:.0%} of cells.")
    missed = [f"{c.draft} K={c.k}: {c.simplified_error:.0%} off (interval {c.interval[0]:.1f}-{c.interval[1]:.1f}, "
              f"measured {c.measured_tokens_per_s:.1f}): {c.cause}" for c in r.evidence.comparisons if c.cause]
    table = format_predictions(preds, r.profile.target.autoregressive_tokens_per_s)
    what_if = format_what_if(preds)
    image = h.images_html([r.comparison_plot]) if r.comparison_plot else ""
    return Section("Performance model", [summary, *missed], h.paragraphs([summary, *missed]) + image
                   + f"<h3>Predictions</h3>{h.pre(table)}<h3>What-if</h3>{h.pre(what_if)}")


def figures_section(r: StudyResults) -> Section | None:
    if not r.figures:
        return None
    return Section("Figures", [f"{title}: {r.figures_dir / name}" for name, title in r.figures],
                   h.images_html(r.figures))


def cells_section(r: StudyResults) -> Section:
    lossy = sum(s.lossy for s in r.summaries)
    line = f"{len(r.summaries)} cell summaries ({lossy} lossy), each in the HTML page and cells.csv"
    return Section("Every cell", [line], h.cells_html(r.summaries), "Rows in red produced output different from "
                   "plain decoding (greedy only). Time split per step: draft / target / overhead (ms).")


def environment_section(r: StudyResults) -> Section:
    lines = [", ".join(f"{key}={value}" for key, value in env.items()) for env in r.envs]
    return Section("Environment", [f"{len(lines)} environment record(s), in the HTML page"],
                   "<ul>" + "".join(f"<li><code>{h.esc(line)}</code></li>" for line in lines) + "</ul>")


SECTIONS: tuple[Callable[[StudyResults], Section | None], ...] = (
    drift_section, answer_section, deploy_section, concurrency_section, weight_types_section, left_out_section,
    optimal_section, learning_section, lossy_section, skips_section, exports_section, findings_section,
    model_section, figures_section, cells_section, environment_section,
)


def sections_of(results: StudyResults) -> list[Section]:
    """The study's sections, in `SECTIONS` order, leaving out those with nothing to say."""
    return [section for section in (make(results) for make in SECTIONS) if section is not None]


def terminal_lines(sections: list[Section]) -> list[str]:
    """The sections for a terminal: a title line, the note, then the section's lines as they are."""
    lines = []
    for section in sections:
        lines.append(f"== {section.title} ==")
        lines += [section.note] if section.note else []
        lines += section.lines
    return lines

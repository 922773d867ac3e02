"""Drafts that learn across requests in a study: per workload, suffix decoding cold and warm beside n-gram lookup
and plain decoding.

A suffix cell's prompts are a stream: its cache starts empty and holds the responses of the cell's earlier
prompts (`cache_held`), unless the spec holds none (`responses=0`: cold throughout). For each (target, workload,
temperature) the table gives every suffix cell's tokens per step over all its prompts and over the later half
(where a learning cache is warm), its speedup over draftlab's plain decoding and over the fastest plain decoding
measured, beside the best n-gram cell and plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftlab.study.answer.report import ALL, CellSummary
from draftlab.contenders.methods import AR, PLAIN, SPS
from draftlab.drafters.kinds import is_lookup, learns_across_requests


@dataclass(frozen=True)
class LearningRow:
    """One cell of a workload in the table."""

    target: str
    dataset: str
    temperature: float
    label: str  # 'suffix warm', 'suffix cold', 'best n-gram', 'plain'
    drafter: str
    k: int
    tokens_per_step: float | None
    later_tokens_per_step: float | None  # over the later half of the prompts
    speedup: float
    host_speedup: float | None


def learning_rows(summaries: list[CellSummary], rows: list[dict]) -> list[LearningRow]:
    """The table's rows, for every workload that has a suffix cell (none: an empty list)."""
    out: list[LearningRow] = []
    sps = [s for s in summaries if s.method == SPS.name and s.dataset != ALL]  # a workload is one stream
    for group in sorted({(s.target, s.dataset, s.temperature) for s in sps if learns_across_requests(s.drafter)}):
        cells = [s for s in sps if (s.target, s.dataset, s.temperature) == group]
        ngram = [s for s in cells if is_lookup(s.drafter)]
        chosen = [(_label(s), s) for s in cells if learns_across_requests(s.drafter)]
        if ngram:
            chosen.append(("best n-gram", max(ngram, key=lambda s: s.tokens_per_s)))
        out += [_row(label, s, rows) for label, s in chosen]
        out.append(LearningRow(*group, PLAIN.name, "none", 0, 1.0, 1.0, 1.0, _plain_host_speedup(summaries, group)))
    return out


def format_learning(table: list[LearningRow]) -> str:
    """The table as text (empty when the study has no suffix cell)."""
    if not table:
        return ""
    lines = [f"{'target':<24}{'dataset':<16}{'':<13}{'draft':<28}{'K':>3}{'tok/step':>9}{'later':>7}"
             f"{'speedup':>9}{'vs fastest':>11}"]
    for r in table:
        host = f"{r.host_speedup:.2f}x" if r.host_speedup is not None else "-"
        lines.append(f"{r.target[:23]:<24}{r.dataset[:15]:<16}{r.label:<13}{r.drafter[:27]:<28}{r.k:>3}"
                     f"{_num(r.tokens_per_step):>9}{_num(r.later_tokens_per_step):>7}{r.speedup:>8.2f}x{host:>11}")
    return "\n".join(lines)


def _label(summary: CellSummary) -> str:
    return "suffix cold" if "responses=0" in summary.drafter else "suffix warm"


def _row(label: str, summary: CellSummary, rows: list[dict]) -> LearningRow:
    return LearningRow(summary.target, summary.dataset, summary.temperature, label, summary.drafter, summary.k,
                       summary.tokens_per_step, _later_tokens_per_step(summary, rows), summary.speedup,
                       summary.host_speedup)


def _later_tokens_per_step(summary: CellSummary, rows: list[dict]) -> float | None:
    """Tokens per step over the later half of the cell's prompts, in the order they ran."""
    mine = [r for r in rows if (r["target"], r["method"], r["drafter"], r["k"], r["dataset"], r["temperature"]) ==
            (summary.target, SPS.name, summary.drafter, summary.k, summary.dataset, summary.temperature)]
    mine.sort(key=lambda r: (r["cache_held"] or 0, r["finished_at"] or 0))
    later = mine[len(mine) // 2:]
    steps = sum(r["steps"] for r in later)
    return sum(r["new_tokens"] for r in later) / steps if steps else None


def _plain_host_speedup(summaries: list[CellSummary], group: tuple) -> float | None:
    """draftlab's plain decoding over the fastest plain decoding measured (1.0 when it is the fastest)."""
    base = next((s for s in summaries if s.method == AR.name and (s.target, s.dataset, s.temperature) == group), None)
    return base.host_speedup if base is not None else None


def _num(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"

"""The study's tables for people: the best configuration per method (the first study's table) and the cells whose
outputs differed from plain decoding."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from draftlab.contenders.methods import is_baseline, method_of
from draftlab.study.answer.report import ALL, CellSummary
from draftlab.study.answer.summary import interval_words


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
    speedup_low: float  # the speedup's paired 95% interval over the prompts
    speedup_high: float
    tokens_per_s: float
    scaling: float | None  # target params / draft params; None when the draft has no parameters
    engine_plain_tokens_per_s: float | None = None  # plain decoding on the method's own engine
    engine_speedup: float | None = None  # over that engine's plain decoding
    host_speedup: float | None = None  # over the fastest plain decoding measured on the host
    host_low: float = 0.0  # its paired 95% interval
    host_high: float = 0.0
    prompts: int = 0  # the prompts the speedups pair over


def optimal_table(summaries: list[CellSummary], params: dict[str, int]) -> list[OptimalRow]:
    """Per (target, dataset, temperature) and method, the lossless (draft, K) with the highest speedup.

    A cell whose greedy outputs differed from plain decoding on its engine is never ranked (see `lossy_cells`).
    """
    best: dict[tuple, CellSummary] = {}
    for s in summaries:
        if s.lossy or not s.complete or method_of(s.method).peer_plain:  # a peer's plain shows as "own plain"
            continue
        key = (s.target, s.dataset, s.temperature, s.method)
        if key not in best or s.speedup > best[key].speedup:
            best[key] = s
    rows = []
    for (target, dataset, temperature, method), s in best.items():
        draft_params = params.get(f"{target}::{s.drafter}")
        scaling = 1.0 if is_baseline(method) else (params[target] / draft_params if draft_params and target in params else None)
        rows.append(OptimalRow(target, dataset, temperature, method, s.drafter, s.k, s.speedup, s.speedup_low,
                               s.speedup_high, s.tokens_per_s, scaling, s.engine_plain_tokens_per_s, s.engine_speedup,
                               s.host_speedup, s.host_low, s.host_high, s.prompts))
    datasets_per_target = defaultdict(set)
    for r in rows:
        datasets_per_target[r.target].add(r.dataset)
    # With a single dataset, its 'all' rows would only repeat it.
    rows = [r for r in rows if r.dataset != ALL or len(datasets_per_target[r.target]) > 2]
    return sorted(rows, key=lambda r: (r.target, r.dataset != ALL, r.dataset, r.temperature,
                                       method_of(r.method).order))


def lossy_cells(summaries: list[CellSummary]) -> list[CellSummary]:
    """Cells whose greedy outputs differed from plain decoding on their own engine: reported, never ranked."""
    return [s for s in summaries if s.lossy and s.dataset == ALL] or [s for s in summaries if s.lossy]


def format_lossy(cells: list[CellSummary]) -> str:
    """The lossy cells as text: how many outputs differed, and how fast they were (which is not to be trusted)."""
    lines = [f"{s.method.upper()} {s.drafter} K={s.k} ({s.dataset}): {s.prompts - s.identical}/{s.prompts} outputs "
             f"differed; {s.tokens_per_s:.1f} tok/s" for s in cells]
    return "\n".join(lines)


def format_optimal(rows: list[OptimalRow]) -> str:
    """The optimal table as text, for a terminal or a closing note; columns as wide as their longest name."""
    width = lambda name, values: max([len(name), *map(len, values)]) + 2  # noqa: E731
    target_w = width("target", [r.target for r in rows])
    dataset_w = width("dataset", [r.dataset for r in rows])
    draft_w = width("draft", [r.drafter for r in rows])
    intervals = [interval_words(r.speedup_low, r.speedup_high, r.prompts) for r in rows]
    ci_w = width("(95% CI)", intervals)
    fastest_w = max([len("vs fastest (95% CI)"), *(len(interval_words(r.host_low, r.host_high, r.prompts)) + 9
                                                  for r in rows)]) + 3
    header = (f"{'target':<{target_w}}{'dataset':<{dataset_w}}{'temp':>5}  {'method':<7}{'draft':<{draft_w}}{'K':>3}"
              f"{'speedup':>9}  {'(95% CI)':<{ci_w}}{'tok/s':>7}{'scaling':>9}{'own plain':>11}{'vs own':>8}"
              f"{'vs fastest (95% CI)':>{fastest_w}}")
    lines = [header]
    for r, ci in zip(rows, intervals):
        scaling = f"{r.scaling:.2f}x" if r.scaling else "-"
        own = f"{r.engine_plain_tokens_per_s:.1f}" if r.engine_plain_tokens_per_s else "-"
        vs_own = f"{r.engine_speedup:.2f}x" if r.engine_speedup else "-"
        vs_fastest = (f"{r.host_speedup:.2f}x ({interval_words(r.host_low, r.host_high, r.prompts)})"
                      if r.host_speedup else "-")
        lines.append(
            f"{r.target:<{target_w}}{r.dataset:<{dataset_w}}{r.temperature:>5.2f}  "
            f"{r.method.upper():<7}{r.drafter:<{draft_w}}{r.k:>3}{r.speedup:>8.3f}x  "
            f"{ci:<{ci_w}}{r.tokens_per_s:>7.1f}{scaling:>9}{own:>11}{vs_own:>8}{vs_fastest:>{fastest_w}}"
        )
    return "\n".join(lines)

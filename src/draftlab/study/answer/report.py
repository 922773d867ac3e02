"""From records to answers: per-cell aggregates, the optimal-configuration table, plots, HTML.

Everything here is computed from the database alone, so a report can be rebuilt at any time, on any machine, from a
study file.
"""

from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from draftlab.perf.baselines import interval, nearest_baseline, prompt_key
from draftlab.errors import DraftlabError
from draftlab.measure import speedup
from draftlab.contenders.methods import is_baseline, method_of
from draftlab.study.answer.host import PromptPaces, add_host_speedups
from draftlab.study.answer.summary import ALL, CellSummary, engine_words, pace, plain_label
from draftlab.study.run.drift import Drift, baseline_drift
from draftlab.study.run.store import ResultsStore
from draftlab.perf.calibrate import Profile
from draftlab.perf.validate import compare

__all__ = ["ALL", "CellSummary", "Drift", "baseline_drift", "comparisons_of", "decode_paces", "engine_words",
           "load_checks", "load_study", "on_shared_prompts", "pace", "plain_label", "summarize", "write_csv"]


def summarize(rows: list[dict], checks: list[dict] = ()) -> list[CellSummary]:
    """One summary per (cell) and per (configuration, dataset='all').

    `checks`: re-timings of the baseline (`ResultsStore.baseline_checks`); each record is then compared with
    the baseline measured closest in time on its prompt, so that drift during the study cancels. Records made
    under load (concurrency above 1) are summarized apart (`draftlab.study.answer.serving`).
    """
    rows = [r for r in rows if (r.get("concurrency") or 1) == 1]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        config = (row["target"], row["method"], row["drafter"], row["k"], row["temperature"])
        groups[config + (row["dataset"],)].append(row)
        groups[config + (ALL,)].append(row)
    baseline_speed = nearest_baseline(rows, checks)
    peer_plain = {(r["method"], r["target"], r["dataset"], r["temperature"], r["prompt_id"]): r for r in rows
                  if method_of(r["method"]).peer_plain}
    paces = decode_paces(rows)
    per_prompt: dict[tuple, PromptPaces] = {}
    summaries = [_summarize_group(key, group, baseline_speed, paces, per_prompt)
                 for key, group in sorted(groups.items(), key=_sort_key)]
    for summary in summaries:
        _add_engine_speedup(summary, groups[(*summary.config_key, summary.dataset)], peer_plain)
    _mark_complete(summaries)
    add_host_speedups(summaries, per_prompt)
    return summaries


def on_shared_prompts(rows: list[dict]) -> list[dict]:
    """The records of the prompts that every cell of their (target, dataset, temperature) ran, alone: figures drawn
    from them compare every line on the same prompts (a cell the race dropped ran fewer)."""
    ran: dict[tuple, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for r in rows:
        if (r.get("concurrency") or 1) == 1:
            ran[(r["target"], r["dataset"], r["temperature"])][r["cell"]].add(r["prompt_id"])
    shared = {group: set.intersection(*cells.values()) for group, cells in ran.items()}
    return [r for r in rows if r["prompt_id"] in shared.get((r["target"], r["dataset"], r["temperature"]), ())]


def _mark_complete(summaries: list[CellSummary]) -> None:
    """A cell is complete when it ran as many prompts as the most of its group: only those are ranked, since a cell
    the race dropped (or that skipped prompts) was measured on other prompts than the rest."""
    most: dict[tuple, int] = defaultdict(int)
    for s in summaries:
        most[(s.target, s.dataset, s.temperature)] = max(most[(s.target, s.dataset, s.temperature)], s.prompts)
    for s in summaries:
        s.complete = s.prompts == most[(s.target, s.dataset, s.temperature)]


def _sort_key(item):
    (target, method, drafter, k, temperature, dataset), _ = item
    return (target, dataset, temperature, method_of(method).order, drafter, k)


def _summarize_group(key: tuple, rows: list[dict], baseline_speed: Callable[[dict], float | None],
                     decode_pace: dict[tuple, float], per_prompt: dict[tuple, PromptPaces]) -> CellSummary:
    """One summary; its per-prompt paces go into `per_prompt` under (config key, dataset)."""
    target, method, drafter, k, temperature, dataset = key
    new_tokens = sum(r["new_tokens"] for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    steps = sum(r["steps"] for r in rows)
    drafted = sum(r["drafted"] for r in rows)
    per_step = lambda name: 1000 * sum(r[name] for r in rows) / steps if steps else None  # noqa: E731
    summary = CellSummary(
        target, method, drafter, k, dataset, temperature, len(rows), new_tokens, wall, backend=rows[0].get("backend") or "",
        tokens_per_s=new_tokens / wall if wall else 0.0,
        ms_per_token=1000 * wall / new_tokens if new_tokens else 0.0,
        tokens_per_step=new_tokens / steps if steps else None,
        acceptance_rate=sum(r["accepted"] for r in rows) / drafted if drafted else None,
        draft_ms_per_step=per_step("draft_s"),
        target_ms_per_step=1000 * sum(r["target_s"] + r["prefill_s"] for r in rows) / steps if steps else None,
        overhead_ms_per_step=per_step("overhead_s"),
        per_position_acceptance=_per_position(rows),
    )
    per_prompt[key[:5] + (dataset,)] = _add_speedups(summary, rows, baseline_speed, decode_pace)
    if _timed_apart(rows) and all(r["wall_s"] > r["prefill_s"] for r in rows):
        summary.prefill_s = sum(r["prefill_s"] for r in rows) / len(rows)
        summary.decode_tokens_per_s = new_tokens / (wall - summary.prefill_s * len(rows))
    known = [r["identical"] for r in rows if r["identical"] is not None]
    summary.identical = sum(known) if known else None
    return summary


def _add_speedups(summary: CellSummary, rows: list[dict], baseline_speed: Callable[[dict], float | None],
                  decode_pace: dict[tuple, float]) -> PromptPaces:
    """The measurement loop's speedups (`draftlab.measure.speedup`): on decode against the baseline's pace on each
    prompt at the record's time, with its spread over prompts; decode only against the ar record's decoding.
    Returns the per-prompt decode tok/s and paired ratios."""
    matched = [(r, baseline_speed(r)) for r in rows]
    matched = [(r, base) for r, base in matched if base and _decode_s(r) > 0]
    if not matched:
        return {}
    per_prompt = [(r["new_tokens"] / _decode_s(r)) / base for r, base in matched]
    paces = {(r["dataset"], r["prompt_id"]): (r["new_tokens"] / _decode_s(r), ratio)
             for (r, _), ratio in zip(matched, per_prompt)}
    summary.speedup = speedup([(r["new_tokens"], _decode_s(r)) for r, _ in matched], [b for _, b in matched]) or 0.0
    summary.speedup_min, summary.speedup_max = min(per_prompt), max(per_prompt)
    summary.speedup_median = statistics.median(per_prompt)
    summary.speedup_low, summary.speedup_high = interval(summary.speedup, per_prompt)
    decoded = [(r, decode_pace.get(prompt_key(r))) for r in rows if _timed_apart([r])]
    if decoded and all(ar and r["wall_s"] > r["prefill_s"] for r, ar in decoded):
        summary.decode_speedup = speedup([(r["new_tokens"], r["wall_s"] - r["prefill_s"]) for r, _ in decoded],
                                         [ar for _, ar in decoded])
    return paces


def _timed_apart(rows: list[dict]) -> bool:
    """Whether the records' prefill is known: their method times it, or the loop timed their engine's apart (a
    peer library's records of 0.20 on)."""
    return all(method_of(r["method"]).times_prefill or (r.get("prefill_s") or 0) > 0 for r in rows)


def _decode_s(row: dict) -> float:
    """A record's decode seconds: its time after the prefill (its engine's, timed apart, or its own)."""
    return row["wall_s"] - (row["prefill_s"] or 0.0)


def decode_paces(rows: list[dict]) -> dict[tuple, float]:
    """Per prompt, the ar record's decode tokens/s (after its prefill)."""
    return {prompt_key(r): r["new_tokens"] / (r["wall_s"] - r["prefill_s"]) for r in rows
            if is_baseline(r["method"]) and r["wall_s"] > r["prefill_s"]}


def _add_engine_speedup(summary: CellSummary, rows: list[dict], peer_plain: dict[tuple, dict]) -> None:
    """A peer's method against its own library's plain decoding on the same prompts (AsG vs HF `generate`, lcp vs
    llama-cpp-python's `generate`); draftlab's cells against draftlab's."""
    plain_method = method_of(summary.method).engine_plain
    if plain_method is None:
        summary.engine_speedup = summary.speedup
        summary.engine_plain_tokens_per_s = summary.tokens_per_s / summary.speedup if summary.speedup else None
        return
    plain = [peer_plain.get((plain_method, r["target"], r["dataset"], r["temperature"], r["prompt_id"])) for r in rows]
    if not rows or any(p is None or p["wall_s"] <= 0 for p in plain):
        return  # studies made before the peer's plain decoding was measured
    plain_time = sum(p["wall_s"] for p in plain)
    summary.engine_plain_tokens_per_s = sum(p["new_tokens"] for p in plain) / plain_time
    summary.engine_speedup = summary.tokens_per_s / summary.engine_plain_tokens_per_s


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


def load_study(db: str | Path) -> tuple[list[dict], dict[str, int], list[dict]]:
    """Records, parameter counts and environments of a study database."""
    if not Path(db).exists():
        raise DraftlabError(f"study database not found: {db}")
    store = ResultsStore(db, read_only=True)
    try:
        rows, params, envs = store.rows(), store.params(), store.environments()
    finally:
        store.close()
    if not rows:
        raise DraftlabError(f"{db} holds no records yet; run `draftlab sweep --db {db}` first")
    return rows, params, envs


def load_checks(db: str | Path) -> list[dict]:
    """The baseline re-checks of a study database (empty for studies made before they existed)."""
    store = ResultsStore(db, read_only=True)
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


def comparisons_of(profile_path, rows: list[dict]) -> list:
    """The performance model's predictions (from a calibration profile) beside the measured records."""
    return compare(Profile.load(profile_path), rows)

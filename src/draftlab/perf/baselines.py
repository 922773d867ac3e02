"""Plain decoding's timings within a study: which baseline a record is compared with.

Both the study's report and the performance model's validation compare a
record with the plain decoding measured on its prompt closest in time (the
sweep re-times it between cells), so the lookup lives here, in the package the study reads (perf).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Callable

from draftlab.contenders.methods import is_baseline


def prompt_key(row: dict) -> tuple:
    return (row["target"], row["dataset"], row["temperature"], row["prompt_id"])


def baseline_timings(rows: list[dict], checks: list[dict]) -> dict[tuple, list[tuple[float | None, float]]]:
    """Per prompt, every (finished_at, decode tokens/s) of its baseline: the ar record and its re-checks, each
    after the prompt's prefill (the ar record's, which its re-checks decoded from; 0 in studies whose records
    timed no prefill apart)."""
    baselines = [r for r in rows if is_baseline(r["method"])]
    prefill = {prompt_key(r): r.get("prefill_s") or 0.0 for r in baselines}
    timings: dict[tuple, list[tuple[float | None, float]]] = defaultdict(list)
    for r in [*baselines, *checks]:
        decode_s = r["wall_s"] - prefill.get(prompt_key(r), 0.0)
        if decode_s > 0:
            timings[prompt_key(r)].append((r.get("finished_at"), r["new_tokens"] / decode_s))
    return timings


def nearest_baseline(rows: list[dict], checks: list[dict]) -> Callable[[dict], float | None]:
    """record -> the baseline's decode tokens/s on its prompt at the record's time: between its timings just before
    and just after the record, where it has both (a cell between two re-checks), the line through them; else the
    nearest one (the ar record if times are unknown)."""
    timings = baseline_timings(rows, checks)

    def speed(row: dict) -> float | None:
        known = timings.get(prompt_key(row))
        if not known:
            return None
        at = row.get("finished_at")
        timed = [(t, v) for t, v in known if t is not None]
        if at is None or not timed:
            return known[0][1]
        before = [tv for tv in timed if tv[0] <= at]
        after = [tv for tv in timed if tv[0] > at]
        if before and after and not is_baseline(row["method"]):  # between two re-timings: their pace at its time
            (t0, v0), (t1, v1) = max(before, key=lambda tv: tv[0]), min(after, key=lambda tv: tv[0])
            return v0 + (v1 - v0) * (at - t0) / (t1 - t0)
        return min(timed, key=lambda tv: abs(tv[0] - at))[1]

    return speed


T_975 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13)  # t(0.975, df)


def interval(point: float, ratios: list[float]) -> tuple[float, float]:
    """A 95% interval around a speedup from its per-prompt paired ratios: the point times exp(-/+ t * the
    standard error of the ratios' logs); the point itself with a single prompt (no spread known)."""
    if len(ratios) < 2 or point <= 0 or min(ratios) <= 0:
        return point, point
    logs = [math.log(r) for r in ratios]
    t = T_975[len(logs) - 2] if len(logs) - 2 < len(T_975) else 1.96 + 2.5 / len(logs)
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return point * math.exp(-half), point * math.exp(half)

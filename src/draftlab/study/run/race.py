"""The study's race: cells that cannot win on the whole prompt set stop being measured.

A study measures many cells that cannot win (a draft slower than plain decoding on another engine, the same draft
at a K too large). After `after` prompts of a dataset, and again before every later prompt, each cell's time over
the *whole* prompt set is projected from what it measured: its decode time per token, applied to the outputs the
prompts it has not run are expected to give (and, in studies whose cells each prefilled, its prefill as a function
of prompt length, a line fitted to its prompts: the race's first prompts are the set's longest and shortest,
`race_order`; since 0.20 each engine's prefill is timed apart and common to its cells, so the race ranks decode). A cell is dropped only when even its best projection (its best decode rate measured, or the mean less two
standard errors, whichever is faster) trails the leader's projection by more than the margin; the leader is the
lossless cell with the fastest projection among those still racing (llama-server's own speculation, exact only
up to rounding, can be dropped but never leads). The challenger, the lossless speculative cell with the fastest
projection, is never dropped either: the answer states the best speculation's speedup over the whole set, with its
paired interval, even when plain decoding leads. So a cell that loses the short prompts but wins on the long ones
(or the reverse) is judged on the set it will be ranked on, not on the prompts that happened to come first; a
dropped cell that the margin would now admit (the leader changed) comes back and catches up (`readmitted`).
Every prompt a dropped cell will not run is stored as skipped with the reason, so the report shows what was
dropped and why, and a resumed study makes the same decisions. The margin is the larger of a floor and the
machine's drift measured so far (the baseline re-checks). The baseline of each engine ('ar') is never dropped:
every output is compared with it, nor is a peer's plain decoding while one of its speculative cells still runs.
Cells under load (llama-server with more than one request in flight) neither race nor lead: their throughput is
another measure.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from draftlab.models import split_weight_type
from draftlab.study.run.cells import LLAMACPP_TARGET, Cell
from draftlab.contenders.methods import is_baseline, method_of, methods
from draftlab.study.run.store import ResultsStore
from draftlab.drafters.kinds import is_plain_drafter

RACE_REASON = "dropped by the race"  # how every skip the race stores begins


@dataclass(frozen=True)
class RaceRule:
    """When and how hard the study's race drops cells."""

    after: int = 0  # prompts every cell runs before any is dropped (0: never drop; the full grid runs)
    margin: float = 0.15  # a cell is dropped when the leader runs more than (1 + margin) times as fast

    @property
    def active(self) -> bool:
        """Whether this rule drops anything."""
        return self.after > 0


@dataclass(frozen=True)
class PromptSet:
    """The prompts a race ranks cells on: every prompt of the dataset, with its length in tokens per target."""

    lengths: dict[str, dict[str, int]]  # target name -> prompt id -> prompt tokens

    def of(self, target: str) -> dict[str, int]:
        """Prompt id -> length for one target (its tokenizer's count)."""
        return self.lengths.get(target) or next(iter(self.lengths.values()), {})


@dataclass(frozen=True)
class Projection:
    """A cell's time over the whole prompt set: measured where it ran, extrapolated from its rates elsewhere."""

    tokens: float  # new tokens over the prompt set (measured, and expected where not run)
    seconds: float  # its expected time
    best_seconds: float  # its time if every prompt left decoded at its best rate measured
    measured: int  # prompts it ran

    @property
    def speed(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def best_speed(self) -> float:
        return self.tokens / self.best_seconds if self.best_seconds > 0 else 0.0


def model_of(target: str) -> str:
    """The model a target name runs, whatever the engine and weight type ('llamacpp:smollm2-135m@Q4_0_PURE' ->
    'smollm2-135m'): cells of one model race each other, and its answer names the engine and file that won."""
    return split_weight_type(target.removeprefix(LLAMACPP_TARGET))[0]


def race_order(prompt_ids: list[str], lengths: dict[str, int], categories: dict[str, str]) -> list[str]:
    """The order a race runs prompts in: the longest and the shortest first (a prefill-heavy prompt must be in what
    the race first sees), then one of each category not yet seen, then the rest as given."""
    if len(prompt_ids) < 3:
        return list(prompt_ids)
    longest = max(prompt_ids, key=lambda p: lengths[p])
    shortest = min((p for p in prompt_ids if p != longest), key=lambda p: lengths[p])
    first, seen = [longest, shortest], {categories[longest], categories[shortest]}
    for p in prompt_ids:
        if p not in first and categories[p] not in seen:
            first.append(p)
            seen.add(categories[p])
    return first + [p for p in prompt_ids if p not in first]


def project(runs: dict[str, dict], lengths: dict[str, int], outputs: dict[str, float],
            engine_prefill: Callable[[int], float] = lambda length: 0.0, decode_only: bool = False) -> Projection:
    """A cell's projection over every prompt of `lengths` from its measured `runs` (prompt id -> record row).
    `outputs`: the new tokens expected of each prompt it has not run. `engine_prefill`: for a library that times no
    prefill apart, its engine's prefill seconds by prompt length (its measured prompts hold their own).
    `decode_only`: its decode time alone (what the answer ranks, when each engine's prefill was timed apart)."""
    timed = [(lengths[p], r["prefill_s"]) for p, r in runs.items() if (r.get("prefill_s") or 0) > 0]
    prefill = prefill_line(timed) if timed else engine_prefill
    decode = {p: r["wall_s"] - (r["prefill_s"] if timed else prefill(lengths[p])) for p, r in runs.items()}
    per_token = [decode[p] / r["new_tokens"] for p, r in runs.items() if r["new_tokens"]]
    mean = statistics.fmean(per_token) if per_token else 0.0
    spread = statistics.stdev(per_token) / len(per_token) ** 0.5 if len(per_token) > 1 else mean
    best = max(min(min(per_token, default=0.0), mean - 2 * spread), 0.0)
    left = [p for p in lengths if p not in runs]
    tokens_left = sum(outputs[p] for p in left)
    if decode_only:
        measured_s, prefill_left = sum(decode.values()), 0.0
    else:
        measured_s, prefill_left = sum(r["wall_s"] for r in runs.values()), sum(prefill(lengths[p]) for p in left)
    return Projection(sum(r["new_tokens"] for r in runs.values()) + tokens_left,
                      measured_s + prefill_left + mean * tokens_left, measured_s + prefill_left + best * tokens_left,
                      len(runs))


def prefill_line(points: list[tuple[int, float]]) -> Callable[[int], float]:
    """Prefill seconds by prompt length: the least-squares line through (length, seconds), slope and intercept
    clipped at zero (a flat line through the mean when every length is the same)."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = max(sum((x - mx) * (y - my) for x, y in points) / sxx, 0.0) if sxx else 0.0
    intercept = max(my - slope * mx, 0.0)
    return lambda length: intercept + slope * length


def expected_outputs(rows: list[dict], prompt_ids: list[str]) -> dict[str, float]:
    """New tokens expected of each prompt: the median over the cells that ran it (lossless cells give the same
    output), else the mean over every prompt run so far."""
    by_prompt: dict[str, list[int]] = defaultdict(list)
    for r in rows:
        by_prompt[r["prompt_id"]].append(r["new_tokens"])
    measured = [statistics.median(v) for v in by_prompt.values()]
    mean = statistics.fmean(measured) if measured else 0.0
    return {p: statistics.median(by_prompt[p]) if p in by_prompt else mean for p in prompt_ids}


def dropped_cells(cells: list[Cell], rows: list[dict], rule: RaceRule, prompts: PromptSet, drift: float = 0.0
                  ) -> dict[str, str]:
    """cell key -> one-line reason, for the cells of `cells` (one model, dataset and temperature) that cannot beat
    the leader on the whole prompt set by more than the margin, once every cell ran at least `rule.after`
    prompts. `rows`: the stored records of those cells; `drift`: the baseline's relative spread measured so far.
    A cell dropped before and absent from the answer comes back (`readmitted`)."""
    if not rule.active:
        return {}
    keys = {c.key: c for c in cells if c.concurrency == 1}
    runs: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        if r["cell"] in keys and r["wall_s"] > 0:
            runs[r["cell"]][r["prompt_id"]] = r
    runs = {key: its for key, its in runs.items() if len(its) >= max(rule.after, 2)}
    outputs = expected_outputs([r for its in runs.values() for r in its.values()],
                               sorted({p for key in runs for p in prompts.of(keys[key].target)}))
    engines = _engine_prefills(keys, runs, prompts)
    apart = all(r.get("prefill_s") for its in runs.values() for r in its.values())  # each engine's prefill, timed
    projected = {key: project(its, prompts.of(keys[key].target), outputs, engines.get(keys[key].target, _no_prefill),
                              apart) for key, its in runs.items()}
    most = max((p.measured for p in projected.values()), default=0)  # cells still racing; dropped ones ran fewer
    lossy = {r["cell"] for r in rows if r["identical"] == 0}
    lossless = {key for key, p in projected.items() if p.measured == most and method_of(keys[key].method).exact
                and key not in lossy}
    if not lossless:
        return {}
    leader = max(lossless, key=lambda key: projected[key].speed)
    challenger = _challenger(projected, keys, lossy)
    margin = max(rule.margin, drift)
    total = len(prompts.of(keys[leader].target))
    out = {}
    for key, p in projected.items():
        if key in (leader, challenger) or is_baseline(keys[key].method):
            continue
        ratio = p.best_speed / projected[leader].speed
        if ratio * (1 + margin) < 1:
            out[key] = (f"{RACE_REASON} after {p.measured} prompts: at best {ratio:.2f}x the projected speed of "
                        f"the leader ({_describe(keys[leader])}) over the {total} prompts, beyond the margin of "
                        f"{margin:.0%}")
    return keep_peer_references(out, cells)


def _challenger(projected: dict, keys: dict[str, Cell], lossy: set[str]) -> str | None:
    """The lossless speculative cell with the fastest projection (`lossy`: cells whose output differed): it runs
    every prompt whatever the margin, so the answer states the best speculation's speedup over the whole set with
    its paired interval (a cell dropped before comes back and catches up)."""
    candidates = [key for key in projected if key not in lossy and not method_of(keys[key].method).plain
                  and method_of(keys[key].method).exact]
    return max(candidates, key=lambda key: projected[key].speed, default=None)


def keep_peer_references(dropped: dict[str, str], cells: list[Cell]) -> dict[str, str]:
    """A peer's plain decoding stays while one of its speculative cells runs: their outputs are compared."""
    running = {(c.target, c.method) for c in cells if c.key not in dropped}
    return {key: reason for key, reason in dropped.items()
            if not any((cell.target, method.name) in running
                       for cell in cells if cell.key == key
                       for method in methods().values() if not method.plain and method.engine_plain == cell.method)}


def deploy_references(cells: list[Cell], rates: dict[str, float]) -> set[str]:
    """The cells a Deploy line answers from, which neither the pilot nor the plan leaves out before they ran (the
    race may drop them later: the answer uses what they measured, `answer.serving.level_answers`): per target,
    each served engine's plain decoding and its speculation fastest by the pilot's `rates` (cell key -> tok/s), one
    request at a time."""
    keep: set[str] = set()
    fastest: dict[tuple[str, str], Cell] = {}
    for cell in (c for c in cells if c.concurrency == 1 and method_of(c.method).served):
        method = method_of(cell.method)
        if method.plain:
            keep.add(cell.key)
            continue
        engine = (cell.target, method.reference)
        if cell.key in rates and rates[cell.key] > rates.get(fastest[engine].key if engine in fastest else "", 0.0):
            fastest[engine] = cell
    return keep | {cell.key for cell in fastest.values()}


def _no_prefill(length: int) -> float:
    return 0.0


def _engine_prefills(keys: dict[str, Cell], runs: dict[str, dict[str, dict]], prompts: PromptSet
                     ) -> dict[str, Callable[[int], float]]:
    """target -> its plain decoding's prefill line (the 'ar' cell, which times its prefill): the prefill of the
    peers on that target that time none apart (HF's `generate`, llama-cpp-python's) is taken to grow alike."""
    lines = {}
    for key, its in runs.items():
        cell, lengths = keys[key], prompts.of(keys[key].target)
        timed = [(lengths[p], r["prefill_s"]) for p, r in its.items() if (r.get("prefill_s") or 0) > 0]
        if is_baseline(cell.method) and timed:
            lines[cell.target] = prefill_line(timed)
    return lines


def readmitted(dropped_before: set[str], dropped_now: dict[str, str]) -> set[str]:
    """The cells the race dropped earlier that it would not drop now: they race again."""
    return dropped_before - set(dropped_now)


def _describe(cell: Cell) -> str:
    what = "plain decoding" if is_plain_drafter(cell.drafter) else cell.drafter
    k = f" K={cell.k}" if cell.k else ""
    return f"{cell.target} {cell.method} {what}{k}"

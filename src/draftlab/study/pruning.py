"""The study's race: once every cell has run the first prompts, cells that trail the best stop being measured.

A study measures many cells that cannot win (a draft slower than plain decoding on another engine, the same draft
at a K too large). After `after` prompts of a dataset, each cell is compared with the fastest cell of the same
model (any engine, lossless or plain) on the prompts both ran: one that runs slower than the leader by more than
the margin is dropped for the rest of the dataset (the leader is lossless: llama-server's own speculation, exact
only up to rounding, can be dropped but never leads), and every prompt it will not run is stored as skipped with the
reason, so the report shows what was dropped and why, and a resumed study makes the same decisions. The margin
is the larger of a floor and the machine's drift measured so far (the baseline re-checks), so a noisy machine
keeps more cells racing. The baseline of each engine ('ar') is never dropped: every output is compared with it,
nor is a peer's plain decoding while one of its speculative cells still runs. Cells under load (llama-server with
more than one request in flight) neither race nor lead: their throughput is another measure.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from draftlab.study.cells import LLAMACPP_TARGET, PEER_PLAIN, UP_TO_ROUNDING, Cell
from draftlab.study.store import ResultsStore


@dataclass(frozen=True)
class RaceRule:
    """When and how hard the study's race drops cells."""

    after: int = 0  # prompts every cell runs before any is dropped (0: never drop; the full grid runs)
    margin: float = 0.15  # a cell is dropped when the leader runs more than (1 + margin) times as fast

    @property
    def active(self) -> bool:
        """Whether this rule drops anything."""
        return self.after > 0


def model_of(target: str) -> str:
    """The model a target name runs, whatever the engine: cells of one model race each other."""
    return target.removeprefix(LLAMACPP_TARGET)


def pooled_speeds(rows: list[dict]) -> dict[str, dict[str, tuple[int, float]]]:
    """cell key -> prompt id -> (new tokens, wall seconds) of every measured (cell, prompt)."""
    speeds: dict[str, dict[str, tuple[int, float]]] = defaultdict(dict)
    for r in rows:
        if r["wall_s"] > 0:
            speeds[r["cell"]][r["prompt_id"]] = (r["new_tokens"], r["wall_s"])
    return speeds


def _speed_on(runs: dict[str, tuple[int, float]], prompts: set[str]) -> float:
    tokens = sum(runs[p][0] for p in prompts)
    wall = sum(runs[p][1] for p in prompts)
    return tokens / wall if wall else 0.0


def dropped_cells(cells: list[Cell], rows: list[dict], rule: RaceRule, drift: float = 0.0) -> dict[str, str]:
    """cell key -> one-line reason, for the cells of `cells` (one model, dataset and temperature) that trail the
    leader by more than the margin after at least `rule.after` prompts. `rows`: the stored records of those cells;
    `drift`: the baseline's relative spread measured so far."""
    if not rule.active:
        return {}
    keys = {c.key: c for c in cells if c.concurrency == 1}
    speeds = {key: runs for key, runs in pooled_speeds([r for r in rows if r["cell"] in keys]).items()
              if len(runs) >= rule.after}
    most = max((len(runs) for runs in speeds.values()), default=0)  # cells still racing; dropped ones ran fewer
    lossless = ({key for key, runs in speeds.items() if len(runs) == most and keys[key].method not in UP_TO_ROUNDING}
                - {r["cell"] for r in rows if r["identical"] == 0})
    if not lossless:
        return {}
    leader = max(lossless, key=lambda key: _speed_on(speeds[key], set(speeds[key])))
    margin = max(rule.margin, drift)
    out = {}
    for key, runs in speeds.items():
        shared = set(runs) & set(speeds[leader])
        if key == leader or keys[key].method == "ar" or len(shared) < rule.after:
            continue
        ratio = _speed_on(runs, shared) / _speed_on(speeds[leader], shared)
        if ratio * (1 + margin) < 1:
            out[key] = (f"dropped by the race after {len(shared)} prompts: {ratio:.2f}x the speed of the leader "
                        f"({_describe(keys[leader])}), beyond the margin of {margin:.0%}")
    return _keep_peer_references(out, cells)


def _keep_peer_references(dropped: dict[str, str], cells: list[Cell]) -> dict[str, str]:
    """A peer's plain decoding stays while one of its speculative cells runs: their outputs are compared."""
    running = {(c.target, c.method) for c in cells if c.key not in dropped}
    return {key: reason for key, reason in dropped.items()
            if not any((cell.target, method) in running
                       for cell in cells if cell.key == key
                       for method, plain in PEER_PLAIN.items() if plain == cell.method)}


def _describe(cell: Cell) -> str:
    what = "plain decoding" if cell.drafter == "none" else cell.drafter
    k = f" K={cell.k}" if cell.k else ""
    return f"{cell.target} {cell.method} {what}{k}"


def load_skips(db) -> list[dict]:
    """The skipped (cell, prompt) pairs of a study database, with their reasons."""
    store = ResultsStore(db, read_only=True)
    try:
        return store.skips()
    finally:
        store.close()


def skipped_cells(skips: list[dict]) -> list[tuple[str, int, str]]:
    """(cell, prompts skipped, first reason) per cell, in the order they were first skipped."""
    by_cell: dict[str, list[dict]] = {}
    for skip in skips:
        by_cell.setdefault(skip["cell"], []).append(skip)
    return [(_cell_words(key), len(items), items[0]["reason"]) for key, items in by_cell.items()]


def format_skips(skips: list[dict]) -> str:
    """The skipped cells as text: one line each (none: an empty string)."""
    cells = skipped_cells(skips)
    if not cells:
        return ""
    lines = [f"Cells not measured on every prompt ({len(cells)}; not ranked):"]
    return "\n".join(lines + [f"  {cell}: {count} prompt(s) skipped, {reason}" for cell, count, reason in cells])


def _cell_words(key: str) -> str:
    """'target|method|drafter|k=K|dataset|...' -> 'target METHOD drafter K=K (dataset)'."""
    target, method, drafter, k, dataset, *_ = key.split("|")
    return f"{target} {method.upper()} {drafter} {k.upper()} ({dataset})"

"""K for every run of a step, chosen at the step: the runs' own policies (`draftlab generate`), a table by the number
of runs in flight (`--k-per-load`), or the seeds' model used online (`--k auto`).

A step first has every run draft to its cap (`caps`: the run's own K, the load's, or `--k auto`'s deepest), then
keeps the first K levels of each draft (`choose`, given each draft's depth). The policies keep every draft whole;
`AutoK` keeps the Ks that maximise the tokens the step is expected to commit per second of its target pass. Drafting
first costs nothing worth weighing for n-gram and suffix lookups and tells the choice which runs have a draft at
all (suffix decoding proposes nothing where its trees hold no match); a draft model costs a decode per depth, so
with its cost curve (`AutoK.draft`) the Ks are chosen before it drafts (`caps`), each depth weighed with the draft's
pass of a row per run drafting that deep. Each run's expected
tokens for a draft kept to depth k are 1 + p(1) + ... + p(k), where p(d) is that run's probability that the first d
levels of a draft of d or more are all accepted (its `AcceptanceRecord`, drawn towards the record of every run), and
the step's seconds are the target's block-cost curve (`BlockCost`, calibrated on this host at startup) summed over
the passes the backend splits the step's blocks into (`passes`: llama.cpp's KV streams decode blocks of unequal
length in separate passes over the weights, `LlamaCppSequences.passes`). K = 0 is plain decoding for that run this step.

The search first covers every step in which the drafting runs draft to one depth K (each run at most its room) and
the others draft nothing: for each K it takes the m runs that gain most from drafting, for every m (exact over those
steps when every run has room for K). It then moves one run's K at a time while the rate grows: on llama.cpp each
further depth costs another pass over the weights, about a row's weight reads, so one depth is the optimum in most
steps (tests/test_kchoice.py compares the search with a brute force over every K per run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from draftlab.errors import DraftlabError

PRIOR_WEIGHT = 2.0  # a run's record starts as this many steps of the record of every run
DRAFT_WORTH_WEIGHING = 0.05  # a drafted row's share of a target row above which its cost is weighed (`AutoK.timed`)
DRAFT_TIMING_WEIGHT = 0.3  # the newest step's weight in a drafter's measured seconds per row


@dataclass
class AcceptanceRecord:
    """Per draft position d (1-based): steps whose draft reached depth d, and steps whose first d were accepted."""

    asked: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def observe(self, asked: int, accepted: int) -> None:
        """A step whose draft was `asked` levels deep and whose first `accepted` levels were accepted."""
        while len(self.asked) < asked:
            self.asked.append(0)
            self.accepted.append(0)
        for d in range(asked):
            self.asked[d] += 1
            self.accepted[d] += d < accepted

    def survival(self, depth: int, prior: "AcceptanceRecord | None" = None, weight: float = PRIOR_WEIGHT
                 ) -> list[float]:
        """p(1..depth): the chance that the first d drafts are all accepted, non-increasing in d; drawn towards the
        prior's (an optimistic 1 where neither has seen position d: unseen depths are worth one try)."""
        out, last = [], 1.0
        for d in range(depth):
            base = prior.survival(d + 1, None)[d] if prior is not None else 1.0
            asked = self.asked[d] if d < len(self.asked) else 0
            accepted = self.accepted[d] if d < len(self.accepted) else 0
            value = (accepted + weight * base) / (asked + weight) if asked + weight > 0 else last
            last = min(last, value)
            out.append(last)
        return out


@dataclass(frozen=True)
class StepRun:
    """What the choice needs of one run of the step."""

    seq: int  # its sequence in the target's batch
    wanted: int  # K its own policy asks for
    room: int  # the deepest draft it can still use
    record: AcceptanceRecord
    lag: int = 0  # tokens its drafter must take in before it drafts (a draft model's stream behind the context)


class StepK(Protocol):
    """Sets every run's K at a step: the depth each drafts to, then the depth of each draft kept (0: plain decoding
    for that run this step)."""

    def caps(self, runs: Sequence[StepRun]) -> list[int]:
        """The depth each run drafts to, in the runs' order."""
        ...

    def choose(self, runs: Sequence[StepRun], drafted: Sequence[int]) -> list[int]:
        """The depth of each run's draft kept (at most `drafted`, each draft's depth)."""
        ...

    def observe(self, asked: int, accepted: int) -> None:
        """One run's outcome: its draft's depth as scored, the levels accepted."""
        ...

    def timed(self, seconds: float, depths: Sequence[int]) -> None:
        """The step's drafting took `seconds` for drafts of these depths (one per run)."""
        ...


class KeepAll:
    """The policies' part of `StepK`: every draft kept whole, nothing learnt at the step."""

    def choose(self, runs: Sequence[StepRun], drafted: Sequence[int]) -> list[int]:
        return list(drafted)

    def observe(self, asked: int, accepted: int) -> None:
        """The policies learn nothing at the step (a run's own policy hears its own outcome)."""

    def timed(self, seconds: float, depths: Sequence[int]) -> None:
        """Nothing weighs the drafting's cost."""


class PerRunK(KeepAll):
    """Each run's own policy (`draftlab generate`: FixedK, DynamicK, ...)."""

    def caps(self, runs: Sequence[StepRun]) -> list[int]:
        return [run.wanted for run in runs]


AUTO = -1  # a `--k-per-load` row's K where `--k auto` chooses (`1:3,2-64:auto`)


@dataclass(frozen=True)
class LoadK(KeepAll):
    """K by the number of runs in flight: rows [lo, hi, K] as `deploy.per_batch_size` writes them (vLLM's
    `num_speculative_tokens_per_batch_size`); above the last row, its K. A row's K may be `AUTO`: at those loads
    `--k auto` chooses (`LoadThenAuto`)."""

    rows: tuple[tuple[int, int, int], ...]

    @classmethod
    def fixed(cls, k: int) -> "LoadK":
        return cls(((1, 1 << 30, k),))

    @classmethod
    def parse(cls, text: str) -> "LoadK":
        """'1-2:6,3-4:3,5-8:0' (or '1:3,2-64:auto') -> rows; one line for anything else."""
        rows = []
        try:
            for item in text.split(","):
                span, k = item.split(":")
                lo, _, hi = span.partition("-")
                rows.append((int(lo), int(hi or lo), AUTO if k.strip() == "auto" else _count(k)))
        except ValueError:
            raise DraftlabError(f"--k-per-load takes rows like 1-2:6,3-4:3,5-8:0 or 1:3,2-64:auto, not {text!r}") \
                from None
        if any(lo < 1 or hi < lo for lo, hi, k in rows) or rows[0][0] != 1 or any(
                b[0] != a[1] + 1 for a, b in zip(rows, rows[1:])):
            raise DraftlabError(f"--k-per-load rows must run on from 1 without gaps, each K >= 0 or auto: {text!r}")
        return cls(tuple(rows))

    @property
    def has_auto(self) -> bool:
        """Whether `--k auto` chooses at some load."""
        return any(k == AUTO for _, _, k in self.rows)

    def at(self, in_flight: int) -> int:
        """K with that many runs in flight (`AUTO` where `--k auto` chooses)."""
        return next((k for lo, hi, k in self.rows if lo <= in_flight <= hi), self.rows[-1][2])

    def text(self) -> str:
        """The flag's value."""
        return ",".join(f"{lo}-{hi}:{_k_text(k)}" if hi > lo else f"{lo}:{_k_text(k)}" for lo, hi, k in self.rows)

    def caps(self, runs: Sequence[StepRun]) -> list[int]:
        return [self.at(len(runs))] * len(runs)


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def _k_text(k: int) -> str:
    return "auto" if k == AUTO else str(k)


def rows_by_level(ks: dict[int, int]) -> str:
    """`--k-per-load` rows from a K per level measured (`AUTO` for `--k auto`): each level's K up to the next
    level, the last's to 64 and beyond; one K at every load as `1:K`, `auto` where every level's is `AUTO`."""
    if set(ks.values()) == {AUTO}:
        return "auto"
    rows: list[list[int]] = []
    low, levels = 1, sorted(ks)
    for i, level in enumerate(levels):
        high = level if i + 1 < len(levels) else max(level, 64)
        if rows and rows[-1][2] == ks[level]:
            rows[-1][1] = high
        else:
            rows.append([low, high, ks[level]])
        low = high + 1
    if len(rows) == 1:
        return f"1:{_k_text(rows[0][2])}"
    return LoadK(tuple((lo, hi, k) for lo, hi, k in rows)).text()


@dataclass
class LoadThenAuto:
    """`--k-per-load` rows some of whose K are `auto`: at those loads `auto` chooses every run's K, at the others
    the row's K; `auto` learns from every step."""

    load: LoadK
    auto: "AutoK"

    def caps(self, runs: Sequence[StepRun]) -> list[int]:
        k = self.load.at(len(runs))
        return self.auto.caps(runs) if k == AUTO else [k] * len(runs)

    def choose(self, runs: Sequence[StepRun], drafted: Sequence[int]) -> list[int]:
        return self.auto.choose(runs, drafted) if self.load.at(len(runs)) == AUTO else list(drafted)

    def observe(self, asked: int, accepted: int) -> None:
        self.auto.observe(asked, accepted)

    def timed(self, seconds: float, depths: Sequence[int]) -> None:
        self.auto.timed(seconds, depths)


@dataclass(frozen=True)
class BlockCost:
    """Seconds of one target pass of `rows` rows: measured points, linear between them and beyond the last two."""

    points: tuple[tuple[int, float], ...]  # (rows, seconds), rows increasing from 1

    def __post_init__(self) -> None:
        if len(self.points) < 2 or self.points[0][0] != 1 or any(
                b[0] <= a[0] for a, b in zip(self.points, self.points[1:])):
            raise DraftlabError(f"a block-cost curve needs rows increasing from 1 at two points or more: {self.points}")

    def seconds(self, rows: int) -> float:
        """One pass of `rows` rows."""
        pts = self.points
        for (r0, s0), (r1, s1) in zip(pts, pts[1:]):
            if rows <= r1 or (r1, s1) == pts[-1]:
                return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
        return pts[-1][1]

    def relative(self) -> dict[int, float]:
        """Each point's seconds over one row's (for people and /metrics)."""
        return {rows: round(s / self.points[0][1], 3) for rows, s in self.points}


Passes = Callable[[dict[int, int]], list[int]]  # {seq: block length} -> rows of each pass the backend runs


def one_pass(lengths: dict[int, int]) -> list[int]:
    """Every block in one pass (a single sequence, or a backend that mixes lengths)."""
    return [sum(lengths.values())]


@dataclass
class AutoK:
    """`--k auto`: every run's K chosen at each step by expected tokens per second (see the module's text). With a
    draft model's cost curve (`draft`), drafting is no longer free: the Ks are chosen before drafting, each depth
    of the step weighed with the draft decode it costs (one pass of a row per run drafting that deep)."""

    cost: BlockCost
    passes: Passes
    k_max: int = 8
    overall: AcceptanceRecord = field(default_factory=AcceptanceRecord)
    draft: BlockCost | None = None  # a draft model's seconds per pass (calibrated at startup, or as `timed` measures)
    draft_passes: Passes = one_pass  # how its streams split a decode of a row per run
    calibrated: bool = False  # `draft` was timed at startup: the steps' own timings leave it be
    draft_row_s: float = 0.0  # a drafted row's seconds as the steps measure them (a drafter without a curve)

    def caps(self, runs: Sequence[StepRun]) -> list[int]:
        room = [max(0, min(self.k_max, run.room)) for run in runs]
        return room if self.draft is None else self._best(runs, room)

    def choose(self, runs: Sequence[StepRun], drafted: Sequence[int]) -> list[int]:
        return list(drafted) if self.draft is not None else self._best(runs, list(drafted))

    def observe(self, asked: int, accepted: int) -> None:
        self.overall.observe(asked, accepted)

    def timed(self, seconds: float, depths: Sequence[int]) -> None:
        """A drafter without a calibrated curve (an EAGLE-3 layer, a lookup) as the steps time it: seconds per
        drafted row, averaged over steps. Once a row costs a share of a target row worth weighing
        (`DRAFT_WORTH_WEIGHING`), drafting is no longer free: the Ks are chosen before drafting, each row at that price
        (linear in rows: a drafter that batches its runs is priced high, towards plain decoding). Lookups stay
        below it and keep drafting first (which runs have a draft at all then decides)."""
        rows = sum(depths)
        if self.calibrated or not rows:
            return
        now = seconds / rows
        self.draft_row_s = now if not self.draft_row_s else (1 - DRAFT_TIMING_WEIGHT) * self.draft_row_s + (
            DRAFT_TIMING_WEIGHT * now)
        worth = self.draft_row_s >= DRAFT_WORTH_WEIGHING * self.cost.seconds(1)
        self.draft = BlockCost(((1, self.draft_row_s), (2, 2 * self.draft_row_s))) if worth else None

    def step_seconds(self, lengths: dict[int, int], fed: dict[int, int] | None = None) -> float:
        """The step's seconds for blocks of these lengths by sequence: the target's passes, and a draft model's
        decode per depth, the first feeding each drafting run's stream what it lacks (`fed`: its lag, at most a step's
        own; 1 where not given)."""
        seconds = sum(self.cost.seconds(rows) for rows in self.passes(lengths))
        if self.draft is None:
            return seconds
        for depth in range(1, max(lengths.values(), default=1)):
            drafting = {seq: (fed or {}).get(seq, 1) if depth == 1 else 1 for seq, n in lengths.items() if n > depth}
            seconds += sum(self.draft.seconds(rows) for rows in self.draft_passes(drafting))
        return seconds

    def _best(self, runs: Sequence[StepRun], caps: list[int]) -> list[int]:
        survival = [run.record.survival(self.k_max, self.overall) for run in runs]
        fed = {run.seq: max(1, min(run.lag, self.k_max + 1)) for run in runs}  # beyond: `_catch_up`

        def seconds(lengths: dict[int, int]) -> float:
            return self.step_seconds(lengths, fed)
        return best_ks(survival, caps, [run.seq for run in runs], seconds, [self._catch_up(run) for run in runs])

    def _catch_up(self, run: StepRun) -> float:
        """A draft model's catch-up beyond a step's own (a new prompt, or steps without drafting), as a share of each
        token the run commits: its seconds spread over the tokens the run still has room for."""
        if self.draft is None or run.lag <= self.k_max + 1:
            return 0.0
        return self.draft.seconds(run.lag) / max(run.room + 1, 1)


def expected_tokens(survival: Sequence[float], k: int) -> float:
    """Tokens a step commits for a draft of depth k: the target's own, and each accepted draft."""
    return 1.0 + sum(survival[:k])


def best_ks(survival: Sequence[Sequence[float]], caps: Sequence[int], seqs: Sequence[int],
            seconds: Callable[[dict[int, int]], float], catch_up: Sequence[float] = ()) -> list[int]:
    """The Ks that maximise expected tokens per second: the best step with one depth K for the drafting runs (each
    capped, 0 for the rest), then each run's K moved alone while that pays; among equals, the fewest rows.
    `catch_up`: seconds per committed token a run's drafting costs on top of the step (a draft model's stream
    catching up), charged where its K > 0."""
    n = len(caps)
    catch_up = list(catch_up) or [0.0] * n

    def rate(ks: list[int]) -> float:
        tokens = [expected_tokens(p, k) for p, k in zip(survival, ks)]
        extra = sum(c * t for c, t, k in zip(catch_up, tokens, ks) if k)
        return sum(tokens) / (seconds({s: 1 + k for s, k in zip(seqs, ks)}) + extra)

    best, best_rate = [0] * n, rate([0] * n)
    for k in range(1, max(caps, default=0) + 1):
        depth = [min(k, cap) for cap in caps]
        ks = [0] * n
        for i in sorted(range(n), key=lambda i: -expected_tokens(survival[i], depth[i])):
            if depth[i]:
                ks[i] = depth[i]
                if _better(rate(ks), ks, best_rate, best):
                    best, best_rate = list(ks), rate(ks)
    return _improve(best, best_rate, caps, rate)


def _better(value: float, ks: list[int], best_value: float, best: list[int]) -> bool:
    return value > best_value + 1e-12 or (abs(value - best_value) <= 1e-12 and sum(ks) < sum(best))


def _improve(ks: list[int], value: float, caps: Sequence[int], rate: Callable[[list[int]], float]) -> list[int]:
    """Move one run's K at a time to its best while the step's rate grows (a few sweeps at most)."""
    for _ in range(3):
        moved = False
        for i, cap in enumerate(caps):
            for k in range(cap + 1):
                trial = ks[:i] + [k] + ks[i + 1:]
                if k != ks[i] and _better(rate(trial), trial, value, ks):
                    ks, value, moved = trial, rate(trial), True
        if not moved:
            break
    return ks


def llama_passes(lengths: dict[int, int], n_ubatch: int = 512) -> list[int]:
    """Rows of each pass llama.cpp runs for blocks in KV streams of their own (`llama_batch_allocr::split_equal`,
    sequential): a pass takes the run of consecutive sequence ids from the lowest with tokens left, the same number of
    tokens from each (the fewest any has left)."""
    left = dict(sorted((s, n) for s, n in lengths.items() if n > 0))
    out = []
    while left:
        seqs = list(left)
        group = [seqs[0]]
        for s in seqs[1:]:
            if s != group[-1] + 1 or len(group) >= n_ubatch:
                break
            group.append(s)
        take = max(1, min(min(left[s] for s in group), n_ubatch // len(group)))
        out.append(take * len(group))
        for s in group:
            left[s] -= take
            if left[s] == 0:
                del left[s]
    return out

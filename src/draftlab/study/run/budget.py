"""A study within a time budget: time the host first (the pilot), plan the prompts to fit, keep to the plan.

The pilot runs through the measurement loop on one prompt of the group (its median length): each engine prefills it
once (timed: seconds per prompt token) and each cell decodes `PILOT_TOKENS` from that prefill (timed: seconds per
new token; a draft model's own prefill of the prompt, which runs in a cell's first step, spread over the cell's
output length, not over the pilot's tokens); where the group's longest prompt is much longer, each target's baseline
is timed on it too (`study/run/growth.py`: how a token's costs grow with the context). From these the plan
estimates what each prompt costs, at that prompt's length: its prefill on every engine, every cell's decode of the
study's output length and the baseline's re-checks, every cell on the race's first prompts and, after them, the
cells the race is expected to keep (those within `RACE_KEEPS` of the fastest pilot of their model). It takes the
most prompts of the group that fit the time the budget has left, and says so in one line. With a race it keeps at
least `PROMPT_SHARE` of them: where those do not fit, it leaves out cells instead of prompts (the most hopeless by
their pilot first, stored as skipped with the reason), so that every cell ranked ran as many prompts as the rest.
A cell whose pilot decodes more than `PILOT_MARGIN` times slower than the fastest lossless cell of its
model is dropped before the first prompt (stored as skipped, with its pilot's rate): so wide a gap is not closed by
a prompt's acceptance. While the study runs, a prompt is not started when the time it is expected to take (the
mean of the prompts so far) would end past the budget: every cell still running has then run the same prompts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from draftlab.backends.routes import cpu_flags
from draftlab.contenders.methods import is_baseline, method_of
from draftlab.measure import EncodedPrompt, RunRecord, RunSettings, pilot as measure_pilot
from draftlab.study.run.cells import Cell
from draftlab.study.run.growth import SPAN, Growth
from draftlab.study.run.race import deploy_references, keep_peer_references, model_of
from draftlab.study.run.runner import CellRunner
from draftlab.contenders.server_configs import in_groups

PILOT_TOKENS = 16  # each cell's decode in the pilot
PILOT_MARGIN = 3.0  # a cell whose pilot decodes this many times slower than its model's fastest is dropped
RACE_KEEPS = 1.5  # the plan expects the race to keep the cells whose pilot is within this factor of the fastest
PILOT_REASON = "dropped by the pilot"  # how every skip of a pilot's drop begins
PLAN_REASON = "dropped by the plan"  # how every skip of a cell the budget could not hold begins
PROMPT_SHARE = 0.75  # with a race, a plan keeps at least this share of a group's prompts (6 of 8), dropping cells first
HOST_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")


@dataclass
class Pilot:
    """One target's pilot: seconds per prompt token of each engine's prefill, per new token of each cell's decode
    (by cell key; times its concurrency for a cell under load), each cell's prefill key, and per prompt token the
    prefill of each cell that shares none (a `draftlab serve` request prefills its own prompt, timed apart)."""

    prefill: dict[str, float] = field(default_factory=dict)
    decode: dict[str, float] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    own_prefill: dict[str, float] = field(default_factory=dict)  # cell key -> seconds per prompt token
    servers: set[str] = field(default_factory=set)  # cells that brought a server of their own into the pilot
    start_s: dict[str, float] = field(default_factory=dict)  # cell key -> seconds its server took to start (where the
    # pilot started it: one running since the warm-up was not timed)
    room: int = 0  # the most servers that ran at once, where some were stopped to start others (0: all fit)
    growth: Growth = Growth()  # how its per-token costs grow with the context (`time_longest`; none: not timed)


@dataclass(frozen=True)
class Plan:
    """How much of a group the budget affords: its first `prompts` prompts in the race's order."""

    prompts: int
    of: int  # the group's prompts
    cells: int  # cells that run its first prompt (after the pilot's and the plan's drops)
    dropped: int  # cells the pilot dropped
    tokens: int
    race_after: int
    estimate_s: float  # measuring those prompts, as planned
    budget_s: float  # the budget's seconds left when planned (0: no budget)
    costs: tuple[float, ...] = ()  # each planned prompt's estimate, in the order they run
    budget_drops: dict[str, str] = field(default_factory=dict)  # cell key -> reason: cells the budget could not hold
    prefills: int = 0  # prefills of each prompt: one per prefill key (kernel set and file), which its cells share
    own_prefills: int = 0  # cells that prefill each prompt themselves (`draftlab serve`'s requests), in the estimate
    restart_s: float = 0.0  # a prompt's server starts, where more servers run than fit at once, in the estimate
    growth: tuple[tuple[str, str], ...] = ()  # (target, what its baseline's growth with the context was timed at)

    def line(self) -> str:
        """The plan in one line, with the host it was timed on."""
        flags = " ".join(f for f in HOST_FLAGS if f in cpu_flags()) or "no avx2"
        race = f", the race after {self.race_after}" if self.race_after else ""
        drops = f"; the pilot dropped {self.dropped} cell(s)" if self.dropped else ""
        drops += (f"; {len(self.budget_drops)} more cell(s) left out to keep {self.prompts} of {self.of} prompts in the "
                  "budget" if self.budget_drops else "")
        fits = (f"of {self.budget_s / 60:.1f} min left in the budget" if self.estimate_s <= self.budget_s else
                f"over the {self.budget_s / 60:.1f} min left in the budget (the fewest prompts the race needs)")
        budget = f", about {self.estimate_s / 60:.1f} min {fits}" if self.budget_s else \
            f", about {self.estimate_s / 60:.1f} min (no budget)"
        shared = (f"; {self.prefills} prefill(s) a prompt, one per kernel set and file (llama-cpp-python's plain "
                  "decoding and lookup share an instance; llama-servers that differ only in n-gram speculation copy "
                  "one slot; draftlab's routes, llama-cpp-python, llama-server and a draft model's server run other "
                  "kernels or processes, so each prefills apart)" if self.prefills > 1 else "")
        shared += (f"; {self.own_prefills} cell(s) prefill each prompt in their own requests (draftlab serve)"
                   if self.own_prefills else "")
        shared += (f"; more servers than fit in memory at once: each prompt starts them again, about "
                   f"{self.restart_s:.0f} s a prompt" if self.restart_s else "")
        shared += "".join(f"; {target}: {words}" for target, words in self.growth)
        return (f"plan: {self.prompts} of {self.of} prompts x {self.cells} cells x {self.tokens} tokens{race}{drops}"
                f"{budget}{shared}; host timed on its CPU ({flags})")


def time_pilot(runner: CellRunner, cells: list[Cell], prompt: EncodedPrompt) -> Pilot:
    """The target's engines and cells timed through the measurement loop on `prompt` (module docstring), and each
    server's start: where the servers did not fit at once, a prompt starts each again (`_restarts_s`). A cell that
    cannot run here is left out of the pilot (its timed runs say why)."""
    pilot = Pilot()
    pool = runner.servers

    def make(cell: Cell):
        started, starts, held = time.perf_counter(), pool.starts, len(pool.held)
        contender = runner.contender(cell)
        if len(pool.held) > held:
            pilot.servers.add(cell.key)
        if pool.starts > starts:
            pilot.start_s[cell.key] = time.perf_counter() - started
        return contender

    for contenders in in_groups(cells, make if pool else runner.contender, pool, lambda cell, exc: None):
        _time_group(pilot, contenders, runner, prompt)
    pilot.room = pool.most_running if pool and pool.stopped_for_room else 0
    return pilot


def _time_group(pilot: Pilot, contenders: dict, runner: CellRunner, prompt: EncodedPrompt) -> None:
    """The pilot's timings of cells whose contenders are built (their servers fit together)."""
    settings = {cell: _pilot_settings(runner, cell) for cell in contenders}
    prefills, records = measure_pilot(contenders, prompt, settings)
    pilot.prefill.update({key: p.seconds / max(p.prompt_tokens, 1) for key, p in prefills.items()})
    for cell, record in records.items():
        decode_s = _decode_s_of(record)
        if decode_s > 0:  # (else noise: no rate)
            pilot.decode[cell.key] = decode_rate(record, decode_s, cell) * cell.concurrency
        pilot.keys[cell.key] = contenders[cell].prefill_key
        if not pilot.keys[cell.key] and record.times_prefill:  # its own prefill, in each of its runs
            pilot.own_prefill[cell.key] = record.stats.prefill_s / max(len(prompt.ids), 1)


def _pilot_settings(runner: CellRunner, cell: Cell) -> RunSettings:
    """The cell's settings with the pilot's output length."""
    return replace(runner.settings(cell), max_new_tokens=min(PILOT_TOKENS, cell.max_new_tokens))


def _decode_s_of(record: RunRecord) -> float:
    """A pilot run's decode: its time less its prefill where timed apart (<= 0: a prefill timed apart longer than the
    whole call, noise)."""
    return record.stats.wall_s - (record.stats.prefill_s if record.times_prefill else 0.0)


def decode_rate(record: RunRecord, decode_s: float, cell: Cell) -> float:
    """Seconds per new token of a cell's decode, from its pilot's `decode_s`: a draft model's own prefill of the
    prompt (in the first step, `GenerationStats.draft_prefill_s`) spread over the cell's output length, not over the
    pilot's `PILOT_TOKENS`, which would charge a 64-token run four times its share."""
    new_tokens = max(record.new_tokens, 1)
    draft_prefill_s = min(record.stats.draft_prefill_s, decode_s)
    return (decode_s - draft_prefill_s) / new_tokens + draft_prefill_s / max(cell.max_new_tokens, new_tokens)


@dataclass(frozen=True)
class Longest:
    """A target's baseline timed on the group's longest prompt (`time_longest`)."""

    key: str  # the baseline cell's key
    new_tokens: int  # the tokens it decoded there, as many as the pilot decodes
    prefill_s: float  # seconds per prompt token of its prefill
    decode_s: float  # seconds per new token of its decode


def time_longest(runner: CellRunner, cells: list[Cell], prompt: EncodedPrompt, longest: EncodedPrompt
                 ) -> Longest | None:
    """The target's baseline on the group's `longest` prompt, timed as the pilot times it (where that prompt is
    `SPAN` times the pilot's `prompt` or longer; else None). Timed before the pilot, whose prefill of its own
    prompt then leaves the engine's prompt cache as the pilot alone leaves it: the sweep's first prompt, the
    longest, is prefilled and timed anew."""
    baseline = next((c for c in cells if is_baseline(c.method) and c.concurrency == 1), None)
    if baseline is None or len(longest.ids) < SPAN * len(prompt.ids):
        return None
    contender = runner.contender(baseline)
    settings = _pilot_settings(runner, baseline)
    prefills, records = measure_pilot({baseline: contender}, longest, {baseline: settings})
    record, prefill = records.get(baseline), prefills.get(contender.prefill_key)
    decode_s = _decode_s_of(record) if record else 0.0
    if prefill is None or decode_s <= 0:
        return None
    return Longest(baseline.key, settings.max_new_tokens, prefill.seconds / max(prefill.prompt_tokens, 1),
                   decode_rate(record, decode_s, baseline))


def growth(pilot: Pilot, timed: Longest | None, prompt: EncodedPrompt, longest: EncodedPrompt) -> Growth:
    """The target's growth with the context (`study/run/growth.py`) from its baseline `timed` on the longest prompt
    (`time_longest`) and its pilot on `prompt` (none where either is missing)."""
    if timed is None or timed.key not in pilot.decode or pilot.keys.get(timed.key) not in pilot.prefill:
        return Growth()
    return Growth.timed(len(prompt.ids), timed.new_tokens, len(longest.ids), (pilot.prefill[pilot.keys[timed.key]],
                        timed.prefill_s), (pilot.decode[timed.key], timed.decode_s))


def pilot_drops(cells: list[Cell], pilot: Pilot) -> dict[str, str]:
    """cell key -> reason, for the cells (of one model) whose pilot decodes more than `PILOT_MARGIN` times slower
    than the fastest lossless cell's; never a baseline, a cell under load, a cell a Deploy line answers from
    (`race.deploy_references`), or a peer's plain decoding while one of its speculative cells runs."""
    rates = {c.key: 1 / pilot.decode[c.key] for c in cells if pilot.decode.get(c.key)}
    lossless = [c for c in cells if c.key in rates and c.concurrency == 1 and method_of(c.method).exact]
    if not lossless:
        return {}
    best = max(lossless, key=lambda c: rates[c.key])
    deployed = deploy_references(cells, rates)
    out = {c.key: (f"{PILOT_REASON}: its {PILOT_TOKENS}-token pilot decoded {rates[c.key]:.1f} tok/s, under "
                   f"1/{PILOT_MARGIN:g} of the fastest ({best.target} {best.method} {best.drafter} K={best.k}, "
                   f"{rates[best.key]:.1f} tok/s)")
           for c in cells if c.key in rates and c.concurrency == 1 and not is_baseline(c.method)
           and c.key not in deployed and rates[c.key] * PILOT_MARGIN < rates[best.key]}
    return keep_peer_references(out, cells)


@dataclass(frozen=True)
class PlanLimits:
    """What a group's plan must keep to: the race's first prompts, the baseline's re-checks, the time left."""

    race_after: int  # prompts every cell runs before the race may drop one (0: no race)
    every: int  # the baseline is re-timed after this many cells of a prompt (0: never)
    budget_s: float  # the time the group may take (0: no limit)

    def after(self, seconds: float) -> "PlanLimits":
        """The same limits once `seconds` of the budget were spent (a millisecond left at least)."""
        return replace(self, budget_s=max(self.budget_s - seconds, 1e-3)) if self.budget_s else self


def make_plan(cells: dict[str, list[Cell]], pilots: dict[str, Pilot], lengths: list[int], limits: PlanLimits
              ) -> Plan:
    """The most prompts (of `lengths`, the group's prompt lengths in the order they run) whose estimate fits
    `limits.budget_s` (0: all). With a race, at least `PROMPT_SHARE` of them: where those do not fit, the plan leaves
    out cells first (`_budget_drops`), the most hopeless by their pilot, so that every cell it keeps runs as many
    prompts as the rest. `cells`: each target's cells left after the pilot."""
    least = max(-(-len(lengths) * 3 // 4), limits.race_after) if limits.race_after else len(lengths)
    least = min(len(lengths), least)
    drops = _budget_drops(cells, pilots, lengths[:least], limits) if limits.budget_s else {}
    cells = {target: [c for c in its if c.key not in drops] for target, its in cells.items()}
    costs = _costs(cells, pilots, lengths, limits)
    prompts = least
    for n in range(len(lengths), least - 1, -1):
        if not limits.budget_s or sum(costs[:n]) <= limits.budget_s:
            prompts = n
            break
    tokens = max((c.max_new_tokens for its in cells.values() for c in its), default=0)
    prefills = len({(t, pilots[t].keys[c.key]) for t, its in cells.items() for c in its if pilots[t].keys.get(c.key)})
    own = sum(c.key in pilots[t].own_prefill for t, its in cells.items() for c in its)
    restart_s = sum(_restarts_s(pilots[t], its) for t, its in cells.items())
    return Plan(prompts, len(lengths), sum(map(len, cells.values())), 0, tokens, limits.race_after,
                sum(costs[:prompts]), limits.budget_s, tuple(costs[:prompts]), drops, prefills, own, restart_s)


def _costs(cells: dict[str, list[Cell]], pilots: dict[str, Pilot], lengths: list[int], limits: PlanLimits
           ) -> list[float]:
    """Each prompt's estimate: every cell on the race's first prompts, the cells it is expected to keep after."""
    kept = _race_keeps(cells, pilots)
    return [_prompt_cost(cells, pilots, kept if limits.race_after and i >= limits.race_after else None, length,
                         limits.every) for i, length in enumerate(lengths)]


def _budget_drops(cells: dict[str, list[Cell]], pilots: dict[str, Pilot], lengths: list[int], limits: PlanLimits
                  ) -> dict[str, str]:
    """cell key -> reason, for the cells left out so that `lengths` (the fewest prompts a plan keeps) fit the
    budget: one at a time, the cell whose pilot decodes slowest against its model's fastest first; never a baseline,
    a cell a Deploy line answers from (each server's plain decoding and its fastest speculation by the pilot:
    `race.deploy_references`), nor a peer's plain decoding while one of its speculative cells runs
    (`race.keep_peer_references`)."""
    rates = {c.key: 1 / pilots[t].decode[c.key] for t, its in cells.items() for c in its if pilots[t].decode.get(c.key)}
    best: dict[str, float] = {}
    for c in (c for its in cells.values() for c in its if c.key in rates):
        best[model_of(c.target)] = max(best.get(model_of(c.target), 0.0), rates[c.key])
    everything = [c for its in cells.values() for c in its]
    deployed = deploy_references(everything, rates)
    order = sorted((c for c in everything if c.key in rates and not is_baseline(c.method) and c.key not in deployed),
                   key=lambda c: rates[c.key] / best[model_of(c.target)])
    drops: dict[str, str] = {}
    for cell in order:
        left = {t: [c for c in its if c.key not in drops] for t, its in cells.items()}
        if sum(_costs(left, pilots, lengths, limits)) <= limits.budget_s:
            break
        trial = keep_peer_references({**drops, cell.key: ""}, everything)
        if cell.key in trial:
            drops[cell.key] = (f"{PLAN_REASON}: the budget holds {len(lengths)} prompts only without it (its "
                               f"{PILOT_TOKENS}-token pilot decoded {rates[cell.key]:.1f} tok/s, the fastest of "
                               f"{model_of(cell.target)} {best[model_of(cell.target)]:.1f})")
    return drops


def _race_keeps(cells: dict[str, list[Cell]], pilots: dict[str, Pilot]) -> set[str]:
    """The cells the race is expected to keep: baselines, cells under load, and those within `RACE_KEEPS` of the
    fastest pilot of their model."""
    rates = {c.key: 1 / pilots[t].decode[c.key] for t, its in cells.items() for c in its if pilots[t].decode.get(c.key)}
    best: dict[str, float] = {}
    for its in cells.values():
        for c in its:
            best[model_of(c.target)] = max(best.get(model_of(c.target), 0.0), rates.get(c.key, 0.0))
    return {c.key for its in cells.values() for c in its
            if is_baseline(c.method) or c.concurrency > 1 or rates.get(c.key, 0.0) * RACE_KEEPS >= best[model_of(c.target)]}


def _prompt_cost(cells: dict[str, list[Cell]], pilots: dict[str, Pilot], kept: set[str] | None, length: int,
                 every: int) -> float:
    """Seconds one prompt of `length` tokens is expected to take: each engine's prefill (and each running cell's own,
    where it shares none), each running cell's decode (`kept`: the cells the race keeps by then; None: all) and the
    baseline's re-checks."""
    seconds = 0.0
    for target, its in cells.items():
        pilot = pilots[target]
        running = [c for c in its if kept is None or c.key in kept]
        keys = {pilot.keys[c.key] for c in running if c.key in pilot.keys} - {""}
        prefill = pilot.growth.prefill_factor(length) * length
        seconds += sum(pilot.prefill.get(key, 0.0) * prefill for key in keys)
        seconds += sum(pilot.own_prefill.get(c.key, 0.0) * prefill for c in running)
        seconds += sum(_decode_s(pilot, c, length) for c in running)
        seconds += _restarts_s(pilot, running)
        baseline = next((c for c in its if is_baseline(c.method)), None)
        if baseline is not None and every:
            checks = -(-(len(running) - 1) // every)
            seconds += checks * _decode_s(pilot, baseline, length)
    return seconds


def _decode_s(pilot: Pilot, cell: Cell, length: int) -> float:
    """Seconds the cell is expected to decode its output after a prompt of `length` tokens."""
    tokens = cell.max_new_tokens
    return tokens * pilot.decode.get(cell.key, 0.0) * pilot.growth.decode_factor(length, tokens)


def _restarts_s(pilot: Pilot, running: list[Cell]) -> float:
    """Seconds a prompt spends starting servers again: where more run than fit at once (`Pilot.room`), a prompt's
    groups stop and start every one of them (the group in progress holds its own), so each starts once a prompt;
    a server the pilot found running counts as the mean start it timed."""
    servers = [c.key for c in running if c.key in pilot.servers]
    if not pilot.room or len(servers) <= pilot.room or not pilot.start_s:
        return 0.0
    mean = sum(pilot.start_s.values()) / len(pilot.start_s)
    return sum(pilot.start_s.get(key, mean) for key in servers)


@dataclass
class Deadline:
    """The study's budget as it runs: started when the sweep started; 0 seconds: none."""

    seconds: float
    started: float = field(default_factory=time.perf_counter)
    prompt_s: list[float] = field(default_factory=list)  # each measured prompt's seconds, in order
    planned: tuple[float, ...] = ()  # the plan's estimate of each prompt (none for a resumed plan)

    def left(self) -> float:
        """Seconds the budget has left (a millisecond at least once spent: 0 means no budget)."""
        return max(self.seconds - (time.perf_counter() - self.started), 1e-3) if self.seconds else 0.0

    def next_prompt_s(self) -> float:
        """The next prompt's expected seconds: the plan's estimate of it scaled by how the prompts so far compared
        with theirs (a long prompt costs more than a short one), else the mean so far."""
        done = len(self.prompt_s)
        if len(self.planned) > done and sum(self.planned[:done]) > 0:
            return self.planned[done] * sum(self.prompt_s) / sum(self.planned[:done])
        return sum(self.prompt_s) / done

    def affords_another(self) -> bool:
        """Whether the next prompt, as expected, ends within the budget."""
        return not self.seconds or not self.prompt_s or self.left() >= self.next_prompt_s()


@dataclass(frozen=True)
class GroupPlan:
    """A group's plan and the cells its pilot dropped (cell key -> reason)."""

    plan: Plan
    drops: dict[str, str]


def plan_group(runners: dict[str, CellRunner], cells: dict[str, list[Cell]],
               prompts: dict[str, dict[str, EncodedPrompt]], order: list[str], limits: PlanLimits) -> GroupPlan:
    """Time the host on the group's median-length prompt (each target's engines and its `cells`, the pending ones),
    drop the cells whose pilot is hopeless, and plan the prompts (`order`: their ids as they will run) to fit
    `limits` (its budget: the time left when called, less what the pilot takes), leaving out more cells where the
    budget cannot hold `PROMPT_SHARE` of the prompts."""
    started, first = time.perf_counter(), next(iter(prompts))
    middle = sorted(order, key=lambda p: len(prompts[first][p].ids))[len(order) // 2]
    longest = max(order, key=lambda p: len(prompts[first][p].ids))
    longer = {name: time_longest(runners[name], its, prompts[name][middle], prompts[name][longest])
              for name, its in cells.items()}
    pilots = {name: time_pilot(runners[name], its, prompts[name][middle]) for name, its in cells.items()}
    for name, pilot in pilots.items():
        pilot.growth = growth(pilot, longer[name], prompts[name][middle], prompts[name][longest])
    models: dict[str, list[Cell]] = {}
    for name, its in cells.items():
        models.setdefault(model_of(name), []).extend(its)
    merged = Pilot({k: v for p in pilots.values() for k, v in p.prefill.items()},
                   {k: v for p in pilots.values() for k, v in p.decode.items()},
                   {k: v for p in pilots.values() for k, v in p.keys.items()})
    drops = {key: reason for its in models.values() for key, reason in pilot_drops(its, merged).items()}
    left = {name: [c for c in its if c.key not in drops] for name, its in cells.items()}
    lengths = [len(prompts[first][p].ids) for p in order]
    plan = replace(make_plan(left, pilots, lengths, limits.after(time.perf_counter() - started)),
                   growth=tuple((name, p.growth.words()) for name, p in pilots.items() if p.growth.longest))
    return GroupPlan(replace(plan, dropped=len(drops)), {**drops, **plan.budget_drops})

"""Run a grid of cells over prompts and store one record per (cell, prompt), resumably.

For every dataset and temperature, prompts are the outer loop and targets the inner one: each engine's
autoregressive cell runs first on a prompt, then every (method, drafter, K) cell on the same prompt, so that all
cells of a prompt, on every engine, are measured close together in time. The autoregressive cell is re-timed every
`baseline_every` cells and after the prompt's last cell (the baseline checks): the report compares each cell with
the baseline measured closest in time and flags the study as noisy when the baseline drifted. With
`race_after`, cells that trail the fastest one stop being measured (`study/race.py`); with `budget_s`, the sweep times
the host first, plans the prompts that fit and stops at the budget (`study/budget.py`). Each engine prefills a
prompt once, timed apart, and its cells decode from it (`draftlab.measure`). A cell that cannot run a prompt
is stored as skipped with a one-line reason. Finished (cell, prompt) pairs in the database, measured or skipped,
are passed over, which makes a killed sweep resume where it stopped and a finished sweep a no-op; one sweep
writes a database at a time. Suffix decoding learns across requests: each of its cells keeps its own cache over
its prompts in order (beside the database, so a resumed cell goes on with what it had learned), and `cache_held`
records how many earlier responses it held at each prompt."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from draftlab.api import prompt_ids
from draftlab.backends import LLAMA_SERVER, engine_of_backend
from draftlab.backends.base import ROUNDING
from draftlab.files.datasets import Prompt, load_prompts
from draftlab.errors import DraftlabError, NothingToMeasure
from draftlab.contenders.served import ServerExited
from draftlab.contenders.server_configs import ServerPool
from draftlab.measure import EncodedPrompt, Listener, PrefillRecord, Rechecks, RunRecord, measure_prompt
from draftlab.models import load_model
from draftlab.progress import Bar
from draftlab.study.run.budget import Deadline
from draftlab.study.run.cells import Cell, Record
from draftlab.contenders.methods import ASG, is_baseline, method_of
from draftlab.study.run.crashes import CrashLog, preflight, skip_fatal
from draftlab.study.run.config import (  # noqa: F401  (re-exported: the sweep's grid and presets)
    PRESETS, SweepConfig, environment, load_config, make_config, target_backend,
)
from draftlab.study.run.pacing import plan_kept, plan_prompts, race, stop_at
from draftlab.study.run.race import race_order
from draftlab.study.run.runner import CellRunner, record_of
from draftlab.study.run.store import ResultsStore
from draftlab.study.run.sweep_state import Group, GroupRun, SweepRun, TargetRun  # noqa: F401  (re-exported)


def run_sweep(config: SweepConfig, store: ResultsStore, progress: bool = True, groups: list[Group] | None = None) -> int:
    """Run every cell not yet in `store` (measured or skipped); returns the number of records added.

    Prompts are the outer loop and targets the inner one, so that every engine's cells of a prompt are measured
    close together in time and the race (`config.race_after`) compares engines on the same prompts. `groups`: the
    config's `plan`, when the caller loaded it already (to check the prompt sets before creating the database).
    Each engine is checked first (`draftlab.contenders.preflight`); one that dies there is left out, with one line."""
    groups = plan(config) if groups is None else groups
    with store.writing():
        store.set_meta("config", config.to_json())
        run = SweepRun(config, store, store.done(), CrashLog.open(store), deadline=Deadline(config.budget_s))
        if all((c.key, p.id) in run.done for g in groups for cells in g.cells.values() for c in cells
               for p in g.prompts):
            return 0
        try:
            with run.crashes.watching():
                return _run_all(run, groups, progress)
        finally:  # a Python error or an interrupt is not a native crash: only a dead process leaves its mark
            run.crashes.end()


def _run_all(run: SweepRun, groups: list[Group], progress: bool) -> int:
    """Check the engines, load every target whose engine runs, then run every group's pending (cell, prompt)
    pairs; returns the records added. The llama-server cells' servers are stopped on every way out."""
    left_out = preflight(run.config, run.store)
    runnable = [name for name in run.config.targets if not left_out.get(name, set()) - {LLAMA_SERVER.name}]
    if not runnable:
        raise NothingToMeasure("every engine of this study failed its preflight (said above, one line each); "
                               "nothing was measured")
    servers = ServerPool(run.store.path.with_name(run.store.path.stem + ".server-logs"), run.config.most_in_flight(),
                         run.config.longest_k())
    try:
        run.targets = {name: _start_target(run, name, servers, LLAMA_SERVER.name in left_out.get(name, ()))
                       for name in runnable}
        skip_fatal(run.crashes, groups, run.targets, run.store, run.done)
        todo = sum(len(run.pending(c, [p.id for p in g.prompts])) for g in groups
                   for t, cells in g.cells.items() if t in run.targets for c in run.targets[t].runnable(cells))
        run.bar = Bar(todo, "sweep", "run", disable=not progress)
        added = sum(_run_group(run, g) for g in groups)
        run.bar.close()
    finally:
        servers.stop_all()
    ended = sum(len(t.ended) for t in run.targets.values())
    if ended:
        print(f"sweep: {ended} cell(s) ended early (their llama-server exited); run the same command again to "
              "resume them")
    return added


def _start_target(run: SweepRun, name: str, servers: ServerPool, server_died: bool = False) -> TargetRun:
    """Load a target, build its cell runner, record the run's environment and the parameter counts. `server_died`:
    llama-server failed its preflight, so its cells do not run."""
    config, store = run.config, run.store
    backend, source = target_backend(name, config.backend)
    target = load_model(source, device=config.device, backend=backend,
                        dtype="auto" if engine_of_backend(backend).runs_gguf else config.dtype)
    runner = CellRunner(target, config, backend, store.path.with_name(store.path.stem + ".suffix-caches"), run.done,
                        servers)
    run_id = store.start_run(environment(config, target, _numerics(runner.baseline.target_backend, config), source))
    gone, no_asg = _unrunnable(runner, config)
    _record_params(store, runner, config, name, gone)
    return TargetRun(runner, run_id, gone, no_asg, _left_out(name, config, server_died))


def _numerics(backend, config: SweepConfig) -> str:
    """What the target's products are, and, where an op of its exact route was not row-invariant on this device
    (`Backend.row_check`), that its speculative outputs are lossless only up to rounding there."""
    problem = backend.row_check()
    return backend.numerics + (f" ({ROUNDING}: rows not invariant on {config.device}: {problem})" if problem else "")


def _start_group(run: SweepRun, group: Group) -> GroupRun:
    """The group's runnable cells and encoded prompts per target, each target's pending cells warmed up."""
    cells = {name: run.targets[name].runnable(group.cells[name]) for name in group.cells if name in run.targets}
    encoded = {name: {p.id: EncodedPrompt(p.id, p.category, prompt_ids(run.targets[name].runner.target.tokenizer, p))
                      for p in group.prompts} for name in cells}
    for name, its_cells in cells.items():
        pending = [c for c in its_cells if run.pending(c, [p.id for p in group.prompts])]
        if run.config.warmup and pending:
            first = min(encoded[name].values(), key=lambda p: len(p.ids))  # the cheapest; it fits if any does
            run.targets[name].runner.warm_up(pending, first, lambda cell: run.crashes.start(cell.key, "its warm-up"))
    order = _race_order(group, encoded) if run.config.race_after else [p.id for p in group.prompts]
    companions = {name: [EncodedPrompt(p.id, p.category, prompt_ids(run.targets[name].runner.target.tokenizer, p))
                         for p in group.companions] for name in cells}
    return GroupRun(group, cells, encoded, plan_prompts(run, group, cells, encoded, order), companions)


def _run_group(run: SweepRun, group: Group) -> int:
    """Every prompt of one dataset and temperature on every target; returns the number of records added."""
    going = _start_group(run, group)
    race_after = run.config.race_after
    added = 0
    for index in range(len(going.order)):
        # The budget ends a group only before a prompt with work left: a resumed run's measured prompts cost nothing.
        waiting = any(run.pending(c, going.order[index:index + 1]) for its in going.cells.values() for c in its)
        if waiting and index >= max(race_after, 2) and not run.deadline.affords_another():
            stop_at(run, going, index)
            break
        if index >= race_after > 0:
            race(run, going, index)
        started = time.perf_counter()
        added += _run_index(run, going, index)
        run.deadline.prompt_s.append(time.perf_counter() - started)
    plan_kept(run, going)
    # Cells readmitted on the way, and those the final leader's margin admits again, catch up on what they missed.
    readmitted_late = 1
    while race_after and readmitted_late:
        added += sum(_run_index(run, going, index) for index in range(len(going.order)))
        readmitted_late = race(run, going, len(going.order))
    return added


def _run_index(run: SweepRun, going: GroupRun, index: int) -> int:
    """The group's prompt `index` (in its running order) on every target; returns the records added."""
    load = run.config.most_in_flight() - 1
    prompt_id = going.order[index]
    return sum(_run_prompt(run, run.targets[name], its_cells, going.encoded[name][prompt_id],
                           companions(going.companions.get(name, []), index, load))
               for name, its_cells in going.cells.items())


def _race_order(group: Group, encoded: dict[str, dict[str, EncodedPrompt]]) -> list[str]:
    """The group's prompt ids in the order a race runs them (`race.race_order`), by the first target's lengths."""
    lengths = {p: len(e.ids) for p, e in next(iter(encoded.values()), {}).items()}
    if not lengths:
        return [p.id for p in group.prompts]
    return race_order([p.id for p in group.prompts], lengths, {p.id: p.category for p in group.prompts})


def companions(pool: list[EncodedPrompt], index: int, count: int) -> tuple[EncodedPrompt, ...]:
    """The prompts sent beside timed prompt `index` under load: `count` of the group's companions (never timed),
    taken in turn."""
    return tuple(pool[(index + j) % len(pool)] for j in range(count)) if pool else ()


def _run_prompt(run: SweepRun, target: TargetRun, cells: list[Cell], prompt: EncodedPrompt,
                companions: tuple[EncodedPrompt, ...] = ()) -> int:
    """The target's pending cells on one prompt through the measurement loop, with baseline re-checks between them;
    each run stored as it ends; returns records added. A cell whose llama-server exits is ended for this run, with
    one line, and left for the next run to resume."""
    pending = [c for c in cells if run.pending(c, [prompt.id]) and c.key not in target.ended]
    if not pending:
        return 0
    runner = target.runner
    listener = PromptRun(run, target, prompt, pending[0].baseline())
    rechecks = Rechecks(listener.baseline, runner.contender(listener.baseline), run.config.baseline_every)
    # A server starts here, outside the timed runs (one that cannot start skips its cell), as many at once as fit.
    for contenders in runner.in_groups(pending, listener.failed, listener.started, companions):
        measure_prompt(contenders, prompt, runner.settings(listener.baseline), rechecks, listener)
    run.crashes.end()
    return len(listener.added)


@dataclass
class PromptRun(Listener):
    """One prompt of a target as the loop runs it: each run stored as it ends, each re-check, prefill and skip too,
    and the crash log told which cell is about to run."""

    run: SweepRun
    target: TargetRun
    prompt: EncodedPrompt
    baseline: Cell
    added: list[Record] = field(default_factory=list)

    def started(self, cell: Cell) -> None:
        self.run.crashes.start(cell.key, self.prompt.id)

    def prefilled(self, record: PrefillRecord) -> None:
        self.run.store.add_prefill(self.baseline.target, self.baseline.dataset, record, self.target.run_id)

    def recorded(self, record: RunRecord) -> None:
        self.added.append(_store(self.run, self.target, record.key, record))
        self.run.passed(record.key, self.prompt.id)

    def rechecked(self, record: RunRecord) -> None:
        self.run.store.add_baseline_check(record_of(self.baseline, record), self.target.run_id)

    def failed(self, cell: Cell, exc: Exception) -> bool:
        """A server that exited ends its cell for this run; a library's refusal of a prompt is a skip, stored with
        its reason; anything else from draftlab's own engine is a bug, and propagates."""
        if isinstance(exc, ServerExited):
            self.target.ended.add(cell.key)
            print(f"sweep: {cell.method} {cell.drafter} k={cell.k} c={cell.concurrency} ended at {self.prompt.id}: "
                  f"{exc}; the next run resumes it")
            return True
        if not isinstance(exc, DraftlabError) and not method_of(cell.method).peer:
            return False  # draftlab's own bug: a traceback, not a skip
        reason = f"{type(exc).__name__}: {exc}" if not isinstance(exc, DraftlabError) else str(exc)
        self.run.store.add_skip(cell, self.prompt.id, reason, self.target.run_id)
        print(f"sweep: {cell.method} {cell.drafter} k={cell.k} skipped {self.prompt.id}: "
              f"{reason.splitlines()[0][:200]}")
        self.run.passed(cell, self.prompt.id)
        return True


def _store(run: SweepRun, target: TargetRun, cell: Cell, measured: RunRecord) -> Record:
    """Store one (cell, prompt) run, after what its cell learned from it."""
    record = record_of(cell, measured)
    record.identical = _identical(run.store, cell, measured.prompt_id, record.output_sha)
    target.runner.keep_state(cell, measured.prompt_id)
    run.store.add(record, target.run_id)
    return record


def _unrunnable(runner: CellRunner, config: SweepConfig) -> tuple[set[str], set[str]]:
    """Drafters that do not run on the target's engine, and those with no HF counterpart for asg; says which."""
    why = {d: runner.why_not_here(d) for d in config.drafters}
    gone = {d for d, reason in why.items() if reason}
    asg = ASG.name in config.methods and not runner.target.engine.runs_gguf
    no_asg = {d for d in config.drafters if asg and d not in gone and not runner.asg_supported(d)}
    for drafter in sorted(gone):
        print(f"sweep: {drafter} does not run on {runner.target.name} with the {runner.backend} backend "
              f"({why[drafter]}); its cells are skipped")
    for drafter in sorted(no_asg):
        print(f"sweep: no HF assisted-generation counterpart for {drafter}; its asg cells are skipped")
    return gone, no_asg


def _left_out(target: str, config: SweepConfig, server_died: bool) -> frozenset[str]:
    """The target's methods that cannot run here: llama-server's when it failed its preflight (`server_died`), and
    any whose engine is missing (`Method.missing`: no llama-server binary; vLLM's environment, made first where it
    can be); says why, once per engine."""
    names = {c.method for c in config.cells(target, config.datasets[0], config.temperatures[0])}
    wanted = [method_of(name) for name in sorted(names)]
    out = {m.name for m in wanted if server_died and m.engine == LLAMA_SERVER.label}
    why: dict[str, str] = {}
    for method in wanted:
        if method.missing is not None and method.name not in out:
            if method.engine not in why:
                why[method.engine] = method.missing()
            out |= {method.name} if why[method.engine] else set()
    for engine, reason in why.items():
        if reason:
            print(f"sweep: {reason}; the {engine} cells of {target} are left for a run that has it")
    return frozenset(out)


def _record_params(store: ResultsStore, runner: CellRunner, config: SweepConfig, target_name: str,
                   gone: set[str] = frozenset()) -> None:
    """Parameter counts of the target and of every draft with weights that runs (`gone`: those that do not), for
    the scaling ratio and the seeds' "smallest draft" finding."""
    store.set_params(target_name, runner.target.num_parameters())
    for drafter in set(config.drafters) - gone:
        if parameters := runner.draft_parameters(drafter):
            store.set_params(f"{target_name}::{drafter}", parameters)


def plan(config: SweepConfig) -> list[Group]:
    """One group per (dataset, temperature), with the cells of every target, and the companions its prompts are
    timed beside under load."""
    load = config.most_in_flight() - 1
    prompts = {d: load_prompts(d, config.limit, config.skip) for d in config.datasets}
    pools = {d: companion_pool(d, prompts[d], load, config.skip) for d in config.datasets}
    return [Group(d, temp, [p for p in prompts[d] if p not in pools[d]], {t: config.cells(t, d, temp)
                                                                            for t in config.targets}, pools[d])
            for d in config.datasets for temp in config.temperatures]


def companion_pool(dataset: str, timed: list[Prompt], load: int, skip: int) -> list[Prompt]:
    """`load` prompts of the dataset past the timed ones, never timed themselves; where it has none left, the last
    of the timed prompts are held back as companions instead (untimed); none without load."""
    if load <= 0:
        return []
    try:
        spare = load_prompts(dataset, load + len(timed), skip + len(timed))
    except DraftlabError:  # the dataset holds no more prompts
        spare = []
    ids = {p.id for p in timed}
    spare = [p for p in spare if p.id not in ids][:load]
    if spare:
        return spare
    held = min(load, len(timed) - 1)
    return timed[-held:] if held > 0 else []


def _identical(store: ResultsStore, cell: Cell, prompt_id: str, output_sha: str) -> bool | None:
    """Equality with the output of plain decoding on the cell's own engine: only defined for greedy decoding."""
    method = method_of(cell.method)
    if cell.temperature > 0 or method.plain and not is_baseline(method.name):  # another mode's or library's plain
        # decoding: it rounds as its own engine does
        return None
    if is_baseline(method.name):
        return True
    baseline = store.output_sha(cell.engine_baseline(), prompt_id)
    return None if baseline is None else baseline == output_sha

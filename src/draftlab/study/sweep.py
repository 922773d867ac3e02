"""Run a grid of cells over prompts and store one record per (cell, prompt), resumably.

For every dataset and temperature, prompts are the outer loop and targets the inner one: each engine's
autoregressive cell runs first on a prompt, then every (method, drafter, K) cell on the same prompt, so that all
cells of a prompt, on every engine, are measured close together in time. The autoregressive cell is re-timed every
`baseline_every` cells and after the prompt's last cell (the baseline checks): the report compares each cell with
the baseline measured closest in time and flags the study as noisy when the baseline drifted. With
`race_after`, cells that trail the fastest one stop being measured (`study/race.py`). A cell that cannot run a prompt
is stored as skipped with a one-line reason. Finished (cell, prompt) pairs in the database, measured or skipped,
are passed over, which makes a killed sweep resume where it stopped and a finished sweep a no-op; one sweep
writes a database at a time. Suffix decoding learns across requests: each of its cells keeps its own cache over
its prompts in order (beside the database, so a resumed cell goes on with what it had learned), and `cache_held`
records how many earlier responses it held at each prompt."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from draftlab.api import prompt_ids
from draftlab.backends import LLAMA_SERVER, engine_of_backend
from draftlab.backends.base import ROUNDING
from draftlab.files.datasets import Prompt, load_prompts
from draftlab.errors import DraftlabError, NothingToMeasure
from draftlab.contenders.llama_server import ServerExited, server_binary
from draftlab.contenders.server_configs import ServerPool
from draftlab.measure import EncodedPrompt, Rechecks, RunRecord, measure_prompt
from draftlab.models import load_model
from draftlab.progress import Bar
from draftlab.study.cells import Cell, Record
from draftlab.contenders.methods import ASG, is_baseline, method_of
from draftlab.study.crashes import CrashLog, preflight, skip_fatal
from draftlab.study.config import (  # noqa: F401  (re-exported: the sweep's grid and presets)
    METHODS, PRESETS, SweepConfig, environment, load_config, make_config, target_backend,
)
from draftlab.study.race import (RACE_REASON, PromptSet, RaceRule, dropped_cells, model_of, race_order,
                                    readmitted)
from draftlab.study.report import baseline_drift
from draftlab.study.runner import CellRunner, record_of
from draftlab.study.store import ResultsStore


@dataclass
class TargetRun:
    """One target loaded for a sweep: its cell runner, its run id, the drafters that cannot run on it, whether
    llama-server can, and the cells this run ended early (their server exited: a later run resumes them)."""

    runner: CellRunner
    run_id: int
    gone: set[str]
    no_asg: set[str]
    no_server: bool = False
    ended: set[str] = field(default_factory=set)

    def runnable(self, cells: list[Cell]) -> list[Cell]:
        """The cells whose drafter runs on this target's engine (and has an HF counterpart, for asg)."""
        return [c for c in cells if c.drafter not in self.gone
                and not (method_of(c.method).assisted and c.drafter in self.no_asg)
                and not (self.no_server and method_of(c.method).served) and c.key not in self.ended]


@dataclass(frozen=True)
class Group:
    """One dataset at one temperature: its prompts, and the cells of each target that run on them."""

    dataset: str
    temperature: float
    prompts: list[Prompt]
    cells: dict[str, list[Cell]]  # target name -> its cells


@dataclass
class SweepRun:
    """One run of a sweep: what its steps read and change. `done`: the (cell key, prompt id) pairs stored, measured
    or skipped; `targets`: the loaded targets by name; `bar`: the progress bar over the pending pairs."""

    config: SweepConfig
    store: ResultsStore
    done: set[tuple[str, str]]
    crashes: CrashLog
    targets: dict[str, TargetRun] = field(default_factory=dict)
    bar: Bar | None = None

    def passed(self, cell: Cell, prompt_id: str) -> None:
        """A (cell, prompt) pair is stored, measured or skipped."""
        self.done.add((cell.key, prompt_id))
        self.bar.describe(_words(cell))
        self.bar.update()

    def pending(self, cell: Cell, prompt_ids: list[str]) -> list[str]:
        """The prompts the cell has not stored yet."""
        return [p for p in prompt_ids if (cell.key, p) not in self.done]


@dataclass(frozen=True)
class GroupRun:
    """One group as it runs: its runnable cells and its prompts as token ids, per target, and the prompt ids in the
    order they run (the race's order: the longest and shortest first)."""

    group: Group
    cells: dict[str, list[Cell]]
    encoded: dict[str, dict[str, EncodedPrompt]]
    order: list[str]


def run_sweep(config: SweepConfig, store: ResultsStore, progress: bool = True, groups: list[Group] | None = None) -> int:
    """Run every cell not yet in `store` (measured or skipped); returns the number of records added.

    Prompts are the outer loop and targets the inner one, so that every engine's cells of a prompt are measured
    close together in time and the race (`config.race_after`) compares engines on the same prompts. `groups`: the
    config's `plan`, when the caller loaded it already (to check the prompt sets before creating the database).
    Each engine is checked first (`draftlab.contenders.preflight`); one that dies there is left out, with one line."""
    groups = plan(config) if groups is None else groups
    with store.writing():
        store.set_meta("config", config.to_json())
        run = SweepRun(config, store, store.done(), CrashLog.open(store))
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
    servers = ServerPool(run.store.path.with_name(run.store.path.stem + ".server-logs"))
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
    return TargetRun(runner, run_id, gone, no_asg, server_died or _no_server(runner, config))


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
    return GroupRun(group, cells, encoded, order)


def _run_group(run: SweepRun, group: Group) -> int:
    """Every prompt of one dataset and temperature on every target; returns the number of records added."""
    going = _start_group(run, group)
    race_after = run.config.race_after
    added = 0
    for index in range(len(going.order)):
        if index >= race_after > 0:
            _race(run, going, index)
        added += _run_index(run, going, index)
    # Cells readmitted on the way, and those the final leader's margin admits again, catch up on what they missed.
    readmitted_late = 1
    while race_after and readmitted_late:
        added += sum(_run_index(run, going, index) for index in range(len(going.order)))
        readmitted_late = _race(run, going, len(going.order))
    return added


def _run_index(run: SweepRun, going: GroupRun, index: int) -> int:
    """The group's prompt `index` (in its running order) on every target; returns the records added."""
    load = max(run.config.concurrency) - 1
    prompt_id = going.order[index]
    return sum(_run_prompt(run, run.targets[name], its_cells, going.encoded[name][prompt_id],
                           tuple(going.encoded[name][p] for p in _companions(going.order, index, load)))
               for name, its_cells in going.cells.items())


def _race_order(group: Group, encoded: dict[str, dict[str, EncodedPrompt]]) -> list[str]:
    """The group's prompt ids in the order a race runs them (`race.race_order`), by the first target's lengths."""
    lengths = {p: len(e.ids) for p, e in next(iter(encoded.values()), {}).items()}
    if not lengths:
        return [p.id for p in group.prompts]
    return race_order([p.id for p in group.prompts], lengths, {p.id: p.category for p in group.prompts})


def _companions(prompts: list[str], index: int, count: int) -> list[str]:
    """The prompts sent beside prompt `index` under load: the next `count` of its group, wrapping around."""
    return [prompts[(index + j) % len(prompts)] for j in range(1, count + 1)]


def _run_prompt(run: SweepRun, target: TargetRun, cells: list[Cell], prompt: EncodedPrompt,
                companions: tuple[EncodedPrompt, ...] = ()) -> int:
    """The target's pending cells on one prompt through the measurement loop, with baseline re-checks between them;
    each run stored as it ends; returns records added. A cell whose llama-server exits is ended for this run, with
    one line, and left for the next run to resume."""
    pending = [c for c in cells if run.pending(c, [prompt.id]) and c.key not in target.ended]
    if not pending:
        return 0
    runner, added, store = target.runner, [], run.store
    baseline = pending[0].baseline()
    rechecks = Rechecks(baseline, runner.contender(baseline), run.config.baseline_every)

    def stored(record: RunRecord) -> None:
        added.append(_store(run, target, record.key, record))
        run.passed(record.key, prompt.id)

    def skipped(cell: Cell, exc: Exception) -> bool:
        if isinstance(exc, ServerExited):
            target.ended.add(cell.key)
            print(f"sweep: {cell.method} {cell.drafter} k={cell.k} c={cell.concurrency} ended at {prompt.id}: {exc}; "
                  "the next run resumes it")
            return True
        if not isinstance(exc, DraftlabError) and not method_of(cell.method).peer:
            return False  # draftlab's own bug: a traceback, not a skip
        reason = f"{type(exc).__name__}: {exc}" if not isinstance(exc, DraftlabError) else str(exc)
        store.add_skip(cell, prompt.id, reason, target.run_id)
        print(f"sweep: {cell.method} {cell.drafter} k={cell.k} skipped {prompt.id}: {reason.splitlines()[0][:200]}")
        run.passed(cell, prompt.id)
        return True

    contenders = {}
    for cell in pending:  # a server starts here, outside the timed runs; one that cannot start skips its cell
        run.crashes.start(cell.key, prompt.id)
        try:
            contenders[cell] = runner.contender(cell, companions)
        except DraftlabError as exc:
            skipped(cell, exc)
    measure_prompt(contenders, prompt, runner.settings(baseline), stored, rechecks,
                   lambda check: store.add_baseline_check(record_of(baseline, check), target.run_id), skipped,
                   lambda cell: run.crashes.start(cell.key, prompt.id),
                   lambda prefill: store.add_prefill(baseline.target, baseline.dataset, prefill, target.run_id))
    run.crashes.end()
    return len(added)


def _store(run: SweepRun, target: TargetRun, cell: Cell, measured: RunRecord) -> Record:
    """Store one (cell, prompt) run, after what its cell learned from it."""
    record = record_of(cell, measured)
    record.identical = _identical(run.store, cell, measured.prompt_id, record.output_sha)
    target.runner.keep_state(cell, measured.prompt_id)
    run.store.add(record, target.run_id)
    return record


def _race(run: SweepRun, going: GroupRun, index: int) -> int:
    """Before prompt `index` (or after the last): the race drops, per model, the cells that cannot beat its leader
    on the whole prompt set, each stored as skipped on every prompt it has left (so a resumed sweep makes the same
    decision), and readmits the dropped cells it would keep now; returns how many came back."""
    group, store = going.group, run.store
    rows = [r for r in store.rows() if r["dataset"] == group.dataset and r["temperature"] == group.temperature]
    checks = [c for c in store.baseline_checks() if c["dataset"] == group.dataset]
    drift = baseline_drift(rows, checks).spread
    raced = {s["cell"] for s in store.skips() if s["reason"].startswith(RACE_REASON)}
    prompts = PromptSet({name: {p: len(e.ids) for p, e in its.items()} for name, its in going.encoded.items()})
    models: dict[str, list[str]] = defaultdict(list)
    for name in going.cells:
        models[model_of(name)].append(name)
    back = 0
    for model, names in models.items():
        contenders = {c.key: c for name in names for c in going.cells[name]}
        decided = dropped_cells(list(contenders.values()), rows, RaceRule(run.config.race_after), prompts, drift)
        newly = [contenders[key] for key, reason in decided.items() if key not in raced
                 and _drop(run, contenders[key], going.order[index:], reason)]
        again = [contenders[key] for key in readmitted(raced & set(contenders), decided)]
        for cell in again:
            run.bar.total += _readmit(run, cell)
        back += len(again)
        if newly:
            print(f"sweep: the race dropped {len(newly)} cell(s) of {model} after {index} prompts of {group.dataset} "
                  f"(they cannot beat the leader over the {len(going.order)} prompts by more than the margin; the "
                  f"report lists each): {', '.join(_words(c) for c in newly)}")
        if again:
            print(f"sweep: the race readmitted {len(again)} cell(s) of {model} (the leader changed; they are within "
                  f"the margin now and catch up): {', '.join(_words(c) for c in again)}")
    return back


def _words(cell: Cell) -> str:
    return f"{cell.method} {cell.drafter} k={cell.k}"


def _drop(run: SweepRun, cell: Cell, left: list[str], reason: str) -> bool:
    """Store a dropped cell as skipped on the prompts it has left; whether it had any."""
    pending = run.pending(cell, left)
    for prompt_id in pending:
        run.store.add_skip(cell, prompt_id, reason, run.targets[cell.target].run_id)
        run.done.add((cell.key, prompt_id))
    run.bar.total -= len(pending)
    return bool(pending)


def _readmit(run: SweepRun, cell: Cell) -> int:
    """Forget the race's skips of a readmitted cell, so that it runs those prompts; returns how many."""
    removed = run.store.remove_skips(cell.key, RACE_REASON)
    for prompt_id in removed:
        run.done.discard((cell.key, prompt_id))
    return len(removed)


def _unrunnable(runner: CellRunner, config: SweepConfig) -> tuple[set[str], set[str]]:
    """Drafters that do not run on the target's engine, and those with no HF counterpart for asg; says which."""
    gone = {d for d in config.drafters if not runner.runs_here(d)}
    asg = ASG.name in config.methods and not runner.target.engine.runs_gguf
    no_asg = {d for d in config.drafters if asg and d not in gone and not runner.asg_supported(d)}
    for drafter in sorted(gone):
        print(f"sweep: {drafter} does not run on {runner.target.name} with the {runner.backend} backend; "
              "its cells are skipped")
    for drafter in sorted(no_asg):
        print(f"sweep: no HF assisted-generation counterpart for {drafter}; its asg cells are skipped")
    return gone, no_asg


def _no_server(runner: CellRunner, config: SweepConfig) -> bool:
    """Whether the llama-server cells cannot run here (no server binary); says why, once."""
    if not (config.servers and runner.target.engine.runs_gguf):
        return False
    try:
        server_binary()
    except DraftlabError as exc:
        print(f"sweep: {exc}; the llama-server cells of {runner.target.name} are left for a run that has it")
        return True
    return False


def _record_params(store: ResultsStore, runner: CellRunner, config: SweepConfig, target_name: str,
                   gone: set[str] = frozenset()) -> None:
    """Parameter counts of the target and of every model draft that runs (`gone`: those that do not), for the
    scaling ratio."""
    store.set_params(target_name, runner.target.num_parameters())
    for drafter in set(config.drafters) - gone:
        draft = runner.decoder(drafter, 1).draft_model
        if draft is not None:
            store.set_params(f"{target_name}::{drafter}", draft.num_parameters())


def plan(config: SweepConfig) -> list[Group]:
    """One group per (dataset, temperature), with the cells of every target."""
    prompts = {d: load_prompts(d, config.limit, config.skip) for d in config.datasets}
    return [Group(d, temp, prompts[d], {t: config.cells(t, d, temp) for t in config.targets})
            for d in config.datasets for temp in config.temperatures]


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

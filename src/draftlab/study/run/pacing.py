"""What a sweep runs of a group: the prompts its budget affords (the plan), when the budget ends it (the
deadline), and the cells the race drops and readmits on the way (`study/race.py`, `study/budget.py`)."""

from __future__ import annotations

import statistics
from collections import defaultdict

from draftlab.measure import EncodedPrompt
from draftlab.study.run.budget import PlanLimits, plan_group
from draftlab.study.run.cells import Cell
from draftlab.study.run.race import RACE_REASON, PromptSet, RaceRule, dropped_cells, model_of, readmitted
from draftlab.study.run.drift import baseline_drift
from draftlab.study.run.sweep_state import Group, GroupRun, SweepRun, words


def plan_prompts(run: SweepRun, group: Group, cells: dict[str, list[Cell]],
                 encoded: dict[str, dict[str, EncodedPrompt]], order: list[str]) -> list[str]:
    """The group's prompts the budget affords (`study/budget.py`), in the order they run: planned once (a resumed
    sweep keeps its plan); the pilot's drops stored as skips; all of them without a budget."""
    key, config = f"plan:{group.dataset}:{group.temperature:g}", run.config
    stored = run.store.get_meta(key)
    if stored is None and not config.budget_s:
        return order
    count = lambda prompts: sum(len(run.pending(c, prompts)) for its in cells.values() for c in its)  # noqa: E731
    before = count(order)
    if stored is None:
        pending = {name: [c for c in its if run.pending(c, order)] for name, its in cells.items()}
        planned = plan_group({name: run.targets[name].runner for name in cells}, pending, encoded, order,
                             PlanLimits(config.race_after, config.baseline_every, run.deadline.left()))
        print(planned.plan.line())
        run.deadline.planned = planned.plan.costs
        for cell in (c for its in cells.values() for c in its if c.key in planned.drops):
            for prompt_id in run.pending(cell, order[:planned.plan.prompts]):
                run.store.add_skip(cell, prompt_id, planned.drops[cell.key], run.targets[cell.target].run_id)
                run.done.add((cell.key, prompt_id))
        run.store.set_meta(key, str(planned.plan.prompts))
        stored = str(planned.plan.prompts)
    kept = order[:int(stored)]
    run.bar.total -= before - count(kept)
    return kept


def stop_at(run: SweepRun, going: GroupRun, index: int) -> None:
    """The budget ends the group before prompt `index`: every cell still running has run the same prompts."""
    left = going.order[index:]
    run.bar.total -= sum(len(run.pending(c, left)) for its in going.cells.values() for c in its)
    print(f"sweep: the budget ({run.config.budget_s / 60:.1f} min) ends {going.group.dataset} after {index} of "
          f"{len(going.order)} planned prompts (the next was expected to take {run.deadline.next_prompt_s():.0f} s, "
          f"{max(run.deadline.left(), 0):.0f} s were left; the prompts so far took "
          f"{statistics.fmean(run.deadline.prompt_s):.0f} s on average)")
    del going.order[index:]


def plan_kept(run: SweepRun, going: GroupRun) -> None:
    """One line: the plan's estimate of the prompts this run measured, against the time they took (none for a
    resumed plan, whose estimates were made by an earlier run)."""
    done = run.deadline.prompt_s[-len(going.order):] if going.order else []
    planned = run.deadline.planned[:len(done)]
    if not planned or len(planned) < len(done) or not sum(planned):
        return
    took, estimate = sum(done), sum(planned)
    print(f"sweep: {going.group.dataset}'s {len(done)} prompt(s) took {took / 60:.1f} min, planned "
          f"{estimate / 60:.1f} min ({took / estimate:.2f}x the plan's estimate)")


def race(run: SweepRun, going: GroupRun, index: int) -> int:
    """Before prompt `index` (or after the last): the race drops, per model, the cells that cannot beat its leader
    on the whole prompt set, each stored as skipped on every prompt it has left (so a resumed sweep makes the same
    decision), and readmits the dropped cells it would keep now; returns how many came back."""
    group, store = going.group, run.store
    ranked = set(going.order)
    rows = [r for r in store.rows() if r["dataset"] == group.dataset and r["temperature"] == group.temperature
            and r["prompt_id"] in ranked]
    checks = [c for c in store.baseline_checks() if c["dataset"] == group.dataset]
    drift = baseline_drift(rows, checks).spread
    raced = {s["cell"] for s in store.skips() if s["reason"].startswith(RACE_REASON)}
    prompts = PromptSet({name: {p: len(its[p].ids) for p in going.order} for name, its in going.encoded.items()})
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
                  f"report lists each): {', '.join(words(c) for c in newly)}")
        if again:
            print(f"sweep: the race readmitted {len(again)} cell(s) of {model} (the leader changed; they are within "
                  f"the margin now and catch up): {', '.join(words(c) for c in again)}")
    return back


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

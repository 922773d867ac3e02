"""A sweep's state as it runs: its targets, its groups (a dataset at a temperature) and what is done."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftlab.files.datasets import Prompt
from draftlab.measure import EncodedPrompt
from draftlab.progress import Bar
from draftlab.study.run.budget import Deadline
from draftlab.study.run.cells import Cell
from draftlab.contenders.methods import method_of
from draftlab.study.run.config import SweepConfig
from draftlab.study.run.crashes import CrashLog
from draftlab.study.run.runner import CellRunner
from draftlab.study.run.store import ResultsStore


@dataclass
class TargetRun:
    """One target loaded for a sweep: its cell runner, its run id, the drafters that cannot run on it, the methods
    that cannot run here (a server that is missing or failed its preflight), and the cells this run ended early
    (their server exited: a later run resumes them)."""

    runner: CellRunner
    run_id: int
    gone: set[str]
    no_asg: set[str]
    left_out: frozenset[str] = frozenset()  # method names
    ended: set[str] = field(default_factory=set)

    def runnable(self, cells: list[Cell]) -> list[Cell]:
        """The cells whose drafter runs on this target's engine (and has an HF counterpart, for asg)."""
        return [c for c in cells if c.drafter not in self.gone
                and not (method_of(c.method).assisted and c.drafter in self.no_asg)
                and c.method not in self.left_out and c.key not in self.ended]


@dataclass(frozen=True)
class Group:
    """One dataset at one temperature: its prompts, and the cells of each target that run on them."""

    dataset: str
    temperature: float
    prompts: list[Prompt]
    cells: dict[str, list[Cell]]  # target name -> its cells
    companions: list[Prompt] = field(default_factory=list)  # sent beside a timed prompt under load, never timed:
    # a server never answers a prompt before its timed run (a drafter that learns across requests would know it)


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
    deadline: Deadline = field(default_factory=lambda: Deadline(0.0))

    def passed(self, cell: Cell, prompt_id: str) -> None:
        """A (cell, prompt) pair is stored, measured or skipped."""
        self.done.add((cell.key, prompt_id))
        self.bar.describe(words(cell))
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
    companions: dict[str, list[EncodedPrompt]] = field(default_factory=dict)  # per target, the group's companions


def words(cell: Cell) -> str:
    """A cell in a progress line: method, draft and K."""
    return f"{cell.method} {cell.drafter} k={cell.k}"

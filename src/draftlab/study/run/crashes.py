"""Engines and cells that kill a study's process: the preflight that leaves an engine out, the cell that was
running when the process died, and the cells that killed it twice.

A native library can kill the whole process (a segmentation fault, a general protection fault) with no Python
exception. Before each run of a (cell, prompt), the study's database records it as running; when the run ends (or a
Python error ends the sweep) the mark is cleared. While the sweep runs, `faulthandler` writes the traceback of a
fatal signal (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) to the study's `.fatal` file. A sweep that finds the mark on
start knows its predecessor died there: with a traceback in that file it crashed, and the death counts against the
cell; without one it was stopped from outside (kill -9, the OOM killer, a power cut), which is no fault of the cell:
it runs again. Each is said in one line. A cell that crashed the process `LIMIT` times is skipped on every prompt it
has left, with that reason, so the study finishes without it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from draftlab.contenders.preflight import check_engines, engine_checks
from draftlab.study.run.config import SweepConfig, target_backend
from draftlab.study.run.store import LEFT_OUT, ResultsStore

RUNNING = "running"  # meta key: {"cell": key, "prompt": id} of the run in progress, '' when none
DEATHS = "deaths"  # meta key: {cell key: [prompt ids it was running when the process died]}
LIMIT = 2  # deaths of the process in one cell after which the cell is skipped
CRASH_ENV = "DRAFTLAB_CRASH_CELL"
SIGNAL_ENV = "DRAFTLAB_CRASH_SIGNAL"  # with CRASH_ENV: SEGV (a crash, the default) or KILL (a stop from outside)
TEST_SIGNALS = {"SEGV": signal.SIGSEGV, "KILL": signal.SIGKILL}


@dataclass
class CrashLog:
    """The study database's record of runs in progress and of the deaths they caused."""

    store: ResultsStore
    deaths: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def open(cls, store: ResultsStore) -> "CrashLog":
        """Read the deaths so far; when the last run's mark is still there, count its death if it crashed (a fatal
        signal's traceback in the `.fatal` file), and say which it was."""
        log = cls(store, _deaths(store.get_meta(DEATHS)))
        running = _read(store.get_meta(RUNNING))
        crashed = _fatal_signal(fatal_file(store))
        if {"cell", "prompt"} <= set(running) and str(running["cell"]).count("|") >= 3:
            cell, prompt = str(running["cell"]), str(running["prompt"])
            store.set_meta(RUNNING, "")
            if crashed:
                log.deaths.setdefault(cell, []).append(prompt)
                store.set_meta(DEATHS, json.dumps(log.deaths))
                times = len(log.deaths[cell])
                print(f"sweep: the last run died while running {_words(cell)} on {prompt} ({crashed}; {times} "
                      f"time(s); {'its cell is skipped' if times >= LIMIT else 'it runs again now'})")
            else:
                print(f"sweep: the last run was stopped from outside while running {_words(cell)} on {prompt} (no "
                      "crash: it runs again now)")
        return log

    @contextmanager
    def watching(self) -> Iterator[None]:
        """While the sweep runs, a fatal signal's traceback goes to the `.fatal` file (removed when the sweep ends
        without one); the process's earlier fault handler is restored after."""
        path = fatal_file(self.store)
        was_enabled = faulthandler.is_enabled()
        with open(path, "w", encoding="utf-8") as handle:
            faulthandler.enable(file=handle)
            try:
                yield
            finally:
                faulthandler.disable()
                _restore_stderr_handler(was_enabled)
        if path.stat().st_size == 0:
            path.unlink()

    def start(self, cell_key: str, prompt_id: str) -> None:
        """Mark a run as in progress (committed before it starts). `DRAFTLAB_CRASH_CELL=TEXT` then kills the process
        by SIGSEGV when the cell's key holds TEXT (by SIGKILL with `DRAFTLAB_CRASH_SIGNAL=KILL`): how the tests make a
        cell crash as a native library would, or stop the process as kill -9 would."""
        self.store.set_meta(RUNNING, json.dumps({"cell": cell_key, "prompt": prompt_id}))
        if os.environ.get(CRASH_ENV) and os.environ[CRASH_ENV] in cell_key:
            os.kill(os.getpid(), TEST_SIGNALS.get(os.environ.get(SIGNAL_ENV, "SEGV"), signal.SIGSEGV))

    def end(self) -> None:
        """No run in progress any more."""
        self.store.set_meta(RUNNING, "")

    def fatal(self) -> dict[str, str]:
        """cell key -> the one-line reason it is skipped, for the cells that killed the process `LIMIT` times."""
        return {key: f"killed the study's process {len(prompts)} times (last while running {prompts[-1]}): a crash "
                     "in a native library; skipped" for key, prompts in self.deaths.items() if len(prompts) >= LIMIT}


def preflight(config: SweepConfig, store: ResultsStore) -> dict[str, set[str]]:
    """Each engine of the study decodes a few tokens in a child first; target name -> the engines left out (each
    said in one line, and kept in the database for the answer: `left_out`)."""
    checks = {} if not config.preflight_s else {
        check: name for name in config.targets for check in _checks_of(name, config)}
    verdicts = check_engines(list(checks), config.preflight_s) if checks else []
    left_out: dict[str, set[str]] = {}
    for verdict in verdicts:
        if not verdict.ok:
            print(f"sweep: {verdict.line}")
            for name in [n for check, n in checks.items() if check == verdict.check]:
                left_out.setdefault(name, set()).add(verdict.check.engine)
    store.set_meta(LEFT_OUT, json.dumps([v.line for v in verdicts if not v.ok]))
    return left_out


def _checks_of(name: str, config: SweepConfig):
    """The engines a study's target runs on (`preflight.engine_checks`)."""
    backend, source = target_backend(name, config.backend)
    return engine_checks(source, backend, config.device, config.dtype, bool(config.servers))


def skip_fatal(crashes: CrashLog, groups: list, targets: dict, store: ResultsStore, done: set) -> None:
    """Skip, on every prompt they have left, the cells that killed the process `LIMIT` times; one line each.
    `groups`: the sweep's; `targets`: its started targets (name -> `TargetRun`)."""
    for key, reason in crashes.fatal().items():
        cells = [(c, g, t) for g in groups for t, its in g.cells.items() if t in targets for c in its if c.key == key]
        pending = [(c, p, t) for c, g, t in cells for p in g.prompts if (c.key, p.id) not in done]
        for cell, prompt, name in pending:
            store.add_skip(cell, prompt.id, reason, targets[name].run_id)
            done.add((cell.key, prompt.id))
        if pending:
            print(f"sweep: {_words(key)} {reason}")


def fatal_file(store: ResultsStore) -> Path:
    """Beside the study's database: where a fatal signal's traceback is written while a sweep runs."""
    return store.path.with_name(store.path.name + ".fatal")


def _fatal_signal(path: Path) -> str:
    """The fatal error the last sweep's process wrote ('' when none: it ended, or was stopped from outside)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return next((line.removeprefix("Fatal Python error: ").strip()[:80] for line in lines if line.strip()), "")


def _restore_stderr_handler(was_enabled: bool) -> None:
    """Enable the fault handler on standard error again where it was on before (a test runner's, an embedding
    application's); a standard error without a file descriptor cannot take it."""
    if not was_enabled:
        return
    try:
        faulthandler.enable(file=sys.__stderr__)
    except (ValueError, AttributeError, OSError, RuntimeError):
        pass


def _read(text: str | None) -> dict:
    """A JSON object from the meta table; {} when it is missing, empty or damaged (the file is untrusted)."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _deaths(text: str | None) -> dict[str, list[str]]:
    """The stored deaths, keeping only well-formed entries."""
    return {key: [str(p) for p in prompts] for key, prompts in _read(text).items()
            if isinstance(prompts, list) and prompts}


def _words(key: str) -> str:
    """'target|method|drafter|k=K|...' -> 'target METHOD drafter K=K'."""
    target, method, drafter, k, *_ = key.split("|")
    return f"{target} {method.upper()} {drafter} {k.upper()}"

"""The scheduler above the engine's step: requests join and leave a running batch between steps.

`draftlab serve` decodes every request in flight with the engine's own step (`SpeculativeEngine.plan`, the target's
score, `SpeculativeEngine.settle`), one engine per slot of a `SlotBatch`, and scores all their blocks in one
llama.cpp decode (on torch, each slot's block in turn: `BackendSlots`): continuous batching, as vLLM's scheduler
does above its model runner. A slot's engine is the one `draftlab generate` runs (its drafter beside the others',
`Drafter.beside`), and the batch scores each row bitwise as alone, so each request's greedy tokens are those it gets
served alone, whatever else is in flight.

K follows the number of requests in flight (`LoadK`: the study's answer per concurrency level, 0 where speculation
stops paying). The scheduler runs in a thread of its own; requests come and go through `submit`, `cancel` and each
job's `emit` callback (called on the scheduler's thread). Waiting requests are bounded (`Busy` beyond).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from draftlab.backends.base import Backend
from draftlab.decoding.step import Scores
from draftlab.engine import GenerationConfig, GenerationResult, SpeculativeEngine
from draftlab.errors import DraftlabError
from draftlab.serving.metrics import ServeMetrics


class Busy(DraftlabError):
    """Every slot is busy and the waiting queue is full: the request is refused (HTTP 429)."""


@dataclass(frozen=True)
class LoadK:
    """K by the number of requests in flight: rows [lo, hi, K] as `deploy.per_batch_size` writes them (vLLM's
    `num_speculative_tokens_per_batch_size`); above the last row, its K."""

    rows: tuple[tuple[int, int, int], ...]

    @classmethod
    def fixed(cls, k: int) -> "LoadK":
        return cls(((1, 1 << 30, k),))

    @classmethod
    def parse(cls, text: str) -> "LoadK":
        """'1-2:6,3-4:3,5-8:0' -> rows; one line for anything else."""
        rows = []
        try:
            for item in text.split(","):
                span, k = item.split(":")
                lo, _, hi = span.partition("-")
                rows.append((int(lo), int(hi or lo), int(k)))
        except ValueError:
            raise DraftlabError(f"--k-per-load takes rows like 1-2:6,3-4:3,5-8:0, not {text!r}") from None
        if any(lo < 1 or hi < lo or k < 0 for lo, hi, k in rows) or rows[0][0] != 1 or any(
                b[0] != a[1] + 1 for a, b in zip(rows, rows[1:])):
            raise DraftlabError(f"--k-per-load rows must run on from 1 without gaps, each K >= 0: {text!r}")
        return cls(tuple(rows))

    def at(self, in_flight: int) -> int:
        """K with that many requests in flight."""
        return next((k for lo, hi, k in self.rows if lo <= in_flight <= hi), self.rows[-1][2])

    def text(self) -> str:
        """The flag's value."""
        return ",".join(f"{lo}-{hi}:{k}" if hi > lo else f"{lo}:{k}" for lo, hi, k in self.rows)


@dataclass
class LoadPolicy:
    """A slot's `DraftLengthPolicy`: K for the number of requests in flight now."""

    ks: LoadK
    in_flight: Callable[[], int]

    def begin(self) -> None:
        """Nothing to reset."""

    def next_k(self) -> int:
        return self.ks.at(self.in_flight())

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """K does not adapt to acceptance."""


class SlotBatch(Protocol):
    """The backend below the scheduler: a slot per request in flight (`LlamaCppBatch`: one llama.cpp decode for
    all; `BackendSlots`: torch backends in turn), each slot's rows bitwise those of its request alone."""

    n_ctx: int  # tokens a slot holds

    def view(self, slot: int) -> Backend:
        """The slot as a backend of its own, for its engine (prefill, keep, rollback)."""

    def score(self, blocks: dict[int, Sequence[int]], last_only: bool = False) -> dict[int, torch.Tensor]:
        """Every slot's chain appended to its cache; logits [n, V] per slot."""

    def rollback(self, slot: int, length: int) -> None:
        """Keep a slot's first `length` tokens."""


@dataclass
class Job:
    """One request: its prompt and settings, and where its tokens go (`emit(kind, value)` on the scheduler's thread:
    ('tokens', list[int]) per step, then ('done', GenerationResult) or ('error', str))."""

    prompt: list[int]
    config: GenerationConfig
    emit: Callable[[str, object], None]
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class _Active:
    job: Job
    run: object  # the engine's `Generation`
    last_token_at: float


class Scheduler:
    """Admits jobs into free slots, steps every active one in one batched decode, retires the finished."""

    def __init__(self, batch: SlotBatch, engines: list[SpeculativeEngine], max_waiting: int,
                 metrics: ServeMetrics) -> None:
        """`engines`: one per slot of `batch`, each over `batch.view(slot)`."""
        self.batch, self.engines, self.max_waiting, self.metrics = batch, engines, max_waiting, metrics
        self._waiting: deque[Job] = deque()
        self._active: dict[int, _Active] = {}
        self._starting = 0  # jobs taken off the queue whose prompts are prefilling (in neither list meanwhile)
        self._lock = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="draftlab-scheduler", daemon=True)

    @property
    def in_flight(self) -> int:
        """Requests being decoded now."""
        return len(self._active)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job; `Busy` when the queue is full, a `DraftlabError` once stopping."""
        with self._lock:
            if self._stopping:
                raise DraftlabError("the server is shutting down")
            if len(self._waiting) + self._starting + len(self._active) >= len(self.engines) + self.max_waiting:
                raise Busy(f"the server is busy: {len(self._active)} requests in flight and {len(self._waiting)} "
                           f"waiting (the most it holds); retry later")
            self._waiting.append(job)
            self.metrics.waiting = len(self._waiting)
            self._lock.notify()

    def stop(self) -> None:
        """Finish what is in flight and waiting, then end the thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._active and not self._waiting and not self._stopping:
                    self._lock.wait()
                if self._stopping and not self._active and not self._waiting:
                    return
            try:
                self._admit()
                if self._active:
                    self._step()
            except Exception as exc:  # a fault of one step: its requests end with it, the server goes on
                for slot in list(self._active):
                    self._retire(slot, error=f"the step failed: {type(exc).__name__}: {exc}")

    def _admit(self) -> None:
        """Move waiting jobs into free slots (lowest first), prefilling each; a job that cannot start says why."""
        while len(self._active) < len(self.engines):
            with self._lock:
                if not self._waiting:
                    return
                job = self._waiting.popleft()
                self._starting += 1
                self.metrics.waiting = len(self._waiting)
            try:
                self._start(job)
            finally:
                with self._lock:
                    self._starting -= 1

    def _start(self, job: Job) -> None:
        """Prefill a job's prompt into the lowest free slot (a cancelled or failing job says why instead)."""
        if job.cancelled:
            self.metrics.finished("cancelled")
            job.emit("error", "cancelled")
            return
        slot = min(set(range(len(self.engines))) - set(self._active))
        try:
            run = self.engines[slot].start(job.prompt, job.config)
        except Exception as exc:  # a prompt it cannot prefill (or a fault of the prefill): this job alone ends
            self.metrics.finished("error")
            job.emit("error", str(exc) if isinstance(exc, DraftlabError) else f"{type(exc).__name__}: {exc}")
            return
        self._active[slot] = _Active(job, run, time.perf_counter())
        self.metrics.admitted(len(job.prompt), time.perf_counter() - job.submitted)

    def _step(self) -> None:
        """One step of every active job: plan each, score every block in one decode, settle each."""
        plans = {slot: self.engines[slot].plan(a.run) for slot, a in self._active.items()}
        self.metrics.step(len(plans), max(len(p.proposal.tokens) for p in plans.values()))
        try:
            logits = self.batch.score({slot: plan.block.tokens for slot, plan in plans.items()})  # [n, V] per slot
        except DraftlabError as exc:
            for slot in list(self._active):
                self._retire(slot, error=str(exc))
            return
        now = time.perf_counter()
        for slot, plan in plans.items():
            active = self._active[slot]
            kept = self.engines[slot].settle(active.run, plan, Scores(logits[slot]))
            self.metrics.tokens(len(plan.proposal.tokens), len(kept), now - active.last_token_at)
            active.last_token_at = now
            active.job.emit("tokens", kept)
            if active.run.done or active.job.cancelled:
                self._retire(slot)

    def _retire(self, slot: int, error: str = "") -> None:
        """End a slot's job (its drafter hears the sequence) and free the slot."""
        active = self._active.pop(slot)
        result: GenerationResult = self.engines[slot].finish(active.run)
        self.batch.rollback(slot, 0)
        self.metrics.finished(error or ("cancelled" if active.job.cancelled else "ok"))
        if error:
            active.job.emit("error", error)
        else:
            active.job.emit("done", result)

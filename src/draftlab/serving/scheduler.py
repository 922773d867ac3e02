"""The scheduler above the engine's step: requests join and leave a running batch between steps.

`draftlab serve` decodes every request in flight with one engine's step (`SpeculativeEngine.step`: each run drafts,
one call scores every block, each verifies and commits), the step `draftlab generate` runs for a batch of one. Each
request runs on a lane of its own (`SpeculativeEngine.lane_for`: its slot's sequence of the target, a drafter beside
the others'), and the target's `Sequences` score each row bitwise as alone, so each request's greedy tokens are
those it gets served alone, whatever else is in flight: continuous batching, as vLLM's scheduler does above its
model runner. The step's chooser sets every run's K (`--k auto`: by expected tokens per second; `--k-per-load`: by
the number in flight).

A prompt prefills a chunk at a time (the target's `prefill_chunk`, at fixed offsets, so its cache is the one a whole
prefill leaves) between the steps of the requests decoding: a long prompt never holds the others for its whole
prefill. Among the prompts still prefilling, the one with the fewest tokens left goes first (`next_prefill`), so a
short prompt arriving behind a long one's chunks waits one chunk, not all of them; a prompt passed over
`PASSED_OVER_AT_MOST` times goes next, so none waits for good. Where the target's cells allow it
(`Sequences.keeps_prefixes`), a retired request's cells stay in its slot and a later prompt that starts with its
tokens reuses them (`serving.prefixes`: a chat's next turn). The scheduler only admits, prefills, steps and retires;
nothing below it reads back up. It runs in a thread of its own; requests come and go through `submit`, `cancel` and
each job's `emit` callback (called on the scheduler's thread). Waiting requests are bounded (`Busy` beyond).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from draftlab.decoding.kchoice import LoadK
from draftlab.generation import Generation, GenerationResult, Lane
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.errors import DraftlabError
from draftlab.serving.metrics import ServeMetrics
from draftlab.serving.prefixes import SlotPrefixes

__all__ = ["Busy", "Job", "LoadK", "Scheduler", "next_prefill"]

PASSED_OVER_AT_MOST = 3  # a prompt whose chunk was put off this many times for shorter prompts prefills next


class Busy(DraftlabError):
    """Every slot is busy and the waiting queue is full: the request is refused (HTTP 429)."""


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
    run: Generation
    last_token_at: float = 0.0  # when its prompt was prefilled, then its last step
    passed_over: int = 0  # prefill turns given to shorter prompts since its last chunk


class Scheduler:
    """Admits jobs into free slots, prefills their prompts a chunk at a time, steps every prefilled one in the
    engine's step, retires the finished."""

    def __init__(self, engine: SpeculativeEngine, slots: int, max_waiting: int, metrics: ServeMetrics,
                 keep_prompts: bool = True) -> None:
        """`engine`: over the target's sequences, one per slot; its chooser sets K. `keep_prompts`: a retired
        request's cells stay in its slot for a later prompt that starts with its tokens (where the target's cells
        allow it)."""
        self.engine, self.max_waiting, self.metrics = engine, max_waiting, metrics
        self.lanes: list[Lane] = [engine.lane_for(slot) for slot in range(slots)]
        # A drafter reading the target's hidden states needs them for every prompt token: it prefills every prompt.
        reuse = keep_prompts and engine.sequences.keeps_prefixes and not engine.reads_hidden
        self.prefixes = SlotPrefixes(slots) if reuse else None
        self._waiting: deque[Job] = deque()
        self._active: dict[int, _Active] = {}  # by slot, in the order admitted: prefilling, then decoding
        self._lock = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="draftlab-scheduler", daemon=True)

    @property
    def in_flight(self) -> int:
        """Requests holding a slot now (prefilling or decoding)."""
        return len(self._active)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job; `Busy` when the queue is full, a `DraftlabError` once stopping."""
        with self._lock:
            if self._stopping:
                raise DraftlabError("the server is shutting down")
            if len(self._waiting) + len(self._active) >= len(self.lanes) + self.max_waiting:
                raise Busy(f"the server is busy: {len(self._active)} requests in flight and {len(self._waiting)} "
                           f"waiting (the most it holds); retry later")
            self._waiting.append(job)
            self.metrics.queued(len(self._waiting))
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
                    self.metrics.idle()
                    self._lock.wait()
                if self._stopping and not self._active and not self._waiting:
                    self.metrics.idle()
                    return
            try:
                self._admit()
                self._step()  # before the next chunk: a request admitted ready (its prompt cached) waits for none
                self._prefill_one()
            except Exception as exc:  # a fault of one step: its requests end with it, the server goes on
                for slot in list(self._active):
                    self._retire(slot, error=f"the step failed: {type(exc).__name__}: {exc}")

    def _admit(self) -> None:
        """Move waiting jobs into free slots (lowest first); a job that cannot start says why."""
        while len(self._active) < len(self.lanes):
            with self._lock:
                if not self._waiting:
                    return
                job = self._waiting.popleft()
                self.metrics.queued(len(self._waiting))
            if job.cancelled:
                self.metrics.finished("cancelled")
                job.emit("error", "cancelled")
                continue
            slot, cached = self._slot_for(job.prompt)
            try:
                run = self.engine.start(job.prompt, job.config, lambda kept, job=job: job.emit("tokens", kept),
                                        lane=self.lanes[slot], prefill=False, cached=cached)
            except DraftlabError as exc:  # a prompt it cannot take: this job alone ends
                self.metrics.finished("error")
                job.emit("error", str(exc))
                continue
            self._active[slot] = _Active(job, run)
            self.metrics.prompt_cached(len(job.prompt), cached)
            if run.ready:  # every token but the last was cached: it steps at once
                self._ready(self._active[slot])

    def _slot_for(self, prompt: list[int]) -> tuple[int, int]:
        """A free slot for a prompt and the tokens of its cells the prompt reuses (the rest rolled back)."""
        free = set(range(len(self.lanes))) - set(self._active)
        if self.prefixes is None:
            slot, cached = min(free), 0
        else:
            slot, cached = self.prefixes.pick(prompt, free)
            self.prefixes.hold(slot, prompt[:cached])
        self.engine.sequences.rollback(slot, cached)
        return slot, cached

    def _prefill_one(self) -> None:
        """One chunk of the prompt `next_prefill` picks among those still prefilling (beside the decoding requests'
        step); a prompt once prefilled joins the next step."""
        prefilling = {s: a for s, a in self._active.items() if not a.run.ready}  # in the order admitted
        if not prefilling:
            return
        slot = next_prefill({s: (a.run.prompt_length - 1 - a.run.prefilled, a.passed_over)
                             for s, a in prefilling.items()})
        for other, waiting in prefilling.items():
            waiting.passed_over = 0 if other == slot else waiting.passed_over + 1
        active = self._active[slot]
        if active.job.cancelled:
            self._retire(slot)
            return
        try:
            self.engine.prefill_part(active.run)
        except Exception as exc:  # a fault of this prompt's prefill: this job alone ends
            self._retire(slot, error=str(exc) if isinstance(exc, DraftlabError) else f"{type(exc).__name__}: {exc}")
            return
        self.metrics.prefilled(beside=sum(a.run.ready for a in self._active.values()))
        if active.run.ready:
            self._ready(active)

    def _ready(self, active: _Active) -> None:
        """A prompt prefilled: it joins the next step."""
        active.last_token_at = time.perf_counter()
        self.metrics.admitted(active.run.prompt_length)

    def _step(self) -> None:
        """One engine step of every prefilled job."""
        ready = {slot: a for slot, a in self._active.items() if a.run.ready}
        if not ready:
            return
        try:
            stepped = self.engine.step([a.run for a in ready.values()])
        except DraftlabError as exc:
            for slot in ready:
                self._retire(slot, error=str(exc))
            return
        now = time.perf_counter()
        self.metrics.step(len(ready), stepped.drafted, stepped.rows)
        for (slot, active), drafted, committed in zip(ready.items(), stepped.drafted, stepped.committed):
            if active.run.stats.steps == 1:
                self.metrics.first_token(now - active.job.submitted)
            self.metrics.tokens(drafted, committed, now - active.last_token_at)
            active.last_token_at = now
            if active.run.done or active.job.cancelled:
                self._retire(slot)

    def _retire(self, slot: int, error: str = "") -> None:
        """End a slot's job (its drafter hears the sequence) and free the slot."""
        active = self._active.pop(slot)
        result: GenerationResult = self.engine.finish(active.run)
        self._keep_or_empty(slot, active.run, error)
        outcome = "error" if error else "cancelled" if active.job.cancelled else "ok"
        self.metrics.finished(outcome, time.perf_counter() - active.job.submitted)
        if error:
            active.job.emit("error", error)
        else:
            active.job.emit("done", result)

    def _keep_or_empty(self, slot: int, run: Generation, error: str) -> None:
        """A retired slot keeps its cells for a later prompt that starts with its tokens (not after a fault: what its
        cells hold is then unknown), else is emptied."""
        sequences = self.engine.sequences
        if self.prefixes is None or error:
            sequences.rollback(slot, 0)
            if self.prefixes is not None:
                self.prefixes.forget(slot)
            return
        self.prefixes.hold(slot, run.tokens[:sequences.length(slot)])


def next_prefill(prefilling: dict[int, tuple[int, int]]) -> int:
    """The slot whose prompt prefills a chunk next, of {slot: (tokens left to prefill, turns passed over)} in the
    order admitted: the first passed over `PASSED_OVER_AT_MOST` times, else the one with the fewest tokens left
    (the first admitted of equals)."""
    overdue = [slot for slot, (_, passed) in prefilling.items() if passed >= PASSED_OVER_AT_MOST]
    if overdue:
        return overdue[0]
    return min(prefilling, key=lambda slot: prefilling[slot][0])

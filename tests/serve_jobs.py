"""Requests submitted to a served scheduler in-process, as the serve tests drive it."""

from __future__ import annotations

import threading
import time

from draftlab.engine import GenerationConfig
from draftlab.serving.scheduler import Job


def serve_jobs(served, jobs: list[tuple[list[int], int, float]]) -> list[list[int]]:
    """Submit (prompt, max tokens, delay after the previous) and wait for every answer's tokens."""
    answers: list[list[int]] = [[] for _ in jobs]
    done = [threading.Event() for _ in jobs]

    def sink(i: int):
        def emit(kind: str, value) -> None:
            if kind == "tokens":
                answers[i].extend(value)
            else:
                assert kind == "done", value
                done[i].set()
        return emit

    for i, (ids, tokens, delay) in enumerate(jobs):
        time.sleep(delay)
        served.scheduler.submit(Job(ids, GenerationConfig(max_new_tokens=tokens, eos_token_ids=served.eos_ids),
                                    sink(i)))
    assert all(event.wait(120) for event in done)
    return answers

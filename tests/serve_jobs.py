"""What the serve tests share: the served SmolLM2 and its held-out prompts (module fixtures), and requests submitted
to a served scheduler in-process."""

from __future__ import annotations

import threading
import time

import pytest

from draftlab.api import prompt_ids
from draftlab.engine import GenerationConfig
from draftlab.files.datasets import load_prompts
from draftlab.models import load_model
from draftlab.serving.scheduler import Job

TARGET = "smollm2-135m@Q4_0_PURE"  # the served target: SmolLM2 in pure Q4_0 on the exact kernels


@pytest.fixture(scope="module")
def target():
    return load_model(TARGET, backend="llamacpp")


@pytest.fixture(scope="module")
def prompts(target):
    return [prompt_ids(target.tokenizer, p) for p in load_prompts("heldout", 8)]


def serve_jobs(served, jobs: list[tuple[list[int], int, float]]) -> list[list[int]]:
    """Submit (prompt, max tokens, delay after the previous), greedy, and wait for every answer's tokens."""
    return serve_configs(served, [(ids, GenerationConfig(max_new_tokens=tokens, eos_token_ids=served.eos_ids), delay)
                                  for ids, tokens, delay in jobs])


def serve_configs(served, jobs: list[tuple[list[int], GenerationConfig, float]]) -> list[list[int]]:
    """Submit (prompt, its settings, delay after the previous) and wait for every answer's tokens."""
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

    for i, (ids, config, delay) in enumerate(jobs):
        time.sleep(delay)
        served.scheduler.submit(Job(ids, config, sink(i)))
    assert all(event.wait(120) for event in done)
    return answers

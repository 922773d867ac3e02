"""Prompts cached across requests in `draftlab serve` on the real SmolLM2 (pure Q4_0 on the exact kernels): a
retired request's cells stay in its slot, and a prompt that starts with its tokens (a chat's next turn: the earlier
turn and its answer resent) reuses them; each answer stays the one `draftlab generate` gives the whole prompt alone."""

from __future__ import annotations

import pytest
import torch

from draftlab.api import SpeculativeDecoder
from draftlab.backends.llamacpp_sequences import LlamaCppSequences
from draftlab.serving.build import ServeSettings, build_served
from draftlab.serving.scheduler import LoadK
from tests.serve_jobs import TARGET, prompts, serve_jobs, target  # noqa: F401 (the fixtures)

pytestmark = pytest.mark.integration
TOKENS = 24


def test_a_prefix_decoded_in_steps_gives_the_rows_its_prefill_gives(target, prompts):
    """The ground of the cache: a slot whose cells came from steps' blocks (a prompt, then blocks of 1-5 rows as
    decoding leaves them) scores the next block bitwise as a slot that prefilled the same tokens in one chunk."""
    batch = LlamaCppSequences(target.model, 2, 1024)
    assert batch.keeps_prefixes
    tokens = prompts[0] + prompts[1][:37]
    batch.prefill(0, prompts[0], final=True)
    at = len(prompts[0])
    for size in (1, 5, 2, 3, 1, 4) * 4:  # the rest as a decode's blocks would add them
        if at < len(tokens):
            batch.score({0: tokens[at:at + size]})
            at = min(at + size, len(tokens))
    batch.prefill(1, tokens, final=True)
    assert batch.length(0) == batch.length(1) == len(tokens)
    block = prompts[2][:6]
    rows = batch.score({0: block, 1: block})  # logits [6, V] per slot
    assert torch.equal(rows[0], rows[1])


def test_a_chats_next_turn_reuses_its_slots_cells_and_decodes_as_the_whole_prompt_alone(target, prompts):
    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1, backend="llamacpp")

    def alone(ids: list[int]) -> list[int]:
        return plain.generate(ids, max_new_tokens=TOKENS, temperature=0).token_ids

    served = build_served(ServeSettings(TARGET, "ngram", LoadK.fixed(3), slots=2, context=2048))
    served.scheduler.start()
    try:
        first = prompts[0]
        [answer] = serve_jobs(served, [(first, TOKENS, 0.0)])
        assert served.metrics.prefix_hits == 0
        second = first + answer + prompts[1]  # the next turn: the first turn and its answer, then more
        third = first[:len(first) // 2] + prompts[2]  # half the first prompt, then another
        answers = serve_jobs(served, [(second, TOKENS, 0.0), (prompts[3], TOKENS, 0.0)])
        assert served.metrics.prefix_hits >= len(first) + len(answer) - 1  # the answer's cells too
        hits = served.metrics.prefix_hits
        answers += serve_jobs(served, [(third, TOKENS, 0.0)])
        assert served.metrics.prefix_hits >= hits + len(first) // 2
    finally:
        served.scheduler.stop()
    assert answer == alone(first)
    assert answers == [alone(second), alone(prompts[3]), alone(third)]


def test_without_the_prompt_cache_nothing_is_reused(target, prompts):
    served = build_served(ServeSettings(TARGET, "none", LoadK.fixed(0), slots=1, context=2048, prompt_cache=False))
    served.scheduler.start()
    try:
        [answer] = serve_jobs(served, [(prompts[0], 8, 0.0)])
        serve_jobs(served, [(prompts[0] + answer + prompts[1], 8, 0.0)])
    finally:
        served.scheduler.stop()
    assert served.scheduler.prefixes is None and served.metrics.prefix_hits == 0

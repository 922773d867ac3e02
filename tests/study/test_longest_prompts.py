"""Every method and peer of the quick and family presets on the longest prompt of every shipped prompt set.

Each (cell, prompt) must end as a record or as a skip with a one-line reason: never a traceback that ends the
study. The quick study once died on llama-cpp-python's prompt lookup with a 1344-token prompt (its score buffer
held 512 rows); these prompts run up to 4826 tokens. CI runs the quick preset's methods on a 700-token cut of the
longest prompt and on the longest conversation; the whole grids on every longest prompt are `exhaustive`.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from draftlab.files.datasets import DATASETS, load_prompts, prompt_line
from draftlab.study.run.store import ResultsStore
from draftlab.study.run.sweep import make_config, run_sweep

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def longest_prompts() -> list:
    """The longest prompt of every shipped set (by characters, earlier turns included), each once."""
    chosen = {}
    for name in DATASETS:
        prompt = max(load_prompts(name), key=lambda p: len(p.text) + sum(map(len, p.history)))
        chosen.setdefault(prompt.id, prompt)
    return list(chosen.values())


def long_prompt_and_turns(characters: int = 3000) -> list:
    """The longest shipped prompt cut to `characters` (about 700 tokens: past the 512-row buffer that once crashed
    llama-cpp-python's lookup at 1344 tokens) and the longest multi-turn prompt: CI's share of this file."""
    longest = longest_prompts()
    article = max(longest, key=lambda p: len(p.text))
    turns = max((p for p in longest if p.history), key=lambda p: sum(map(len, p.history)))
    return [replace(article, id=f"{article.id}-cut", text=article.text[:characters]), turns]


def run_preset(tmp_path, preset: str, prompts: list | None = None, **overrides):
    """The preset's grid on the longest prompts (or `prompts`), 4 new tokens each, the whole grid (no race);
    (config, prompts, {(cell, prompt id): None for a record, else the skip's reason})."""
    prompts = prompts or longest_prompts()
    path = tmp_path / "longest.jsonl"
    path.write_text("".join(prompt_line(p) for p in prompts), encoding="utf-8")
    config = replace(make_config(preset), datasets=(str(path),), limit=len(prompts), max_new_tokens=4, warmup=0,
                     baseline_every=0, race_after=0, budget_s=0, **overrides)
    store = ResultsStore(tmp_path / "study.sqlite")
    run_sweep(config, store, progress=False)
    outcome = {(r["cell"], r["prompt_id"]): None for r in store.rows()}
    outcome.update({(s["cell"], s["prompt_id"]): s["reason"] for s in store.skips()})
    store.close()
    return config, prompts, outcome


def check_every_cell_ended(config, prompts, outcome) -> set[tuple[str, str]]:
    """Every cell that ran has a record or a one-line skip on every prompt; returns (target, method) pairs seen."""
    cells = {key for key, _ in outcome}
    for cell in cells:
        for prompt in prompts:
            assert (cell, prompt.id) in outcome, f"{cell} has neither a record nor a skip on {prompt.id}"
    for reason in filter(None, outcome.values()):
        assert "\n" not in reason and "Traceback" not in reason and len(reason) > 10
    return {(key.split("|")[0], key.split("|")[1]) for key in cells}


@pytest.mark.slow
@pytest.mark.exhaustive  # CI's time (77 s): CI's ./run.sh runs the quick preset on its 8 prompts, articles included
def test_quick_presets_methods_on_a_long_prompt_and_a_conversation(tmp_path):
    """Every method and peer of the quick preset (n-gram drafts only) on a 700-token prompt and a multi-turn one."""
    config, prompts, outcome = run_preset(tmp_path, "quick", long_prompt_and_turns(), ks=(1,), drafters=("ngram",))
    seen = check_every_cell_ended(config, prompts, outcome)
    torch_target, llamacpp_target = config.targets
    assert {m for t, m in seen if t == torch_target} >= {"ar", "plain", "sps", "asg", "hf"}
    assert {m for t, m in seen if t == llamacpp_target} >= {"ar", "plain", "sps", "lcp", "llama", "server-ar", "server"}
    lookup = [reason for (cell, _), reason in outcome.items() if "|lcp|" in cell]
    assert lookup and lookup.count(None) == len(lookup)  # llama-cpp-python's prompt lookup ran them


@pytest.mark.slow
@pytest.mark.exhaustive
def test_quick_preset_on_the_longest_prompts(tmp_path):
    config, prompts, outcome = run_preset(tmp_path, "quick", ks=(1,))  # every method and draft; K changes no length
    seen = check_every_cell_ended(config, prompts, outcome)
    assert max(len(p.text) for p in prompts) > 10_000  # the 4826-token article is among them
    torch_target, llamacpp_target = config.targets
    assert {m for t, m in seen if t == torch_target} >= {"ar", "plain", "sps", "asg", "hf"}
    assert {m for t, m in seen if t == llamacpp_target} >= {"ar", "plain", "sps", "lcp", "llama"}
    # llama-cpp-python's prompt lookup ran the long prompts, not only skipped them
    lookup = [reason for (cell, _), reason in outcome.items() if "|lcp|" in cell]
    assert lookup and lookup.count(None) == len(lookup)


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.skipif(not os.environ.get("DRAFTLAB_QWEN"), reason="DRAFTLAB_QWEN=1 runs the Qwen2.5-Coder pair")
def test_family_preset_on_llamacpp_on_the_longest_prompts(tmp_path):
    """The family preset's cells that run on llama.cpp (its torch cells take hours on a CPU with these prompts)."""
    config, prompts, outcome = run_preset(tmp_path, "family", backend="llamacpp", ks=(2,))
    seen = check_every_cell_ended(config, prompts, outcome)
    assert {m for _, m in seen} >= {"ar", "sps", "lcp", "llama"}

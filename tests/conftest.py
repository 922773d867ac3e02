"""Tiny random-init models for fast unit tests: no download, a few ms per forward."""

from __future__ import annotations

import os

import pytest
import torch

from draftlab.backends.hf import HFBackend
from draftlab.models import LoadedModel


# The tiers (the README's command, `slow`, `exhaustive`) are marked on the tests themselves: tests/tiers.py.


EVERY_CORE = pytest.StashKey[set]()  # an xdist worker's cores before it was pinned to one


def pytest_configure(config) -> None:
    """Under `pytest -n N` (pytest-xdist; CI's slow stage) each worker runs on a core of its own, as
    `taskset -c CORE` would: torch, llama.cpp and the servers a test starts (they inherit it) take one thread each,
    where workers sharing every core would run twice the threads, and llama.cpp's threads spin at each barrier."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...: set in each worker by pytest-xdist
    if not worker.startswith("gw") or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    config.stash[EVERY_CORE] = set(cores)
    os.sched_setaffinity(0, {cores[int(worker[2:]) % len(cores)]})
    torch.set_num_threads(1)


@pytest.fixture
def every_core(request):
    """The host's every core for one test that runs llama.cpp on 2 threads of its own choosing (an xdist worker
    runs on one: its threads would take turns spinning on it)."""
    cores = request.config.stash.get(EVERY_CORE, None)
    if cores is None:
        yield
        return
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)


def tiny_llama(vocab: int = 64, layers: int = 4, seed: int = 0, hidden: int = 32) -> LoadedModel:
    """A random LlamaForCausalLM small enough to run thousands of steps in a test."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    # Larger logits make the random model's choices less uniform, closer to a trained LM.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.requires_grad_(False)
    return LoadedModel(f"tiny-{seed}", model, None, torch.device("cpu"), torch.float32)


def noisy_copy(model: LoadedModel, scale: float, seed: int = 1) -> LoadedModel:
    """A copy of `model` with Gaussian noise on every weight: a draft that agrees often but not always."""
    import copy

    generator = torch.Generator().manual_seed(seed)
    clone = copy.deepcopy(model.model)
    with torch.no_grad():
        for param in clone.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale * param.std())
    return LoadedModel(f"{model.name}-noisy", clone, None, model.device, model.dtype)


@pytest.fixture(scope="session")
def tiny_target() -> LoadedModel:
    return tiny_llama()


@pytest.fixture(scope="session")
def tiny_backend(tiny_target) -> HFBackend:
    return HFBackend(tiny_target.model)


def tiny_model_dir(path, vocab: int = 64, layers: int = 4, seed: int = 0):
    """A tiny Llama saved as an HF directory with a word-level tokenizer ('w0' .. 'w63'), for CLI tests."""
    return save_model_dir(path, tiny_llama(vocab=vocab, layers=layers, seed=seed).model, vocab)


def shape_model_dir(path, shape: str, layers: int, dtype: torch.dtype, device: str = "cpu"):
    """Random weights in a real model's shape (`checks.exactness.SHAPES`, `layers` of them) saved as an HF
    directory with a word-level tokenizer over its whole vocabulary: a target any command loads by path."""
    from draftlab.checks.exactness import SHAPES, random_model

    return save_model_dir(path, random_model(SHAPES[shape], dtype, device, layers=layers), SHAPES[shape].vocab)


def save_model_dir(path, model, vocab: int):
    """A model and a word-level tokenizer ('w0' .. 'w{vocab-2}', then '[UNK]') saved as an HF directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab - 1)}
    words["[UNK]"] = vocab - 1
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


def feature_study(root, prompts: int):
    """A tiny target directory, a feature draft for it and a prompt file of `prompts` code prompts, under `root`:
    what a sweep with adapting cells needs. Returns (model dir, draft dir, prompt file)."""
    import json

    from draftlab.drafters.feature import new_feature_draft, save_feature_draft
    from draftlab.models import load_model

    model = tiny_model_dir(root / "tiny")
    target = load_model(str(model), dtype="fp32")
    draft = save_feature_draft(new_feature_draft(target, torch.arange(64)), root / "feature", target.name)
    path = root / "prompts.jsonl"
    path.write_text("".join(
        json.dumps({"prompt": " ".join(f"w{(i * 5 + j) % 60}" for j in range(10)), "category": "code", "id": f"q{i}"})
        + "\n" for i in range(prompts)))
    return model, draft, path


def older_database_file(path, version: str, dropped: tuple[str, ...] = (), record=None) -> None:
    """Make `path` what an older draftlab wrote: a results database (holding `record`, if given) at schema
    `version`, without the `dropped` columns and without the tables that came later; left closed, not migrated."""
    import sqlite3

    from draftlab.study.run.store import ResultsStore

    store = ResultsStore(path)
    if record is not None:
        store.add(record, store.start_run({}))
    store.close()
    conn = sqlite3.connect(path)
    dropped = (*dropped, *(("concurrency", "window_tokens", "latency_s") if int(version) < 7 else ()))
    conn.executescript("".join(f"ALTER TABLE records DROP COLUMN {column}; " for column in dropped) +
                       ("DROP TABLE skips; " if int(version) < 6 else "") +
                       f"UPDATE meta SET value = '{version}' WHERE key = 'schema_version';")
    conn.close()

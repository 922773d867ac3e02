"""Tiny random-init models for fast unit tests: no download, a few ms per forward; and which slow tests are
the exhaustive matrices."""

from __future__ import annotations

import re

import pytest
import torch

from draftlab.backends.hf import HFBackend
from draftlab.models import LoadedModel


# The slow suite's full matrices. `pytest -m slow` runs every test; CI runs `-m "slow and not exhaustive"`: per
# drafter, engine and sampling mode one representative (a middle K, one temperature, one tree shape), which fits
# CI's time on the slowest hosts of its machine kind (on an AVX2-only host the whole slow suite runs over an hour;
# what CI keeps, about 20 minutes). The tests named here differ from a kept one (or from one of the default run) only
# in K, temperature, top-p/top-k, tree shape, dtype, draft or prompt length.
EXHAUSTIVE = tuple(re.compile(p) for p in (
    r"test_llamacpp\.py::test_greedy_equals_plain_decoding_on_llamacpp\[.*-(1|2|5|8|\d_1)\]$",  # _1: the default run's
    r"test_llamacpp\.py::test_the_audit_passes_on_llamacpp",  # test_smollm2's audit runs the same audit in CI
    # 193 s in CI since the server runs K-quants without repack (exact); the SmolLM2 EAGLE-3 server test stays in CI
    r"test_eagle3_llama_server\.py::test_an_eagle3_draft_trained_here_drafts_for_the_qwen_target",
    # CI's time: the two-thread case of every type stays; these two run under `pytest -m slow`
    r"test_exact_kernels\.py::test_block_rows_are_bitwise_single_rows_for_every_weight_type\[smollm2-135m(@.*)?-1\]",
    r"test_exact_kernels\.py::test_a_k_quant_file_loads_without_repack",
    # CI's time (39 min on an AVX-512 host): the ten-kill sweep (113 s; test_sweep_resume's killed sweep stays), the
    # Qwen greedy test on llama.cpp (85 s; SmolLM2's llama.cpp greedy tests stay), EAGLE-3 losslessness in fp32 (40 s;
    # its bf16 case, bit for bit, stays)
    r"test_kill_resume\.py::test_a_sweep_killed_ten_times",
    r"test_qwen_llamacpp\.py::test_greedy_equals_plain_decoding_on_llamacpp\[ngram\]",
    r"test_smollm2\.py::test_the_eagle3_draft_chains_and_trees_are_lossless\[fp32\]",
    r"test_qwen_llamacpp\.py::test_greedy_equals_plain_decoding_on_llamacpp\[(tree|merged|staged|model):",
    r"test_qwen_pair\.py::test_greedy_with_each_draft_equals_autoregressive\[(model:qwen2\.5-coder-0\.5b|layers)",
    r"test_qwen_pair\.py::test_cut_vocabulary",
    r"test_smollm2\.py::test_greedy_equals_autoregressive_fp32\[layers:",
    r"test_smollm2\.py::test_designed_draft_and_trees_are_lossless\[(tree:dyn|tree:2:layers)",
    r"test_smollm2\.py::test_greedy_equals_autoregressive_bf16_bit_for_bit\[(layers|tree)",
    r"test_suffix_models\.py::.*\[suffix:tree",
    r"test_adapt_models\.py::test_adapting_(tree_greedy_equals_plain_decoding\[5\]|designed_draft.*bf16)",
    r"test_longest_prompts\.py::test_(quick|family)_preset_on",
    r"test_engine_sampling\.py::test_engine_joint_distribution_equals_target\[(noisy-t0\.8-top3|noisy-t1-top0\.85|"
    r"adversarial-t1\]|adversarial-t1-top0\.85)",
    r"test_engine_sampling\.py::test_(ngram|suffix)_drafts_keep_the_joint_distribution\[(t1-top0\.85|.*tree)",
    r"test_adapt\.py::test_adaptation_keeps_the_joint_distribution\[t1-top0\.85\]",
    r"test_feature_draft\.py::test_feature_draft_keeps_the_joint_distribution\[t1-top0\.85\]",
    r"test_eagle3\.py::test_eagle3_keeps_the_joint_distribution\[t1-top0\.85\]",  # CI keeps its [t1]
    r"test_heads\.py::test_heads_keep_the_joint_distribution\[(t0\.8-top3|t1-None)",
    r"test_staged\.py::test_staged_sampling_keeps_the_joint_distribution\[(noisy-t0\.8|adversarial-t1|"
    r"noisy-t1-constant|adversarial-t0\.8-top3-ngram)",
    r"test_trees\.py::test_tree_sampling_keeps_the_joint_distribution\[(noisy-t0\.8-top3|adversarial-t1-|"
    r"adversarial-t0\.8-top3-(2x2|2@auto)|noisy-t1-dyn)",
    r"test_trees\.py::test_feature_tree_sampling_keeps_the_joint_distribution\[t1-top0\.85\]",
    r"test_trees\.py::test_merged_tree_sampling_keeps_the_joint_distribution\[(noisy-constant|adversarial-ngram|"
    r"noisy-ngram-2x2|adversarial-constant-1)",
))


# The README's test command is a fast, broad check of an install (minutes, on any host): the unit tests on tiny random
# models, and one real-model smoke test per engine (SMOKE: torch, llama.cpp, llama-server, and what the build
# installed). Every other real-model test (tests/integration/) and the long subprocess, server and training suites
# (LONG: each took 5 s or more on an AVX-512 host, 2-3x that on the slowest hosts) are marked `slow`: CI runs them in
# its later stage, `pytest -m slow` runs them anywhere. Nothing is left out of CI.
SMOKE = tuple(re.compile(p) for p in (
    r"integration/test_smollm2\.py::test_greedy_equals_autoregressive_fp32\[ngram\]$",
    r"integration/test_llamacpp\.py::test_(the_model_runs_as_shipped|greedy_equals_plain_decoding_on_llamacpp\[ngram-3_0\])$",
    r"integration/test_llama_server\.py::test_plain_decoding_repeats_exactly_and_the_server_stops$",
    r"integration/test_no_amx\.py::",
    r"integration/test_exact_kernels\.py::test_block_rows_are_bitwise_single_rows_for_every_weight_type\[smollm2-135m@Q4_0_PURE-2\]$",
))
LONG = tuple(re.compile(p) for p in (
    r"study/test_crashing_engines\.py::test_a_(preflight_that_dies|study_whose|cell_that|sweep_stopped)",
    r"study/test_sweep_resume\.py::test_killed_sweep",
    r"study/test_llamacpp_sweep\.py::",
    r"study/test_drift\.py::test_(a_cpu_hog|sweep_rechecks)",
    r"study/test_learning\.py::",
    r"study/test_findings\.py::test_report_shows_the_findings",
    r"study/test_lossy_cells\.py::",
    r"study/test_adapt_sweep\.py::",
    r"study/test_race\.py::test_a_(real_sweep|prompt_longer)",
    r"test_feature_draft\.py::test_design_feature_command",
    r"test_tuner\.py::test_tune_(and_sweep_read|searches_the_dtype|finishes_within)",
    r"test_design\.py::test_(killed_distillation|design_cut_command|distillation_raises)",
    r"test_heads\.py::test_design_heads_command",
    r"test_shape_predict\.py::test_(the_cli_calibrates|acceptance_comes_from)",
    r"test_qwen2\.py::test_feature_draft_on_qwen2",
    r"test_untrusted_files\.py::test_a_mode_that_is_not_exact",
    r"test_staged\.py::test_staged_first_token_follows",
    r"test_adapt\.py::test_acceptance_rises",
    r"test_audit\.py::test_audit_passes_the_engine_and_fails_a_broken_verifier\[bf16\]",
    r"test_cli_bad_input\.py::test_bad_input_exits_2_with_one_line\[tune an adapting draft\]",
    r"test_shape_matrix\.py::test_every_block_row_equals_plain_decoding_on_the_cpu\[(llama-3-8b|qwen2\.5-7b)",
))


def pytest_collection_modifyitems(items) -> None:
    """Mark the exhaustive matrices (see EXHAUSTIVE), and the real-model and long suites `slow` (SMOKE, LONG)."""
    for item in items:
        if any(pattern.search(item.nodeid) for pattern in EXHAUSTIVE):
            item.add_marker(pytest.mark.exhaustive)
        real_model = item.nodeid.startswith("tests/integration/") and not any(p.search(item.nodeid) for p in SMOKE)
        if real_model or any(pattern.search(item.nodeid) for pattern in LONG):
            item.add_marker(pytest.mark.slow)


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
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab - 1)}
    words["[UNK]"] = vocab - 1
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
    model = tiny_llama(vocab=vocab, layers=layers, seed=seed).model
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

    from draftlab.study.store import ResultsStore

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

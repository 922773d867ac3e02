"""The exported configurations parse in each engine's syntax, with its documented option names and value ranges.

vLLM's `speculative_config` fields and methods are those of vllm/config/speculative.py (`SpeculativeConfig`,
`SpeculativeMethod`; `num_speculative_tokens_per_batch_size` is a list of [lo, hi, K]); SGLang's flags are those
its server_args.py registers (`--speculative-algorithm` choices EAGLE, EAGLE3, NEXTN, STANDALONE, NGRAM; a chain
has num_draft_tokens = num_steps + 1). llama-server's are checked against the built binary's own --help in
tests/integration/test_export_llama_server.py.
"""

from __future__ import annotations

import argparse
import json
import shlex

import pytest

from draftlab.errors import DraftlabError
from draftlab.deploy import EXPORT_ENGINES, Deployable, export, vllm_config

VLLM_METHODS = {"ngram", "medusa", "mlp_speculator", "draft_model", "suffix", "eagle", "eagle3", "ngram_gpu"}
VLLM_FIELDS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
               "num_speculative_tokens_per_batch_size", "suffix_decoding_max_tree_depth"}
CHOICES = [("ngram", 3), ("ngram:2-4", 5), ("suffix", 8), ("model:qwen2.5-coder-0.5b", 4),
           ("tree:2x2:model:qwen2.5-coder-0.5b", 3), ("none", 0), ("draft-simple/qwen2.5-coder-0.5b,p=0.5", 4)]


def vllm_parse(command: str) -> tuple[str, dict | None]:
    """(model, speculative config) of `vllm serve MODEL [--speculative-config JSON]`, checked against vLLM's fields."""
    words = shlex.split(command)
    assert words[:2] == ["vllm", "serve"]
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--speculative-config", type=json.loads)
    args = parser.parse_args(words[2:])
    config = args.speculative_config
    if config is None:
        return args.model, None
    assert set(config) <= VLLM_FIELDS and config["method"] in VLLM_METHODS
    assert isinstance(config["num_speculative_tokens"], int) and config["num_speculative_tokens"] > 0
    if config["method"] == "ngram":
        assert 1 <= config["prompt_lookup_min"] <= config["prompt_lookup_max"]
    if config["method"] == "draft_model":
        assert config["model"]
    table = config.get("num_speculative_tokens_per_batch_size")
    if table is not None:
        assert table[0][0] == 1 and all(a[1] + 1 == b[0] for a, b in zip(table, table[1:]))
        assert all(lo <= hi and 0 <= k <= config["num_speculative_tokens"] for lo, hi, k in table)
    return args.model, config


def sglang_parse(command: str) -> argparse.Namespace:
    """`python -m sglang.launch_server ...` parsed with SGLang's speculative options (names, types, choices)."""
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "sglang.launch_server"]
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--speculative-algorithm", choices=["EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"])
    parser.add_argument("--speculative-draft-model-path")
    for name in ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens",
                 "--speculative-ngram-min-match-window-size", "--speculative-ngram-max-match-window-size"):
        parser.add_argument(name, type=int)
    args = parser.parse_args(words[3:])
    if args.speculative_algorithm == "STANDALONE":
        assert args.speculative_draft_model_path and args.speculative_num_steps >= 1
        if args.speculative_eagle_topk == 1:
            assert args.speculative_num_draft_tokens == args.speculative_num_steps + 1
        assert args.speculative_num_draft_tokens > args.speculative_num_steps
    if args.speculative_algorithm == "NGRAM":
        assert 1 <= args.speculative_ngram_min_match_window_size <= args.speculative_ngram_max_match_window_size
        assert args.speculative_num_draft_tokens >= 2
    return args


@pytest.mark.parametrize("draft, k", CHOICES)
def test_each_export_parses_in_its_engines_syntax_or_says_why_not(draft, k):
    choice = Deployable("qwen2.5-coder-1.5b", draft, k)
    for engine in EXPORT_ENGINES:
        try:
            command = export(choice, engine)
        except DraftlabError as exc:
            assert "\n" not in str(exc) and "no counterpart" in str(exc)
            continue
        if engine == "vllm":
            model, config = vllm_parse(command)
            assert model == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
            assert (config is None) == (draft == "none")
            if config is not None:
                assert config["num_speculative_tokens"] == k
        elif engine == "sglang":
            args = sglang_parse(command)
            assert (args.speculative_algorithm is None) == (draft == "none")
        else:
            assert shlex.split(command)[:2] == ["llama-server", "-m"]


def test_the_exports_keep_k_and_the_drafts_lookup():
    _, config = vllm_parse(export(Deployable("smollm2-135m", "ngram:2-4", 5), "vllm"))
    assert (config["method"], config["num_speculative_tokens"], config["prompt_lookup_min"],
            config["prompt_lookup_max"]) == ("ngram", 5, 2, 4)
    args = sglang_parse(export(Deployable("smollm2-135m", "model:qwen2.5-coder-0.5b", 3), "sglang"))
    assert (args.speculative_algorithm, args.speculative_num_steps, args.speculative_eagle_topk) == ("STANDALONE", 3, 1)
    tree = sglang_parse(export(Deployable("smollm2-135m", "tree:2x2:model:qwen2.5-coder-0.5b", 3), "sglang"))
    assert (tree.speculative_eagle_topk, tree.speculative_num_draft_tokens) == (2, 2 + 4 + 4 + 1)


def test_a_model_draft_exports_to_llama_server_as_the_file_draftlab_drafts_from(tmp_path, monkeypatch):
    """model:NAME drafts on llama.cpp from NAME@Q4_0_PURE (`gguf_draft`): llama-server's -md names that file (derived
    where the shipped file is here, keyed by its checksum), never the shipped GGUF it did not measure."""
    from draftlab.backends.quantize import derived_path
    from draftlab.files import assets

    shipped = tmp_path / "qwen-0.5b.Q4_K_M.gguf"
    shipped.write_bytes(b"GGUF stand-in")
    monkeypatch.setattr("draftlab.deploy.cached_path", lambda asset: shipped)
    monkeypatch.setattr("draftlab.deploy.cache_dir", lambda: tmp_path)
    words = shlex.split(export(Deployable("qwen2.5-coder-1.5b", "model:qwen2.5-coder-0.5b", 4), "llama-server"))
    draft = words[words.index("-md") + 1]
    assert draft == str(derived_path(shipped, "Q4_0_PURE", tmp_path)) and draft.endswith(".Q4_0_PURE.gguf")
    assert assets.MODEL_ASSETS["qwen2.5-coder-0.5b"]  # a short name the test stands in for
    shipped.unlink()  # not here: a placeholder that still names the weight type
    words = shlex.split(export(Deployable("qwen2.5-coder-1.5b", "model:qwen2.5-coder-0.5b", 4), "llama-server"))
    assert words[words.index("-md") + 1] == "qwen-0.5b.Q4_K_M.Q4_0_PURE.gguf"


def test_a_study_at_several_batch_sizes_exports_its_k_per_batch_size():
    """From a study measured at batch sizes 1, 2, 4 and 8: K 3 alone, the same K (-1) to 4, none above."""
    choice = Deployable("smollm2-135m", "ngram", 3, ((1, 1, 3), (2, 4, -1), (5, 8, 0)))
    _, config = vllm_parse(export(choice, "vllm"))
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 4, 3], [5, 8, 0]]
    assert "num_speculative_tokens_per_batch_size" not in vllm_config(Deployable("smollm2-135m", "ngram", 3))


@pytest.mark.parametrize("draft", ["designed", "layers:0-3", "staged:ngram/layers:0-3", "merged:ngram/tree:2x2:designed",
                                   "adapt/designed"])
def test_drafts_without_a_counterpart_say_so_on_every_engine(draft):
    for engine in EXPORT_ENGINES:
        with pytest.raises(DraftlabError, match="no counterpart"):
            export(Deployable("smollm2-135m", draft, 3), engine)


def test_bad_exports_are_refused_in_one_line():
    with pytest.raises(DraftlabError, match="unknown engine"):
        export(Deployable("smollm2-135m", "ngram", 3), "tgi")
    with pytest.raises(DraftlabError, match="per-batch-size"):
        Deployable("smollm2-135m", "ngram", 3, ((0, 1, 3),))
    with pytest.raises(DraftlabError):
        export(Deployable("smollm2-135m", "ngram:x", 3), "vllm")


@pytest.mark.parametrize("draft", ["eagle3", "tree:2x2:eagle3"])
def test_eagle3_drafts_export_as_the_engines_eagle3(draft, tmp_path):
    """The shipped EAGLE-3 draft (and a directory of one) as vLLM's eagle3 method, SGLang's EAGLE3 algorithm and
    llama-server's draft-eagle3 type, pointing at the files `draftlab design eagle3` writes."""
    choice = Deployable("smollm2-135m", draft, 3)
    sglang = sglang_parse(export(choice, "sglang"))
    assert sglang.speculative_algorithm == "EAGLE3"
    assert sglang.speculative_draft_model_path == "eagle3-smollm2-135m/eagle3-checkpoint"
    assert sglang.speculative_num_steps == 3 and sglang.speculative_eagle_topk == (2 if "tree" in draft else 1)
    if "tree" in draft:
        for engine in ("vllm", "llama-server"):
            with pytest.raises(DraftlabError, match="no counterpart.*tree of an EAGLE-3 draft"):
                export(choice, engine)
        return
    model, config = vllm_parse(export(choice, "vllm"))
    assert config == {"method": "eagle3", "model": "eagle3-smollm2-135m/eagle3-checkpoint", "num_speculative_tokens": 3}
    flags = shlex.split(export(choice, "llama-server"))
    assert flags[flags.index("--spec-type") + 1] == "draft-eagle3"
    assert flags[flags.index("-md") + 1] == "eagle3-smollm2-135m/eagle3-draft.gguf"


def test_llama_servers_eagle3_type_exports_to_the_engines_as_its_draft_directory(tmp_path):
    """A study's server cell `draft-eagle3/DIR` (or DIR/eagle3-draft.gguf): the same draft on vLLM and SGLang
    (the engines' checkpoint beside that GGUF), and on llama-server the GGUF itself."""
    directory = tmp_path / "qwen-e3"
    directory.mkdir()
    for named in (str(directory), str(directory / "eagle3-draft.gguf")):
        choice = Deployable("qwen2.5-coder-1.5b", f"draft-eagle3/{named}", 3)
        _, config = vllm_parse(export(choice, "vllm"))
        assert config == {"method": "eagle3", "model": str(directory / "eagle3-checkpoint"),
                          "num_speculative_tokens": 3}
        assert sglang_parse(export(choice, "sglang")).speculative_algorithm == "EAGLE3"
        flags = shlex.split(export(choice, "llama-server"))
        assert flags[flags.index("-md") + 1] == str(directory / "eagle3-draft.gguf")
        assert flags[flags.index("--spec-type") + 1] == "draft-eagle3"

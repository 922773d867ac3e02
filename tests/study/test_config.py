"""The sweep grid from presets, a TOML file and flags, validated at construction."""

from __future__ import annotations

from dataclasses import replace

import pytest

from draftlab.errors import DraftlabError
from draftlab.study.run.sweep import SweepConfig, make_config


def test_toml_file_then_flags(tmp_path):
    path = tmp_path / "grid.toml"
    path.write_text('[sweep]\ndrafters = ["ngram", "layers:0-1"]\nks = [1, 3]\nlimit = 2\n')
    config = make_config("quick", str(path), limit=5, methods=None, dtype="fp32", host_baselines=False)
    assert config.drafters == ("ngram", "layers:0-1") and config.ks == (1, 3)
    assert config.limit == 5  # flags win over the file
    cells = config.cells("t", "d", 0.0)
    assert cells[0].method == "ar" and cells[1].method == "hf"  # HF's plain decoding runs beside AsG
    assert len(cells) == 2 + 2 * 2 * 2
    assert len({c.key for c in cells}) == len(cells)


def test_the_quick_study_races_and_the_full_grid_stays():
    """The main job has the shipped draft as a chain and as its best tree and n-gram lookup, and races them; the
    layer self-draft (which never won on a CPU) and the whole grid stay in the full preset."""
    from draftlab.registry import parse_drafter_spec

    quick, full = make_config("quick"), make_config("full")
    assert {parse_drafter_spec(spec, 30).kind for spec in quick.drafters} == {"designed", "merged", "ngram", "suffix"}
    assert "serve" in quick.methods  # it races draftlab serve (K 1-3: with K=6 too, the AVX2 host reached 3 of 8 prompts)
    assert quick.race_after >= 1 and full.race_after == 0
    assert "layers" in {parse_drafter_spec(spec, 30).kind for spec in full.drafters}
    with pytest.raises(DraftlabError, match="race_after"):
        make_config("quick", race_after=-1)


def test_bad_grids_are_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("ks = [1, 2\n")
    with pytest.raises(DraftlabError, match="not valid TOML"):
        make_config("quick", str(bad))
    bad.write_text("colour = 'blue'\n")
    with pytest.raises(DraftlabError, match="unknown setting"):
        make_config("quick", str(bad))
    with pytest.raises(DraftlabError, match="config file not found"):
        make_config("quick", str(tmp_path / "missing.toml"))
    with pytest.raises(DraftlabError, match="unknown preset"):
        make_config("huge")
    for kwargs in ({"ks": (0,)}, {"methods": ("fast",)}, {"drafters": ("bogus",)}, {"temperatures": (-1.0,)}):
        with pytest.raises(DraftlabError):
            SweepConfig(**kwargs)


def test_family_preset_is_the_seeds_grid_on_the_qwen_pair_on_llamacpp():
    """The seeds' study on CPU: the 1.5B in pure Q4_0 on llama.cpp, the 0.5B stand-alone draft (whole and
    trimmed head), two layer
    self-drafts, the EAGLE-3 draft built for the 1.5B, n-gram and suffix lookup, SpS and llama-cpp-python's prompt lookup, K 1..6, HumanEval and code
    edits, draftlab serve alone and at 4 in flight with every drafter it serves (the 0.5B and EAGLE-3 drafts among them), within a
    budget, then the calibration and microbenchmark its findings read."""
    config = make_config("family")
    assert config.targets == ("llamacpp:qwen2.5-coder-1.5b@Q4_0_PURE",)
    assert {"model:qwen2.5-coder-0.5b", "model:qwen2.5-coder-0.5b,head=32768", "eagle3", "ngram",
            "suffix"} <= set(config.drafters)
    assert sum(d.startswith("layers:") for d in config.drafters) == 2
    assert config.ks == tuple(range(1, 7)) and set(config.methods) == {"sps", "lcp", "serve"}
    assert set(config.datasets) == {"humaneval", "code-edit"} and config.limit == 8
    assert set(config.seed_inputs) == {"calibrate", "microbench"} and 0 < config.budget_s < 3600
    cells = replace(config, host_baselines=False).cells(config.targets[0], "d", 0.0)
    # ar, llama-cpp-python's plain, SpS x 7 drafts x 6 K, its prompt lookup x n-gram x 6 K; draftlab serve's plain
    # decoding alone and at 4, and the 6 drafts it serves (not the cut head) at K 1..6 and auto alone, auto at 4
    served = {c.drafter for c in cells if c.method == "serve"}
    assert served == {"model:qwen2.5-coder-0.5b", "layers:0-3", "layers:0-27:2", "eagle3", "ngram", "suffix"}
    assert len(cells) == 2 + 7 * 6 + 6 + 2 + 6 * 7 + 6
    assert {c.method for c in cells} == {"ar", "llama", "sps", "lcp", "serve", "serve-ar"}
    assert all(c.backend == "llamacpp" and c.dtype == "gguf" for c in cells if c.method not in ("serve", "serve-ar"))
    with pytest.raises(DraftlabError, match="unknown seed input"):
        SweepConfig(seed_inputs=("correlate",))

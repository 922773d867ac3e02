"""Predictions for the engine a study kept: a profile timed on draftlab's llama.cpp engine, the study's acceptance of
its llama.cpp cells, compared like with like (the same weights, switches and context), and what differs named."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from draftlab.perf.calibrate import Profile
from draftlab.perf.throughput import TargetProfile
from draftlab.study.run.store import ResultsStore
from draftlab.study.run.sweep import SweepConfig, run_sweep
from draftlab.study.answer.transfer import acceptance_from, mean_context, unlike_study
from tests.study.test_report import cell, record

TEXT = ("The river rose all night. The river rose all night and the town watched the river rise, and by morning the "
        "river had reached the bridge. ")


def draftlab(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftlab.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_a_llamacpp_profile_predicts_the_studys_llamacpp_cells(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": TEXT * (2 + i), "category": "prose", "id": f"q{i}"}) + "\n"
                               for i in range(2)))
    config = SweepConfig(targets=("llamacpp:smollm2-135m",), drafters=("ngram",), ks=(1, 2), methods=("sps",),
                         datasets=(str(prompts),), limit=2, max_new_tokens=32, warmup=1, baseline_every=0,
                         host_baselines=False, preflight_s=0)
    store = ResultsStore(tmp_path / "s.sqlite")
    run_sweep(config, store, progress=False)
    store.close()
    cells, plain = acceptance_from(tmp_path / "s.sqlite", gguf=True)
    assert {(c.drafter, c.k) for c in cells} == {("ngram", 1), ("ngram", 2)} and plain["cpu"] > 0
    context = mean_context(tmp_path / "s.sqlite")
    out = draftlab("calibrate", "--target", "smollm2-135m", "--backend", "llamacpp", "--drafts", "ngram",
                   "--k-max", 2, "--prompts", prompts, "--limit", 2, "--max-new-tokens", 32, "--repeats", 2,
                   "--context", context, "--preflight-timeout", 0, "--no-progress", "--out", tmp_path / "p.json")
    assert out.returncode == 0, out.stderr
    profile = Profile.load(tmp_path / "p.json")
    assert profile.backend == "llamacpp" and profile.route.startswith("llama.cpp Q4_1")
    assert profile.context_tokens == context and unlike_study(profile, tmp_path / "s.sqlite", context) == ""
    out = draftlab("predict", "--profile", tmp_path / "p.json", "--acceptance-from", tmp_path / "s.sqlite")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("PREDICTED for smollm2-135m (target cost from the profile (llama.cpp Q4_1")
    assert "measured in the study:" in out.stdout and "chain cells: mean |error|" in out.stdout
    assert "no error figure" not in out.stdout


def test_a_llamacpp_profile_names_other_switches_another_model_or_context(tmp_path):
    store = ResultsStore(tmp_path / "s.sqlite")
    torch_run = store.start_run({"device": "cpu", "numerics": "fp32 exact-wm/2", "target": "m"})
    gguf_run = store.start_run({"device": "cpu", "numerics": "llama.cpp Q4_1, AMX off, repack off", "target": "m"})
    store.add(record(cell("ar"), "p1", 1.0), torch_run)
    store.add(record(replace(cell("ar"), target="llamacpp:tgt", backend="llamacpp"), "p1", 1.0), gguf_run)
    store.close()
    db = tmp_path / "s.sqlite"
    target = TargetProfile("m", {1: 0.01})
    assert unlike_study(Profile(target, [], 300, backend="llamacpp", numerics="llama.cpp Q4_1, AMX off, repack off"),
                        db, 300) == ""
    said = unlike_study(Profile(TargetProfile("n", {1: 0.01}), [], 300, backend="llamacpp",
                                numerics="llama.cpp Q4_1, AMX on, repack on"), db, 600)
    assert "route llama.cpp Q4_1, AMX on, repack on, the study's llama.cpp target llama.cpp Q4_1, AMX off" in said
    assert "the profile timed n, the study m" in said and "~600" in said

"""Answers for a device from a model's shape: block costs timed on random weights in a shape, acceptance from a
study run elsewhere, combined by the seeds' model into a predicted table."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from draftlab.errors import DraftlabError
from draftlab.checks.exactness import Shape, shapes_named
from draftlab.perf.calibrate import Profile, two_paths
from draftlab.perf.throughput import DraftProfile, TargetProfile
from draftlab.perf.shapes import Acceptance, StepCounts, acceptance, calibrate_shape, format_predicted, predict_from
from draftlab.study.run.store import ResultsStore
from draftlab.study.run.sweep import SweepConfig, run_sweep
from draftlab.study.answer.transfer import acceptance_from
from tests.conftest import tiny_model_dir

TINY = Shape("tiny", 64, 4, 2, 16, 128, False, 256, False, 2)


def test_a_shape_profile_times_every_block_size_and_model_drafts_and_reloads(tmp_path):
    profile = calibrate_shape(TINY, "fp32", "cpu", {"model:small": TINY}, repeats=2, context=32)
    assert sorted(profile.target.score_s) == list(range(1, 17)) and all(s > 0 for s in profile.target.score_s.values())
    assert profile.device == "cpu" and "shape:tiny fp32 on cpu" in profile.target.name
    assert [d.name for d in profile.drafts] == ["model:small"] and profile.drafts[0].draft_s_per_token > 0
    assert sorted(profile.target.tree_s) == list(range(3, 17)) and all(s > 0 for s in profile.target.tree_s.values())
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").device == "cpu"
    assert Profile.load(tmp_path / "p.json").target.tree_s == profile.target.tree_s  # int keys again


def test_the_timed_tree_has_two_paths_from_the_root():
    assert two_paths([5, 6, 7]).parents == (-1, 0, 0)
    assert two_paths([5, 6, 7, 8, 9]).parents == (-1, 0, 1, 0, 3) and not two_paths([5, 6, 7, 8]).is_chain


def test_the_prediction_is_the_seeds_model_on_the_profiles_costs():
    target = TargetProfile("shape:x", {1: 0.010, 2: 0.012, 3: 0.014, 4: 0.016}, overhead_s_per_step=0.001)
    profile = Profile(target, [DraftProfile("model:d", 0.002, [])], device="cuda")
    cells = [Acceptance("ngram", 3, 2.0, ((0, 0.5), (3, 0.5)), 0.0005, 0.002, 100, 55.0, "cpu"),
             Acceptance("model:d", 2, 2.5, ((2, 1.0),), 0.030, 0.002, 100, 30.0, "cpu")]
    ngram, model = predict_from(profile, cells, same_device=False)
    # TAR / (E[t_target(1 + d)] + the study's overhead per step + drafting)
    assert ngram.tokens_per_s == pytest.approx(2.0 / (0.5 * 0.010 + 0.5 * 0.016 + 0.002 + 0.0005))
    assert model.t_draft_s == pytest.approx(2 * 0.002) and model.draft_cost_from == "profile"  # the shape's, not 0.030
    assert ngram.measured_tokens_per_s is None  # another device: nothing measured to compare with
    text = format_predicted([ngram, model], profile, None)
    assert text.startswith("PREDICTED for shape:x") and "optimal K and ranking:" in text


def draftlab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftlab.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_the_cli_calibrates_a_config_files_shape_and_refuses_what_is_not_one(tmp_path):
    folder = tmp_path / "my-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 256, "num_hidden_layers": 2, "tie_word_embeddings": True}))
    assert shapes_named([str(folder)]) == [Shape("my-llama", 64, 4, 2, 16, 128, False, 256, True, 2)]
    out = draftlab("calibrate", "--shape-of", folder, "--context", 32, "--repeats", 1, "--out", tmp_path / "p.json")
    assert out.returncode == 0, out.stderr
    assert "shape:my-llama fp32 on cpu" in out.stdout and "tree ms 4:" in out.stdout
    assert sorted(Profile.load(tmp_path / "p.json").target.tree_s) == list(range(3, 17))
    (tmp_path / "bad.json").write_text('{"model_type": "gpt2"}')
    out = draftlab("calibrate", "--shape-of", tmp_path / "bad.json", "--out", tmp_path / "q.json")
    assert out.returncode != 0 and "Traceback" not in out.stderr and not (tmp_path / "q.json").exists()
    assert len(out.stderr.strip().splitlines()) == 1 and "gpt2" in out.stderr, out.stderr  # one clear line
    for bad, says in ((tmp_path / "nowhere", "unknown shape"), (tmp_path / "bad.json", "model_type 'gpt2'")):
        with pytest.raises(DraftlabError, match=says):
            shapes_named([str(bad)])


@pytest.mark.slow
def test_acceptance_comes_from_a_studys_lossless_greedy_records(tmp_path):
    model = tiny_model_dir(tmp_path / "tiny")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{(i + j) % 9}" for j in range(20)),
                                           "category": "code", "id": f"q{i}"}) + "\n" for i in range(2)))
    # fp32 as the profile below: 'auto' times the host's routes and picks bf16 on some hosts, which would make the
    # profile's route unlike the study's (no error figure)
    config = SweepConfig(targets=(str(model),), drafters=("ngram",), ks=(1, 3), methods=("sps",),
                         datasets=(str(prompts),), limit=2, max_new_tokens=24, warmup=0, baseline_every=0,
                         host_baselines=False, preflight_s=0, dtype="fp32")
    store = ResultsStore(tmp_path / "s.sqlite")
    run_sweep(config, store, progress=False)
    store.close()
    cells, plain = acceptance_from(tmp_path / "s.sqlite")
    assert {(c.drafter, c.k) for c in cells} == {("ngram", 1), ("ngram", 3)}
    assert all(1.0 <= c.tokens_per_step <= c.k + 1 and c.measured_tokens_per_s > 0 for c in cells)
    assert all(abs(sum(p for _, p in c.drafted) - 1) < 1e-9 for c in cells) and plain["cpu"] > 0
    # the command line: a profile of the tiny model's own shape (its config.json), the study's acceptance on it
    calibrate_shape(shapes_named([str(model)])[0], "fp32", "cpu", {}, repeats=1, context=32).save(tmp_path / "p.json")
    out = draftlab("predict", "--profile", tmp_path / "p.json", "--acceptance-from", tmp_path / "s.sqlite")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("PREDICTED for shape:") and "optimal K and ranking: ngram K=" in out.stdout
    assert "measured in the study:" in out.stdout and "chain cells: mean |error|" in out.stdout  # same device


def test_acceptance_pools_decodes_and_trees_are_reported_apart_with_anchored_errors():
    chain = acceptance("ngram", 2, "cpu", [StepCounts(4, 6, (2, 0, 2, 1), False, 0.004, 0.002, 0.2),
                                           StepCounts(2, 3, (2, 2), False, 0.002, 0.001, 0.1)])
    assert chain.tokens_per_step == pytest.approx(9 / 6) and dict(chain.drafted) == {0: 1 / 6, 1: 1 / 6, 2: 4 / 6}
    assert chain.draft_s_per_step == pytest.approx(0.001) and chain.measured_tokens_per_s == pytest.approx(30.0)
    tree = acceptance("tree", 1, "cpu", [StepCounts(2, 4, (3, 3), True, 0.0, 0.0, 0.1)])
    assert tree.tree and not chain.tree
    target = TargetProfile("shape:x", {1: 0.010, 2: 0.011, 3: 0.012, 4: 0.013}, overhead_s_per_step=0.0)
    profile = Profile(target, [], device="cpu")
    rows = predict_from(profile, [chain, tree], same_device=True)
    assert [r.tree for r in rows] == [False, True] and rows[1].t_target_s == pytest.approx(0.013)  # a chain's cost
    timed = Profile(replace(target, tree_s={4: 0.020}), [], device="cpu")
    assert predict_from(timed, [tree], same_device=True)[0].t_target_s == pytest.approx(0.020)  # the tree's own
    assert "two-path tree" in format_predicted(predict_from(timed, [chain, tree], True), timed, 50.0)
    # plain decoding measured at half the profile's speed: anchored, each prediction is halved before comparing
    text = format_predicted(rows, profile, plain_measured=50.0, measured_in="this round")
    chain_line = next(line for line in text.splitlines() if "chain cells" in line)
    anchored = abs(rows[0].tokens_per_s * 0.5 / 30.0 - 1)
    assert f"mean |error| {abs(rows[0].error):.1%} over 1" in chain_line and f"(0.50x the profile's speed): mean {anchored:.1%}" in chain_line
    assert "tree cells" in text and "costed as chains" in text and "measured in this round: 50.0" in text

"""The performance model's formulas, pinned to hand-computed values and edge cases."""

from __future__ import annotations

import pytest

from draftlab.perf.throughput import (
    DraftProfile,
    TargetProfile,
    accepted_at_least,
    expected_tokens_per_step,
    leviathan_speedup,
    leviathan_tokens_per_step,
    predict,
    prompt_standard_errors,
    simplified_throughput,
)
from draftlab.perf.tuner import choose
from draftlab.perf.present import extra_tar_for_parity, format_what_if, latency_reduction_for_parity, required_tar


def test_leviathan_hand_values():
    # a = 0.5, K = 2: (1 - 0.125) / 0.5 = 1.75 tokens per step; c = 0.1: 1.75 / 1.2
    assert leviathan_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    assert leviathan_speedup(0.5, 2, 0.1) == pytest.approx(1.75 / 1.2)
    assert leviathan_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / (0.2 * 1.2))


def test_leviathan_edges():
    for k in range(1, 8):
        assert leviathan_tokens_per_step(0.0, k) == 1.0  # acceptance 0: one token per step
        assert leviathan_tokens_per_step(1.0, k) == k + 1  # acceptance 1: K + 1
        assert leviathan_tokens_per_step(0.999999, k) == pytest.approx(k + 1, rel=1e-4)
    speedups = [leviathan_speedup(0.7, 3, c) for c in (0.0, 0.05, 0.1, 0.5, 1.0)]
    assert speedups == sorted(speedups, reverse=True)  # monotonically worse as the draft gets costlier
    assert leviathan_speedup(0.7, 3, 0.0) == pytest.approx(leviathan_tokens_per_step(0.7, 3))


def test_tokens_per_step_from_acceptance_at_kmax():
    # steps at K_max = 3 accepted 0, 1, 3, 3, 2: P(>=1) = 4/5, P(>=2) = 3/5, P(>=3) = 2/5
    at_least = accepted_at_least([0, 1, 3, 3, 2], [3, 3, 3, 3, 2], 3)
    assert at_least == [0.8, 0.6, 0.4]
    assert expected_tokens_per_step(at_least, 1) == pytest.approx(1.8)
    assert expected_tokens_per_step(at_least, 3) == pytest.approx(2.8)
    # the same as min(accepted at K_max, K) + 1 averaged over steps
    assert expected_tokens_per_step(at_least, 2) == pytest.approx(1 + (0 + 1 + 2 + 2 + 2) / 5)
    with pytest.raises(ValueError):
        expected_tokens_per_step(at_least, 4)
    assert accepted_at_least([], [], 2) == [0.0, 0.0]


def test_lookup_drafts_that_propose_less_than_k():
    """An n-gram step with no match drafts nothing: the target then scores a smaller block."""
    target = TargetProfile("t", {1: 0.030, 2: 0.034, 3: 0.038})
    draft = DraftProfile("ngram", 0.0, [0.25, 0.25], per_step_draft_s=0.001, drafted_at_least=[0.5, 0.5])
    assert draft.expected_drafted(2) == pytest.approx(1.0)
    assert draft.drafted_distribution(2) == [(0, 0.5), (1, 0.0), (2, 0.5)]
    assert target.t_target(2.0) == pytest.approx(0.034) and target.t_target(1.5) == pytest.approx(0.032)
    p = predict(target, draft, 2)
    # half the steps score 1 token (30 ms), half score 3 (38 ms): 34 ms on average
    assert p.t_target == pytest.approx(0.034) and p.t_draft == pytest.approx(0.001)
    assert p.tokens_per_s == pytest.approx(1.5 / 0.035)
    assert DraftProfile("m", 0.002, [0.5, 0.2]).drafted_distribution(2) == [(2, 1.0)]


def test_tar_error_over_prompts_sees_what_the_step_count_cannot():
    alike = prompt_standard_errors([[1, 0, 2, 0], [0, 1, 0, 2]], 2)
    assert alike == [0.0, 0.0]  # the same mean on both prompts: no spread between them
    apart = prompt_standard_errors([[2, 2, 2, 2], [0, 0, 0, 0]], 2)
    # mean 0.5 at K=1; clusters sum to +2 and -2; sqrt(2 / 1 * 8) / 8
    assert apart[0] == pytest.approx(0.5) and apart[1] == pytest.approx(1.0)
    assert prompt_standard_errors([[2, 2, 0]], 2) == [] and prompt_standard_errors([[1], []], 2) == []
    steps_only = DraftProfile("d", 0.001, [0.5, 0.5], steps=8)
    both = DraftProfile("d", 0.001, [0.5, 0.5], steps=8, prompt_tar_se=apart)
    assert steps_only.tar_standard_error(1) == pytest.approx(0.5 / 8**0.5)
    assert both.tar_standard_error(1) == pytest.approx(0.5) and both.tar_standard_error(2) == pytest.approx(1.0)


def test_simplified_throughput():
    assert simplified_throughput(3.0, 0.04, 0.02) == pytest.approx(50.0)
    assert simplified_throughput(0.5, 0.04, 0.01) == pytest.approx(20.0)  # TAR <= 1 counts as one token


def test_predict_combines_profiles():
    target = TargetProfile("t", {1: 0.030, 2: 0.032, 3: 0.034}, overhead_s_per_step=0.001)
    draft = DraftProfile("d", draft_s_per_token=0.003, accepted_at_least=[0.8, 0.6])
    p = predict(target, draft, 2)
    assert p.tokens_per_step == pytest.approx(2.4)
    assert p.t_target == pytest.approx(0.035) and p.t_draft == pytest.approx(0.006)
    assert p.tokens_per_s == pytest.approx(2.4 / 0.041)
    assert p.speedup == pytest.approx((2.4 / 0.041) * 0.031)
    assert p.leviathan_acceptance == pytest.approx(0.7)
    assert p.leviathan_c == pytest.approx(0.003 / 0.031)
    assert choose([p]) is p
    zero = predict(target, DraftProfile("z", 0.003, [0.0, 0.0]), 1)
    assert choose([zero]) is None  # nothing beats autoregressive decoding


def test_what_if_helpers():
    assert required_tar(50.0, 0.04, 0.02) == pytest.approx(3.0)
    # TAR 3 with 40 ms target and 20 ms draft gives 50 tok/s; to reach 60 the draft may take 10 ms: shed 50%
    assert latency_reduction_for_parity(3.0, 0.04, 0.02, 60.0) == pytest.approx(0.5)
    assert latency_reduction_for_parity(3.0, 0.04, 0.02, 50.0) == pytest.approx(0.0)


def test_extra_tar_and_what_if_table():
    # 2 tokens/step at 60 ms per step = 33.3 tok/s; to reach 50 tok/s it needs TAR 3: +1
    assert extra_tar_for_parity(2.0, 0.04, 0.02, 50.0) == pytest.approx(1.0)
    target = TargetProfile("t", {1: 0.030, 2: 0.032, 3: 0.034})
    fast = DraftProfile("fast", 0.001, [0.6, 0.3])
    slow = DraftProfile("slow", 0.010, [0.7, 0.5])
    from draftlab.perf.validate import predictions
    from draftlab.perf.calibrate import Profile

    text = format_what_if(predictions(Profile(target, [fast, slow])))
    assert "best draft (fast" in text and "slow" in text


def test_a_tree_is_predicted_with_the_block_of_its_nodes():
    # a 2x2 tree: 2 nodes at depth 1, 6 within depth 2; the target was timed for blocks 1..3 and 7
    target = TargetProfile("t", {1: 0.030, 2: 0.040, 3: 0.050, 7: 0.090})
    tree = DraftProfile("tree:2x2:d", 0.002, [0.8, 0.5], tree_nodes=[[[2, 1.0]], [[6, 1.0]]])
    p = predict(target, tree, 2)
    assert p.tokens_per_step == pytest.approx(2.3)  # the accepted path, as for a chain
    assert p.t_target == pytest.approx(0.090)  # 1 + 6 rows, not 1 + K
    assert p.t_draft == pytest.approx(6 * 0.002)
    assert predict(target, tree, 1).t_target == pytest.approx(0.050)
    assert target.t_target(5) == pytest.approx(0.070)  # between measured sizes 3 and 7
    assert target.t_target(9) == pytest.approx(0.110)  # past the largest: the last slope


def test_calibration_times_every_block_a_tree_produces(tmp_path):
    from draftlab.files.datasets import Prompt
    from draftlab.models import load_model
    from draftlab.perf.calibrate import CalibrationSettings, Profile, calibrate
    from tests.conftest import tiny_model_dir

    tiny = load_model(str(tiny_model_dir(tmp_path / "tiny")))
    prompts = [Prompt(f"p{i}", "chat", " ".join(f"w{(i * 7 + j * j) % 40}" for j in range(20)), chat=False)
               for i in range(2)]
    profile = calibrate(tiny, ["tree:2x2:layers:0-1", "layers:0-1"], prompts,
                        CalibrationSettings(k_max=2, max_new_tokens=12, repeats=2), progress=False)
    tree, chain = profile.drafts
    assert chain.tree_nodes == []
    depth_1, depth_2 = (dict(map(tuple, within)) for within in tree.tree_nodes)
    # near the end a step has room for one level (2 nodes) or none (the last token needs no draft)
    assert set(depth_1) <= {0, 2} and depth_1[2] > 0.8
    assert set(depth_2) <= {0, 2, 6} and depth_2[6] > 0.5
    assert {1, 2, 3, 7} <= set(profile.target.score_s)
    # the target's time is that of the blocks the tree produced (root + nodes), each timed, weighted by frequency
    expected = sum(share * profile.target.score_s[1 + int(nodes)] for nodes, share in tree.tree_nodes[1])
    assert predict(profile.target, tree, 2).t_target == pytest.approx(expected + profile.target.overhead_s_per_step)
    profile.save(tmp_path / "profile.json")
    assert Profile.load(tmp_path / "profile.json").drafts[0].tree_nodes == tree.tree_nodes

"""`--k auto`: every run's K chosen at the step by expected tokens per second, against brute force; the passes
llama.cpp splits a step into; the acceptance record."""

from __future__ import annotations

import itertools
import random

import pytest

from draftlab.decoding.kchoice import (AcceptanceRecord, AutoK, BlockCost, LoadK, LoadThenAuto, StepRun, best_ks,
                                       expected_tokens, llama_passes, one_pass)
from draftlab.errors import DraftlabError

# One row 7 ms, then about 1 ms a row: SmolLM2's pure Q4_0 on the exact kernels (blocks of 16 at ~3.1x one row).
COST = BlockCost(((1, 0.007), (2, 0.0078), (4, 0.0092), (8, 0.0128), (16, 0.0216), (32, 0.039)))


def rate(survival, ks, seqs, seconds) -> float:
    return sum(expected_tokens(p, k) for p, k in zip(survival, ks)) / seconds({s: 1 + k for s, k in zip(seqs, ks)})


def brute(survival, caps, seqs, seconds, family: bool) -> float:
    """The best rate over every K per run (family: the drafting runs at one depth K, each capped)."""
    if family:
        vectors = ([min(k, c) if on else 0 for c, on in zip(caps, mask)]
                   for k in range(0, max(caps) + 1) for mask in itertools.product((0, 1), repeat=len(caps)))
    else:
        vectors = itertools.product(*[range(c + 1) for c in caps])
    return max(rate(survival, list(ks), seqs, seconds) for ks in vectors)


def random_case(rng: random.Random, n: int, k_max: int):
    survival = []
    for _ in range(n):
        alpha = rng.choice([0.0, 0.2, 0.5, 0.8, 0.95, 1.0])
        survival.append([alpha ** (d + 1) for d in range(k_max)])
    caps = [rng.randint(0, k_max) for _ in range(n)]
    return survival, caps


@pytest.mark.parametrize("passes", [llama_passes, one_pass], ids=["llama-streams", "one-pass"])
def test_the_choice_equals_brute_force_over_one_depth_per_step(passes):
    """Every run with room for K_max drafts (a request not near its end): the search is exact over one depth per
    step, and within 5% of the best K per run; near their ends (rooms apart), within 5% of the best K per run."""
    rng = random.Random(0)
    seconds = lambda lengths: sum(COST.seconds(r) for r in passes(lengths))  # noqa: E731
    full_wins = 0
    for case in range(300):
        n = rng.randint(1, 4)
        survival, caps = random_case(rng, n, 5)
        if case % 2:
            caps = [5] * n
        seqs = list(range(n))
        ks = best_ks(survival, caps, seqs, seconds)
        assert all(0 <= k <= c for k, c in zip(ks, caps))
        chosen, full = rate(survival, ks, seqs, seconds), brute(survival, caps, seqs, seconds, False)
        if case % 2:
            assert chosen >= brute(survival, caps, seqs, seconds, True) - 1e-9
        assert chosen >= 0.95 * full
        full_wins += chosen < full - 1e-9
    assert full_wins <= 6  # of 300: the search is the optimum over every K per run in nearly every step


def test_k_falls_as_rows_get_dearer():
    survival = [[0.8 ** (d + 1) for d in range(8)]] * 4
    ks = []
    for per_row in (0.0, 0.0005, 0.002, 0.004, 0.007):  # up to a row as dear as a pass over the weights
        cost = BlockCost(((1, 0.007), (64, 0.007 + 63 * per_row)))
        seconds = lambda lengths, cost=cost: sum(cost.seconds(r) for r in llama_passes(lengths))  # noqa: E731
        ks.append(max(best_ks(survival, [8] * 4, range(4), seconds)))
    assert ks == sorted(ks, reverse=True) and ks[0] == 8 and ks[-1] == 0


def test_a_run_whose_drafts_are_never_accepted_stops_drafting():
    chooser = AutoK(COST, llama_passes, k_max=6)
    copying, never = AcceptanceRecord(), AcceptanceRecord()
    for _ in range(20):
        copying.observe(6, 6)
        chooser.observe(6, 6)
        never.observe(6, 0)
        chooser.observe(6, 0)
    runs = [StepRun(0, 1, 100, copying)] + [StepRun(s, 1, 100, never) for s in (1, 2, 3)]
    assert chooser.caps(runs) == [6] * 4  # every run drafts to K_max, then the choice keeps what pays
    ks = chooser.choose(runs, [6, 6, 6, 6])
    assert ks[0] > 0 and ks[1:] == [0, 0, 0]
    # Alone, it never drafts either; a fresh run (no record) keeps a draft on what every run so far accepted; a run
    # without a draft this step (no match) drafts nothing.
    assert chooser.choose([StepRun(0, 1, 100, never)], [6]) == [0]
    fresh = StepRun(0, 1, 3, AcceptanceRecord())
    assert chooser.caps([fresh]) == [3] and chooser.choose([fresh], [3])[0] in (1, 2, 3)
    assert chooser.choose([StepRun(0, 1, 100, copying)], [0]) == [0]


class DropsEveryDraft(AutoK):
    """`--k auto` that drafts to 3 and keeps nothing: plain decoding, every draft dropped."""

    def caps(self, runs):
        return [3] * len(runs)

    def choose(self, runs, drafted):
        return [0] * len(runs)


def test_a_dropped_draft_is_checked_against_the_targets_next_token(tiny_target):
    """A run held at K 0 still learns whether its drafts would have held (greedy: the dropped draft's first token
    against the token the target committed), so a few early misses do not keep it from drafting for good; its
    tokens stay plain decoding's."""
    from draftlab.backends import FastLlamaBackend
    from draftlab.backends.hf import HFBackend
    from draftlab.drafters import ModelDrafter, NoDrafter
    from draftlab.engine import GenerationConfig, SpeculativeEngine

    def engine(drafter, chooser):
        return SpeculativeEngine(FastLlamaBackend(tiny_target.model), drafter, context_length=512, chooser=chooser)

    chooser = DropsEveryDraft(COST, llama_passes)
    dropping = engine(ModelDrafter(HFBackend(tiny_target.model)), chooser)  # the target as its own draft
    run = dropping.start([3, 4, 5], GenerationConfig(max_new_tokens=12))
    while not run.done:
        dropping.step([run])
    plain = engine(NoDrafter(), LoadK.fixed(0)).generate([3, 4, 5], GenerationConfig(max_new_tokens=12))
    assert run.new == plain.token_ids and run.stats.accepted == 0
    assert run.record.asked[:1] == run.record.accepted[:1] == [11]  # every step but the last (no room left)
    assert chooser.overall.asked[:1] == chooser.overall.accepted[:1] == [11]


def test_a_draft_models_cost_is_weighed_before_it_drafts():
    """With a draft model's cost curve, the Ks are chosen before drafting (`caps`) and kept (`choose`): the choice
    equals the brute force over every K per run with each depth's draft decode counted, falls as the draft's row
    gets dearer, and is 0 where a draft row costs as much as the target's (no acceptance pays for it)."""
    survival = [[0.8 ** (d + 1) for d in range(6)]] * 3
    ks = []
    for ratio in (0.05, 0.2, 0.5, 1.0):  # the draft's row over the target's
        draft = BlockCost(((1, 0.007 * ratio), (64, 0.007 * ratio * 8)))
        chooser = AutoK(COST, llama_passes, k_max=6, draft=draft, draft_passes=llama_passes)
        chosen = best_ks(survival, [6] * 3, range(3), chooser.step_seconds)
        assert rate(survival, chosen, range(3), chooser.step_seconds) >= brute(
            survival, [6] * 3, range(3), chooser.step_seconds, False) * 0.95
        ks.append(max(chosen))
    assert ks == sorted(ks, reverse=True) and ks[0] >= 2 and ks[-1] == 0
    # each depth costs one draft decode of a row per run drafting that deep
    chooser = AutoK(COST, llama_passes, k_max=6, draft=BlockCost(((1, 1.0), (2, 2.0))), draft_passes=llama_passes)
    base = AutoK(COST, llama_passes, k_max=6)
    assert chooser.step_seconds({0: 4, 1: 2}) - base.step_seconds({0: 4, 1: 2}) == pytest.approx(2.0 + 1.0 + 1.0)
    # the first depth feeds each stream what it lacks (the tokens accepted last step and the target's own)
    assert chooser.step_seconds({0: 3}, {0: 2}) - chooser.step_seconds({0: 3}) == pytest.approx(1.0)
    runs = [StepRun(s, 1, 100, AcceptanceRecord()) for s in range(3)]
    caps = AutoK(COST, llama_passes, k_max=6, draft=BlockCost(((1, 0.007), (2, 0.014)))).caps(runs)
    assert caps == [0, 0, 0]  # a draft as dear as the target: plain decoding, chosen before it drafts
    assert chooser.choose(runs, [2, 0, 1]) == [2, 0, 1]


def test_a_drafter_without_a_curve_is_priced_as_the_steps_time_it():
    """An EAGLE-3 layer (no streams to calibrate): the steps' drafting times price its rows; once a row costs a share
    of the target's worth weighing, the Ks are chosen before drafting (a row as dear as the target's: plain
    decoding), while a lookup's microseconds leave drafting first (caps at the room). A calibrated curve stays."""
    runs = [StepRun(s, 1, 100, AcceptanceRecord()) for s in range(3)]
    dear = AutoK(COST, llama_passes, k_max=6)
    assert dear.caps(runs) == [6, 6, 6]  # nothing timed yet: every run drafts to its cap
    dear.timed(0.007 * 6, [6, 0, 0])  # 6 rows at a target row's price each
    assert dear.draft is not None and dear.draft_row_s == pytest.approx(0.007)
    assert dear.caps(runs) == [0, 0, 0]
    cheap = AutoK(COST, llama_passes, k_max=6)
    for _ in range(5):
        cheap.timed(0.00002 * 12, [6, 6, 0])  # 20 microseconds a row: a suffix tree's lookup
    assert cheap.draft is None and cheap.caps(runs) == [6, 6, 6]
    calibrated = AutoK(COST, llama_passes, k_max=6, draft=BlockCost(((1, 0.001), (2, 0.002))), calibrated=True)
    calibrated.timed(1.0, [1])
    assert calibrated.draft == BlockCost(((1, 0.001), (2, 0.002)))
    middle = AutoK(COST, llama_passes, k_max=6)
    for seconds in (0.001, 0.002):  # per row: averaged over the steps, the newest weighed most
        middle.timed(seconds * 2, [2])
    assert 0.001 < middle.draft_row_s < 0.002


def test_a_draft_streams_catch_up_is_spread_over_the_tokens_left():
    """A new prompt's draft stream must take the prompt in before it drafts: worth it for a long answer, not for the
    last few tokens, and not counted for a stream that is a step behind (what every draft costs, already weighed)."""
    draft = BlockCost(((1, 0.003), (512, 0.003 * 40)))
    chooser = AutoK(COST, llama_passes, k_max=4, draft=draft, draft_passes=llama_passes)
    copying = AcceptanceRecord()
    for _ in range(50):
        copying.observe(4, 4)
        chooser.observe(4, 4)

    def k(room: int, lag: int) -> int:
        return chooser.caps([StepRun(0, 1, room, copying, lag)])[0]

    assert k(200, 500) == 4 and k(200, 3) == 4  # a long answer pays for the catch-up; a step behind costs nothing
    assert k(3, 500) == 0 and k(3, 3) == 3  # three tokens left: not worth taking 500 in
    assert 0 < chooser._catch_up(StepRun(0, 1, 200, copying, 500)) < draft.seconds(500)


def test_the_record_is_the_share_of_steps_whose_first_d_drafts_were_accepted():
    record = AcceptanceRecord()
    record.observe(3, 3)
    record.observe(3, 1)
    record.observe(2, 0)
    assert record.asked == [3, 3, 2] and record.accepted == [2, 1, 1]
    assert record.survival(3, None, weight=0) == [2 / 3, 1 / 3, 1 / 3]
    assert record.survival(4, None, weight=0)[3] == 1 / 3  # never asked: no higher than the depth before it


def test_llama_cpp_splits_unequal_blocks_and_gaps_into_passes():
    assert llama_passes({0: 3, 1: 3, 2: 3}) == [9]
    assert llama_passes({0: 1, 1: 4}) == [2, 3]
    assert llama_passes({0: 2, 2: 2}) == [2, 2]  # slot 1 free: not consecutive
    assert llama_passes({0: 1000}) == [512, 488]


def test_a_cost_curve_needs_rows_from_one_and_load_rows_still_parse():
    assert COST.seconds(1) == 0.007 and COST.seconds(3) == pytest.approx(0.0085)
    assert COST.seconds(64) > COST.seconds(32)
    with pytest.raises(DraftlabError):
        BlockCost(((2, 0.1), (4, 0.2)))
    runs = [StepRun(0, 1, 9, AcceptanceRecord())] * 3
    assert LoadK.parse("1-2:6,3-4:3").caps(runs) == [3, 3, 3] and LoadK.fixed(4).choose(runs, [4, 2, 0]) == [4, 2, 0]


def test_load_rows_hand_some_loads_to_k_auto():
    """`--k-per-load 1:3,2-64:auto`: alone the row's K, in company `--k auto`'s choice (which learns at every
    load); the rows read back as written, and a K neither a number nor auto is refused in one line."""
    rows = LoadK.parse("1:3,2-64:auto")
    assert rows.text() == "1:3,2-64:auto" and rows.has_auto and not LoadK.parse("1:3,2-4:0").has_auto
    chooser = LoadThenAuto(rows, AutoK(COST, llama_passes, k_max=6))
    never = AcceptanceRecord()
    for _ in range(20):
        never.observe(6, 0)
        chooser.observe(6, 0)
    alone = [StepRun(0, 1, 100, never)]
    assert chooser.caps(alone) == [3] and chooser.choose(alone, [3]) == [3]
    together = [StepRun(s, 1, 100, never) for s in range(4)]
    assert chooser.caps(together) == [6] * 4 and chooser.choose(together, [6] * 4) == [0] * 4
    assert chooser.auto.overall.asked[0] == 20
    with pytest.raises(DraftlabError, match="1:3,2-64:auto"):
        LoadK.parse("1:3,2-64:best")

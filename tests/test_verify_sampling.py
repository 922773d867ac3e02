"""Rejection sampling is lossless: the committed token is distributed as the target says.

Each case draws k draft tokens, each from its own draft row, verifies them
against k+1 target rows that differ per position, and compares the histogram
of the committed token at every reached position j with target row j by a
chi-square test (p > 1e-3, seeded, so the outcome is
fixed). The last test shows the check has teeth: it rejects a sampler that
simply keeps the draft.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from draftlab.decoding.sampling import SamplingConfig, logits_to_probs
from draftlab.decoding.step import Block, Proposal
from draftlab.decoding.verify import residual_distribution, verify_greedy, verify_sampling

V = 6
N = 10000


def normalize(x):
    x = torch.as_tensor(x, dtype=torch.float64)
    return x / x.sum()


CASES = {
    "identical": (normalize([1, 2, 3, 4, 5, 6]), normalize([1, 2, 3, 4, 5, 6])),
    "disjoint_support": (normalize([1, 1, 1, 0, 0, 0]), normalize([0, 0, 0, 1, 2, 3])),
    "one_hot_draft": (normalize([0, 0, 1, 0, 0, 0]), normalize([3, 1, 2, 1, 1, 1])),
    "near_uniform_draft": (normalize([1.0, 1.01, 0.99, 1.0, 1.02, 0.98]), normalize([10, 1, 1, 5, 0.1, 2])),
    "peaked_target": (normalize([2, 1, 1, 1, 1, 1]), normalize([0.001, 0.001, 100, 0.001, 0.001, 0.001])),
    "random": (normalize(torch.rand(V, generator=torch.Generator().manual_seed(3))),
               normalize(torch.rand(V, generator=torch.Generator().manual_seed(4)))),
}


def chain(draft_tokens: list[int]) -> Block:
    """The block that verifies a chain of drafted tokens after a root token 0."""
    return Block.of(0, Proposal(list(draft_tokens)))


def rows(probs, n):
    """n different rows [n, V]: row j is `probs` rolled by j (each position has its own distribution)."""
    return torch.stack([torch.roll(probs, j) for j in range(n)])


def committed_histograms(draft_probs, target_probs, k, one_hot=False, seed=0):
    """Histogram [k+1, V] of the committed token at each position, over N verified chains of k drafts."""
    generator = torch.Generator().manual_seed(seed)
    draft_rows = rows(draft_probs, k)  # [k, V]
    target_rows = rows(target_probs, k + 1)  # [k+1, V]
    counts = torch.zeros(k + 1, V)
    for _ in range(N):
        draft_tokens = torch.multinomial(draft_rows, 1, generator=generator)[:, 0].tolist()  # [k]
        verdict = verify_sampling(chain(draft_tokens), None if one_hot else draft_rows, target_rows, generator)
        for position, token in enumerate(verdict.committed(Proposal(draft_tokens))):
            counts[position, token] += 1
    return counts, target_rows


def assert_distributed_as(counts, probs):
    expected = probs.double() / probs.double().sum() * counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, "a token with zero target probability was emitted"
    result = chisquare(counts[support].numpy(), expected[support].numpy())
    assert result.pvalue > 1e-3, f"chi-square p={result.pvalue:.2e}: {counts.tolist()} vs {expected.tolist()}"


def assert_every_position_follows_target(counts, target_rows):
    """Each committed position j (given that it was reached) is distributed as target row j."""
    checked = 0
    for position in range(counts.shape[0]):
        if counts[position].sum() >= 200:
            assert_distributed_as(counts[position], target_rows[position])
            checked += 1
    assert checked >= 1


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("k", [1, 3])
def test_committed_tokens_follow_target(case, k):
    """Every position has its own target and draft row, so a residual or bonus from the wrong row fails."""
    draft_probs, target_probs = CASES[case]
    counts, target_rows = committed_histograms(draft_probs, target_probs, k)
    assert_every_position_follows_target(counts, target_rows)


@pytest.mark.parametrize("case", ["one_hot_draft", "random", "disjoint_support"])
def test_drafter_without_probabilities_is_treated_as_one_hot(case):
    """N-gram drafts carry no distribution; any fixed or random draft token must still be lossless."""
    draft_probs, target_probs = CASES[case]
    counts, target_rows = committed_histograms(draft_probs, target_probs, 2, one_hot=True)
    assert_every_position_follows_target(counts, target_rows)


def test_later_positions_are_reached_and_checked():
    """With identical draft and target every draft is accepted: the bonus row (k) must be checked too."""
    draft_probs, target_probs = CASES["identical"]
    counts, _ = committed_histograms(draft_probs, target_probs, 3)
    assert counts[3].sum() == N


def test_all_accepted_gives_bonus_from_last_row():
    target = torch.stack([normalize([1, 0, 0, 0, 0, 0]), normalize([0, 0, 0, 0, 0, 1])])  # [2, V]
    verdict = verify_sampling(chain([0]), target[:1], target, torch.Generator().manual_seed(0))
    assert verdict.num_accepted == 1 and verdict.next_token == 5


def test_acceptance_rate_equals_overlap():
    """P(accept) = sum min(draft, target); the identity behind the expected TAR."""
    draft_probs, target_probs = CASES["random"]
    generator = torch.Generator().manual_seed(1)
    accepted = 0
    for _ in range(N):
        token = torch.multinomial(draft_probs, 1, generator=generator).tolist()
        accepted += verify_sampling(chain(token), draft_probs[None], target_probs.expand(2, V), generator).num_accepted
    overlap = torch.minimum(draft_probs, target_probs).sum().item()
    assert abs(accepted / N - overlap) < 4 * (overlap * (1 - overlap) / N) ** 0.5


def test_the_check_detects_a_lossy_sampler():
    """Keeping every draft token (no rejection) is lossy; the chi-square check must say so."""
    draft_probs, target_probs = CASES["random"]
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.multinomial(draft_probs, N, replacement=True, generator=generator), minlength=V)
    with pytest.raises(AssertionError):
        assert_distributed_as(counts.float(), target_probs)


def test_residual_is_normalized_positive_part():
    residual = residual_distribution(normalize([0.5, 0.5, 0, 0, 0, 0]), normalize([0.25, 0.25, 0.5, 0, 0, 0]))
    torch.testing.assert_close(residual, normalize([0, 0, 1, 0, 0, 0]))
    same = normalize([1, 2, 3, 4, 5, 6])
    torch.testing.assert_close(residual_distribution(same, same), same)


def test_greedy_verification_longest_prefix():
    logits = torch.full((4, V), -1.0)
    for row, token in enumerate([2, 3, 4, 5]):
        logits[row, token] = 1.0
    assert verify_greedy(chain([2, 3, 1]), logits).num_accepted == 2
    assert verify_greedy(chain([2, 3, 1]), logits).next_token == 4
    full = verify_greedy(chain([2, 3, 4]), logits)
    assert (full.num_accepted, full.next_token) == (3, 5)
    assert verify_greedy(chain([0, 3, 4]), logits).num_accepted == 0


def test_top_k_and_top_p_warping():
    logits = torch.log(normalize([0.5, 0.2, 0.15, 0.1, 0.05, 0.0]).float().clamp_min(1e-9))[None]
    top2 = logits_to_probs(logits, SamplingConfig(1.0, top_k=2))[0]
    torch.testing.assert_close(top2, torch.tensor([5 / 7, 2 / 7, 0, 0, 0, 0]), atol=1e-5, rtol=0)
    nucleus = logits_to_probs(logits, SamplingConfig(1.0, top_p=0.8))[0]  # keeps 0.5, 0.2, 0.15
    torch.testing.assert_close(nucleus, torch.tensor([0.5, 0.2, 0.15, 0, 0, 0]) / 0.85, atol=1e-5, rtol=0)

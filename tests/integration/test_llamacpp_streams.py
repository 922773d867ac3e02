"""Token trees in llama.cpp's KV streams (scripts/llama-cpp/stream-leaves.patch), on the real SmolLM2 (pure Q4_0, the
exact kernels): with a stream per sequence, as `draftlab serve` holds its slots, one decode scores one sequence's
tree beside the others' chains, and every row a plain decode would score is bitwise that row scored alone; a kept
path, scattered or not, leaves each sequence's cache as plain decoding leaves it; a dropped tree leaves nothing."""

from __future__ import annotations

import pytest
import torch

from draftlab.backends.gguf import sequence_ids
from draftlab.backends.llamacpp_sequences import LlamaCppSequences
from draftlab.backends.llamacpp_trees import MAX_LEAVES, leaf_ids
from draftlab.decoding.step import Block
from draftlab.errors import DraftlabError
from tests.serve_jobs import target  # noqa: F401 (the fixture)

pytestmark = pytest.mark.integration
STEPS = 12  # greedy tokens each sequence decodes alone, a row each


@pytest.fixture(scope="module")
def alone(target):
    """4 sequences in one context, a prompt of its own each, then each sequence's greedy tokens scored one at a time
    with no other sequence in the decode: (sequences, cached prompt lengths, tokens, rows [V] per sequence)."""
    sequences = LlamaCppSequences(target.model, count=4, context=512)
    assert sequences.trees, "the loaded libllama lacks draftlab's stream-leaves patch: scripts/build-llama-cpp.sh"
    for seq in range(4):
        sequences.view(seq).score([100 + (seq * 131 + i * 37) % 20000 for i in range(20 + 7 * seq)], last_only=True)
    base = [sequences.length(seq) for seq in range(4)]
    tokens, rows = [], []
    for seq in range(4):
        view, own, own_rows = sequences.view(seq), [120 + seq], []
        for _ in range(STEPS):
            own_rows.append(view.score(own[-1:])[0])
            own.append(int(own_rows[-1].argmax()))
        view.rollback(base[seq])
        tokens.append(own)
        rows.append(own_rows)
    return sequences, base, tokens, rows


def same(scored: torch.Tensor, rows: list[torch.Tensor], pairs: list[tuple[int, int]]) -> bool:
    """Whether each (scored row, alone row) pair is bitwise equal."""
    return all(torch.equal(scored[j], rows[i]) for j, i in pairs)


def test_trees_beside_chains_in_one_decode_score_each_row_as_alone(alone):
    """Sequence 1's tree has a wrong first branch (its kept path lies in scattered cells), sequence 2's a right one;
    0 and 3 score chains of unequal length. Every path's rows are those scored alone, and after each keeps its path
    the next decode's rows are too."""
    sequences, base, tokens, rows = alone
    t0, t1, t2, t3 = tokens
    wrong = [(t + 1) % 49152 for t in t1[:3]]
    scores = sequences.score_blocks({
        0: Block.chain(t0[:4]),
        1: Block([t1[0], wrong[1], t1[1], wrong[2], t1[2]], (-1, 0, 0, 1, 2)),
        2: Block([t2[0], t2[1], (t2[1] + 1) % 49152, t2[2], t2[3]], (-1, 0, 0, 1, 3)),
        3: Block.chain(t3[:2]),
    })
    assert same(scores[0].logits, rows[0], [(i, i) for i in range(4)])
    assert same(scores[1].logits, rows[1], [(0, 0), (2, 1), (4, 2)])
    assert same(scores[2].logits, rows[2], [(0, 0), (1, 1), (3, 2), (4, 3)])
    assert same(scores[3].logits, rows[3], [(0, 0), (1, 1)])
    for seq, kept in ((0, [0, 1, 2, 3]), (1, [0, 2, 4]), (2, [0, 1, 3, 4]), (3, [0, 1])):
        sequences.keep(seq, kept)
    assert [sequences.length(seq) - base[seq] for seq in range(4)] == [4, 3, 4, 2]
    done = [4, 3, 4, 2]
    scores = sequences.score_blocks({seq: Block.chain(tokens[seq][done[seq]:done[seq] + 4]) for seq in range(4)})
    for seq in range(4):
        assert same(scores[seq].logits, rows[seq], [(i, done[seq] + i) for i in range(4)])
    for seq in range(4):
        sequences.rollback(seq, base[seq])


def test_a_dropped_tree_leaves_its_sequence_as_it_was(alone):
    """Two sequences' trees scored together and rolled back: each sequence's next row is its row alone, and no
    leaf sequence holds a cell."""
    sequences, base, tokens, rows = alone
    sequences.score_blocks({seq: Block([tokens[seq][0], 5, 6, 7, 8], (-1, 0, 0, 1, 1)) for seq in (1, 2)})
    for seq in (1, 2):
        sequences.rollback(seq, base[seq])
        assert torch.equal(sequences.view(seq).score(tokens[seq][:1])[0], rows[seq][0])
        sequences.rollback(seq, base[seq])
    assert all(sequences.lib.llama_memory_seq_pos_max(sequences._memory, leaf) == -1
               for seq in range(4) for leaf in leaf_ids(seq, 4, sequence_ids()))


def test_the_leaves_of_a_sequence_share_its_stream_and_their_number_is_bounded(alone):
    """Sequence s's leaves are s + 4k below the library's bound; a tree with more leaves gets one line."""
    sequences, base, tokens, _ = alone
    assert leaf_ids(1, 4, 256)[:3] == [5, 9, 13] and len(leaf_ids(1, 4, 256)) == MAX_LEAVES
    assert leaf_ids(0, 1, MAX_LEAVES + 1) == list(range(1, MAX_LEAVES + 1))
    wide = Block([tokens[0][0]] + list(range(1000, 1000 + 64)), (-1,) + (0,) * 64)
    with pytest.raises(DraftlabError, match="at most 63 leaves"):
        sequences.score_blocks({0: wide})
    sequences.rollback(0, base[0])

"""Structured pruning: choose which of the target's layers and output tokens a draft keeps.

A designed draft keeps a subset of the target's layers (chosen by hand, strided,
or searched greedily for the highest agreement with the target on calibration
text, in the spirit of self-speculative decoding's layer search) and,
optionally, only the most frequent tokens of the output vocabulary: the LM
head dominates a small draft's cost (SmolLM2: 49k x 576; Gemma 3 270M: 262k),
and a draft that can only propose frequent tokens loses little acceptance.

The draft and its file format live in `draftlab.drafters.designed`.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch

from draftlab.models import LoadedModel

from draftlab.drafters.designed import DesignedDraft, build_draft
from draftlab.progress import Bar


def frequent_tokens(sequences: Sequence[Sequence[int]], size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The `size` most frequent token ids in `sequences` (plus `always`), sorted: [V']."""
    counts = Counter(t for seq in sequences for t in seq)
    chosen = set(always)
    for token, _ in counts.most_common():
        if len(chosen) >= size:
            break
        chosen.add(token)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def fill_by_rank(vocab_map: torch.Tensor, size: int, vocab_size: int) -> torch.Tensor:
    """`vocab_map` [V'] topped up to `size` ids with the lowest ids not in it, sorted: [min(size, vocab_size)].

    For text too short to name `size` distinct tokens: a BPE vocabulary numbers its tokens in merge order,
    so low ids are the tokens its own training corpus held most often.
    """
    chosen = set(vocab_map.tolist())
    for token in range(vocab_size):
        if len(chosen) >= size:
            break
        chosen.add(token)
    return torch.tensor(sorted(chosen), dtype=torch.long)


@torch.inference_mode()
def agreement(target_next: torch.Tensor, draft: DesignedDraft, sequences: list[torch.Tensor]) -> float:
    """Teacher-forced top-1 agreement of the draft with the target's next tokens (~greedy acceptance)."""
    hits = total = 0
    offset = 0
    for tokens in sequences:
        logits = draft.model.model(input_ids=tokens[None]).logits[0]  # [n, V']
        predicted = logits.argmax(-1)
        if draft.vocab_map is not None:
            predicted = draft.vocab_map[predicted]
        expected = target_next[offset : offset + len(tokens)]
        hits += int((predicted == expected).sum())
        total += len(tokens)
        offset += len(tokens)
    return hits / total if total else 0.0


@torch.inference_mode()
def target_next_tokens(target: LoadedModel, sequences: list[torch.Tensor]) -> torch.Tensor:
    """The target's argmax next token at every position of every sequence, concatenated: [sum n]."""
    return torch.cat([target.model(input_ids=s[None]).logits[0].argmax(-1) for s in sequences])


def search_layers(target: LoadedModel, sequences: list[torch.Tensor], count: int,
                  vocab_map: torch.Tensor | None = None, progress: bool = True) -> tuple[list[int], float]:
    """Greedy forward selection of `count` layers maximising agreement with the target."""
    expected = target_next_tokens(target, sequences)
    chosen: list[int] = []
    best_score = 0.0
    total = target.model.config.num_hidden_layers
    bar = Bar(sum(total - i for i in range(count)), "layer search", "draft", disable=not progress)
    for _ in range(count):
        scored = []
        for layer in range(total):
            if layer in chosen:
                continue
            candidate = sorted(chosen + [layer])
            scored.append((agreement(expected, build_draft(target, candidate, vocab_map), sequences), candidate))
            bar.update()
        best_score, chosen = max(scored, key=lambda item: item[0])
    bar.close()
    return chosen, best_score

"""What `draftlab design` commands share: the training-text options, the draft vocabulary, the text's record."""

from __future__ import annotations

import argparse

from draftlab.errors import DraftlabError
from draftlab.models import DEFAULT_TARGET


def add_text_args(parser: argparse.ArgumentParser) -> None:
    """The target and where the training text comes from."""
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--datasets", nargs="*", default=["mt-bench", "xsum", "humaneval", "math"],
                        help="prompt sets whose prompts are training / calibration text")
    parser.add_argument("--limit", type=int, default=150, help="prompts per set")
    parser.add_argument("--generate", type=int, default=24, help="prompts continued by the target (its own outputs)")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="length of those continuations")
    parser.add_argument("--corpus", help="extra text: a .txt (blank-line separated) or .jsonl ('text') file")


def check_vocab_size(target, size: int) -> None:
    """Refuse a draft vocabulary larger than the target's, or empty."""
    if not 1 <= size <= target.vocab_size:
        raise DraftlabError(f"--vocab must be in 1..{target.vocab_size}, got {size}")


def frequent_greedy_tokens(target, data: dict, size: int):
    """The draft vocabulary: end-of-sequence ids and the target's most frequent greedy tokens on the text."""
    from collections import Counter

    import torch

    from draftlab.api import eos_ids

    if size < 1:
        raise DraftlabError(f"--vocab must be at least 1, got {size}")
    counts = Counter(data["top1"].flatten().tolist())
    chosen = sorted({*eos_ids(target), *[t for t, _ in counts.most_common(size)]})[:size]
    covered = sum(counts[t] for t in chosen) / max(1, sum(counts.values()))
    print(f"{len(chosen)} output rows cover {covered:.1%} of the target's greedy tokens on this text")
    return torch.tensor(chosen, dtype=torch.long)


def text_record(args, data) -> dict:
    """How a draft's training text was made, for its record."""
    return {"datasets": args.datasets, "limit": args.limit, "generate": args.generate,
            "max_new_tokens": args.max_new_tokens, "corpus": args.corpus, "reuse": args.reuse_text,
            "tokens": int(data["tokens"].numel())}

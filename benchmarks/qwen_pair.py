"""The Qwen2.5-Coder pair: plain decoding of the 1.5B target beside speculation with its 0.5B sibling and
n-gram lookup, greedy, with each output checked against plain decoding. Downloads ~1.6 GB on first use.

    python benchmarks/qwen_pair.py --tokens 40 --ks 1 2 3 5 --dtype fp32
"""

from __future__ import annotations

import argparse
import sys
import time

from draftlab.api import SpeculativeDecoder, encode_prompt
from draftlab.models import load_model

PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively."


def timed(decoder: SpeculativeDecoder, prompt_ids: list[int], tokens: int):
    start = time.perf_counter()
    out = decoder.generate(prompt_ids, max_new_tokens=tokens)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 5])
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--drafters", nargs="+", default=["model:qwen2.5-coder-0.5b", "ngram"])
    args = parser.parse_args()
    target = load_model("qwen2.5-coder-1.5b", dtype=args.dtype)
    prompt_ids = encode_prompt(target.tokenizer, PROMPT, True)
    plain = SpeculativeDecoder.from_names(target, drafter="none")
    plain.generate(prompt_ids, max_new_tokens=4)  # warm-up
    reference, plain_s = timed(plain, prompt_ids, args.tokens)
    print(f"plain decoding: {len(reference.token_ids) / plain_s:.2f} tok/s ({args.dtype})")
    for spec in args.drafters:
        for k in args.ks:
            out, seconds = timed(SpeculativeDecoder.from_names(target, drafter=spec, k=k), prompt_ids, args.tokens)
            print(f"{spec} K={k}: {len(out.token_ids) / seconds:.2f} tok/s = {plain_s / seconds:.2f}x plain; "
                  f"accepted {out.stats.accepted}/{out.stats.drafted}; identical {out.token_ids == reference.token_ids}")
    print("reproduce: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()

"""draftlab serve on the torch backend (CPU or CUDA), in process: aggregate tokens/s with 1, 2 and 4 requests in flight
against `draftlab generate`'s plain decoding of the same target, in one run.

The torch backend keeps a backend per slot and scores the slots' blocks in turn (`BackendSlots`: torch's kernels are
not invariant across the sequences of a batch), so requests share the device, not a forward pass: expect aggregate
throughput near one request's, and latency growing with the load. That is what this measures, with every answer's
tokens checked against `draftlab generate`'s. `--shape NAME` serves random weights in a real model's shape (from
`draftlab.checks.exactness.SHAPES`; `--layers` of them), saved to a temporary directory: true costs without a
download. The last line is one JSON document.

    python benchmarks/serve_slots.py --shape qwen2.5-1.5b --layers 28 --device cuda --dtype bf16
    python benchmarks/serve_slots.py --target smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time

import torch

from draftlab.api import SpeculativeDecoder
from draftlab.backends.routes import cpu_flags
from draftlab.engine import GenerationConfig
from draftlab.serving.build import ServeSettings, build_served
from draftlab.serving.scheduler import Job, LoadK
from draftlab.study.run.budget import HOST_FLAGS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m", help="short name or HF directory")
    parser.add_argument("--shape", default="", help="random weights in this shape instead of --target")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--levels", default="1,2,4")
    parser.add_argument("--drafters", default="none,ngram", help="served drafters (ngram at K 3)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        target = saved_shape(args, scratch) if args.shape else args.target
        rows = measure(target, args)
    host = " ".join(sorted(cpu_flags() & set(HOST_FLAGS))) if args.device == "cpu" else torch.cuda.get_device_name()
    print(f"host: {host}; target "
          f"{args.shape or args.target} ({args.device}, {args.dtype}); {args.tokens} tokens a request, greedy")
    print(f"{'served':<14}{'in flight':>10}{'tok/s':>9}{'x generate':>12}{'s/request':>11}{'identical':>11}")
    for row in rows:
        print(f"{row['drafter']:<14}{row['level']:>10}{row['tokens_per_s']:>9.1f}{row['vs_generate']:>11.2f}x"
              f"{row['latency_s']:>11.2f}{row['identical']:>8}/{row['level']}")
    print(json.dumps({"device": args.device, "target": args.shape or args.target, "rows": rows}))


def saved_shape(args, scratch: str) -> str:
    """Random weights in `args.shape` saved with a word-level tokenizer (what `tests.conftest` builds)."""
    from tests.conftest import shape_model_dir

    dtype = {"auto": torch.bfloat16, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    return str(shape_model_dir(f"{scratch}/model", args.shape, args.layers, dtype, args.device))


def measure(target: str, args) -> list[dict]:
    """`draftlab generate`'s plain rate, then each served drafter at each level (all requests sent at once)."""
    levels = [int(x) for x in args.levels.split(",")]
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 30000, (40 + 8 * i,), generator=generator).tolist() for i in range(max(levels))]
    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1, device=args.device, dtype=args.dtype)
    plain.generate(prompts[0], max_new_tokens=8, temperature=0)  # warm-up (routes, graphs)
    start = time.perf_counter()
    expected = [plain.generate(ids, max_new_tokens=args.tokens, temperature=0).token_ids for ids in prompts]
    generate_rate = sum(map(len, expected)) / (time.perf_counter() - start)
    rows = []
    for drafter in args.drafters.split(","):
        served = build_served(ServeSettings(target, drafter, LoadK.fixed(0 if drafter == "none" else 3),
                                            slots=max(levels), context=1024, backend="auto", device=args.device,
                                            dtype=args.dtype))
        served.scheduler.start()
        try:
            timed(served, prompts[:1], 8)  # warm-up of the served slots
            for level in levels:
                answers, seconds = timed(served, prompts[:level], args.tokens)
                rate = sum(map(len, answers)) / seconds
                rows.append({"drafter": drafter, "level": level, "tokens_per_s": rate,
                             "vs_generate": rate / generate_rate, "latency_s": seconds,
                             "identical": sum(a == e for a, e in zip(answers, expected))})
        finally:
            served.scheduler.stop()
    return rows


def timed(served, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float]:
    """Every prompt submitted at once; their answers' tokens and the wall time until the last is done."""
    answers: list[list[int]] = [[] for _ in prompts]
    left = threading.Semaphore(0)

    def sink(i: int):
        def emit(kind: str, value) -> None:
            if kind == "tokens":
                answers[i].extend(value)
            else:
                left.release()
        return emit

    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        served.scheduler.submit(Job(ids, GenerationConfig(max_new_tokens=tokens), sink(i)))
    for _ in prompts:
        left.acquire()
    return answers, time.perf_counter() - start


if __name__ == "__main__":
    main()

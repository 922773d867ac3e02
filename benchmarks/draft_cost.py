"""What a drafted token of a stand-alone draft model costs on llama.cpp, against a row of its target, in one run.

For the target (on draftlab's exact kernels) and each draft file: one row's step after a 300-token prefix (the median
of 24), llama_decode's share of it, and for the drafts a step of `ModelDrafter` drafting K tokens (what the engine
runs: its catch-up, each token's decode, logits copy and pick), per drafted token; and K greedy tokens fed in one
call into llama.cpp (`greedy_chain`, scripts/llama-cpp/draft-chain.patch) against the Python loop of one `score` a
token (`greedy_rows`), per token, alternating in one run. The ratio a drafted token / a
target row is what decides whether a draft can pay: at acceptance a, K drafted tokens and a block of K+1 rows
costing B(K) rows, a step gives E(a, K) tokens for K x ratio + B(K) rows. The host's CPU flags come with the figures;
the last line is one JSON document.

    python benchmarks/draft_cost.py          # Qwen2.5-Coder 1.5B pure Q4_0, the 0.5B shipped and pure Q4_0, each also
                                             # with a head of its 32768 first tokens (--cut)
    python benchmarks/draft_cost.py --target smollm2-135m@Q4_0_PURE --drafts smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from draftlab.backends import make_backend
from draftlab.backends.base import greedy_rows
from draftlab.backends.gguf_head import derive_trimmed_head
from draftlab.backends.routes import cpu_flags
from draftlab.decoding.sampling import SamplingConfig
from draftlab.drafters.standalone import ModelDrafter
from draftlab.files import assets
from draftlab.models import gguf_path, load_model
from draftlab.drafters.model_spec import gguf_draft
from draftlab.study.run.budget import HOST_FLAGS

PREFIX = list(range(2000, 2300))  # 300 cached tokens, as the exact-kernel probes use


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b@Q4_0_PURE")
    parser.add_argument("--drafts", nargs="+", default=["qwen2.5-coder-0.5b@Q4_K_M_SHIPPED", "qwen2.5-coder-0.5b"],
                        help="draft files: a short name drafts from its pure Q4_0 (as `model:NAME` does); "
                             "NAME@Q4_K_M_SHIPPED the shipped file as it is")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--cut", type=int, default=32768,
                        help="also each short-named draft with an LM head of its first CUT token ids, as a cut draft "
                             "(`draftlab design cut`) runs on llama.cpp (0: not)")
    args = parser.parse_args()
    target = row_costs(load_model(args.target, backend="llamacpp"))
    rows = [{"file": args.target, "role": "target", **target}]
    for name in args.drafts:
        source = name.removesuffix("@Q4_K_M_SHIPPED") if name.endswith("@Q4_K_M_SHIPPED") else gguf_draft(name)
        model = load_model(source, backend="llamacpp", repack=True)  # as `model:NAME` loads a draft
        rows.append({"file": source, "role": "draft", **row_costs(model), **draft_costs(model, args.k),
                     **chain_costs(model, args.k)})
        if args.cut and source != name:
            kept = torch.arange(args.cut)  # [V'] token ids
            trimmed = load_model(str(derive_trimmed_head(gguf_path(source), kept, assets.cache_dir())),
                                 backend="llamacpp", repack=True)
            rows.append({"file": f"{source}/v{args.cut}", "role": "draft", **row_costs(trimmed, kept),
                         **draft_costs(trimmed, args.k, kept), **chain_costs(trimmed, args.k, kept)})
    flags = " ".join(sorted(cpu_flags() & set(HOST_FLAGS))) or "no avx2"
    print(f"host: {flags}; K={args.k}; 300 cached tokens; medians of 24 steps")
    print(f"{'file':<42}{'role':>7}{'row ms':>8}{'decode ms':>11}{'ms/drafted':>12}{'x target row':>14}"
          f"{'one call':>10}{'py loop':>9}")
    for row in rows:
        per = row.get("drafted_token_ms")
        drafted, ratio = ("-", "-") if per is None else (f"{per:.1f}", f"{per / target['row_ms']:.2f}x")
        chain = (f"{row['native_token_ms']:.2f}", f"{row['python_token_ms']:.2f}") if per is not None else ("-", "-")
        print(f"{row['file']:<42}{row['role']:>7}{row['row_ms']:>8.1f}{row['decode_ms']:>11.1f}{drafted:>12}"
              f"{ratio:>14}{chain[0]:>10}{chain[1]:>9}")
    print(json.dumps({"flags": flags, "k": args.k, "rows": rows}))


def row_costs(model, head_rows: torch.Tensor | None = None) -> dict:
    """One token's step through the backend, and llama_decode's own time within it, its logits row copied out (ms,
    medians)."""
    backend = make_backend(model.model, model.device, "llamacpp", head_rows=head_rows)
    backend.reset()
    backend.score(PREFIX, last_only=True)
    steps = []
    for i in range(24):
        start = time.perf_counter()
        backend.score([1000 + i], last_only=True)
        steps.append(time.perf_counter() - start)
    backend.rollback(len(PREFIX))
    decodes, sequences = [], backend.sequences
    for i in range(24):
        start = time.perf_counter()
        sequences._decode([1000 + i], [len(PREFIX) + i], [[0]], [True])  # noqa: SLF001 (the decode and its row out)
        decodes.append(time.perf_counter() - start)
    return {"row_ms": 1e3 * statistics.median(steps), "decode_ms": 1e3 * statistics.median(decodes),
            "numerics": backend.numerics}


def draft_costs(model, k: int, head_rows: torch.Tensor | None = None) -> dict:
    """A `ModelDrafter` step of k greedy tokens after one new context token, per drafted token (ms, median of 8)."""
    drafter = ModelDrafter(make_backend(model.model, model.device, "llamacpp", head_rows=head_rows), "draft",
                           head_rows, model.vocab_size)
    context = list(PREFIX)
    drafter.begin(context)
    drafter.propose(context, k, SamplingConfig(0.0), None)
    steps = []
    for i in range(8):
        context.append(1000 + i)
        start = time.perf_counter()
        drafter.propose(context, k, SamplingConfig(0.0), None)
        steps.append(time.perf_counter() - start)
    return {"drafted_token_ms": 1e3 * statistics.median(steps) / k}


def chain_costs(model, k: int, head_rows: torch.Tensor | None = None) -> dict:
    """k greedy tokens fed after the prefix, in one native call (`greedy_chain`) and one `score` a token
    (`greedy_rows`), alternating; ms per token (medians of 8 each)."""
    backend = make_backend(model.model, model.device, "llamacpp", head_rows=head_rows)
    backend.reset()
    backend.score(PREFIX, last_only=True)
    ways = {"native_token_ms": backend.greedy_chain, "python_token_ms": lambda *a: greedy_rows(backend, *a)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for i in range(8):
        for name, chain in ways.items():
            backend.rollback(len(PREFIX))
            start = time.perf_counter()
            chain(1000 + i, k, head_rows)
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) / k for name, t in times.items()}


if __name__ == "__main__":
    main()

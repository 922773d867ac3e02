"""The weight-type race on llama-server: each GGUF type of a target x the server's plain decoding and its own
speculative types, on the same prompts in one measurement loop, with file size, output identity and quality.

Per weight type (the shipped file, then each type derived from it with llama.cpp's quantizer): llama-server's plain
decoding and each `--servers` configuration, all interleaved per prompt (`draftlab.measure`). Printed per dataset and
type: file size, plain and best speculative end-to-end tok/s, both as ratios to the *shipped* type's plain decoding
on the server (the issue's mark: 1.5x on code-edit), outputs equal to the shipped type's plain decoding, outputs of
the best configuration equal to its own type's plain decoding (the server's speculation is lossless only up to
rounding), and the mean log-likelihood per token of the shipped type's plain outputs under each type (scored by
draftlab's llama.cpp backend: how far another rounding of the model moved from the shipped one). The last line is
one JSON document.

    python benchmarks/weight_types.py --target smollm2-135m --types BF16 Q8_0
    python benchmarks/weight_types.py --target qwen2.5-coder-1.5b --types Q8_0 BF16 --limit 4
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from draftlab.api import SpeculativeDecoder, prompt_ids
from draftlab.backends.routes import cpu_flags
from draftlab.files.datasets import load_prompts
from draftlab.measure import END_TO_END, EncodedPrompt, RunSettings, measure
from draftlab.models import gguf_path
from draftlab.contenders.server_configs import ServerPool, parse_server_spec, spec_config

SHIPPED = "shipped"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--types", nargs="+", default=["BF16", "Q8_0"], help="weight types derived from the shipped GGUF")
    parser.add_argument("--servers", nargs="+", default=["ngram-mod", "ngram-simple:16"])
    parser.add_argument("--datasets", nargs="+", default=["code-edit", "humaneval"])
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    sources = {SHIPPED: args.target, **{kind: f"{args.target}@{kind}" for kind in args.types}}
    files = {kind: gguf_path(source) for kind, source in sources.items()}  # derives the types once (cached)
    configs = {"plain": ("none", 0), **{drafter + (f" K={k}" if k else ""): (drafter, k)
                                         for spec in map(parse_server_spec, args.servers)
                                         for drafter, k in spec.configurations()}}
    tokenizer = SpeculativeDecoder.from_names(args.target, drafter="none", k=1, backend="llamacpp").target.tokenizer
    report = {}
    with tempfile.TemporaryDirectory() as logs:
        pool = ServerPool(Path(logs))
        try:
            contenders = {(kind, name): pool.contender(spec_config(files[kind], *config))
                          for kind in sources for name, config in configs.items()}
            for dataset in args.datasets:
                prompts = [EncodedPrompt(p.id, p.category, prompt_ids(tokenizer, p))
                           for p in load_prompts(dataset, args.limit)]
                measured = measure(contenders, prompts, RunSettings(args.max_new_tokens), warmup=1, progress=dataset)
                report[dataset] = summarize(measured, prompts, sources, configs)
        finally:
            pool.stop_all()
    for dataset, rows in report.items():
        print_dataset(dataset, rows, args)
    print(f"command: python {' '.join(sys.argv)}")
    print(f"host CPU flags: {' '.join(sorted(f for f in cpu_flags() if f.startswith(('avx', 'amx', 'f16c', 'fma'))))}")
    print(json.dumps({"target": args.target, "datasets": report, "cpu_flags": sorted(cpu_flags()),
                      "megabytes": {kind: files[kind].stat().st_size / 1e6 for kind in files}}))


def summarize(measured, prompts: list[EncodedPrompt], sources: dict, configs: dict) -> dict:
    """Per type: speeds, identity and the shipped outputs' log-likelihood under it."""
    shipped = measured.records[(SHIPPED, "plain")]
    base = measured.tokens_per_s((SHIPPED, "plain"), END_TO_END)
    out = {}
    for kind, source in sources.items():
        speeds = {name: measured.tokens_per_s((kind, name), END_TO_END) for name in configs}
        best = max((name for name in configs if name != "plain"), key=lambda name: speeds[name])
        plain = measured.records[(kind, "plain")]
        out[kind] = {
            "plain_tokens_per_s": speeds["plain"], "plain_vs_shipped_plain": speeds["plain"] / base,
            "best": best, "best_tokens_per_s": speeds[best], "best_vs_shipped_plain": speeds[best] / base,
            "speeds": speeds,
            "plain_identical_to_shipped": sum(a.token_ids == b.token_ids for a, b in zip(plain, shipped)),
            "best_identical_to_own_plain": sum(a.token_ids == b.token_ids
                                               for a, b in zip(measured.records[(kind, best)], plain)),
            "loglik_per_token": log_likelihood(source, prompts, [r.token_ids for r in shipped]),
            "prompts": len(prompts),
        }
    return out


def log_likelihood(source: str, prompts: list[EncodedPrompt], outputs: list[list[int]]) -> float:
    """Mean log-probability per token of `outputs` (after their prompts) under the model `source` on llama.cpp."""
    backend = SpeculativeDecoder.from_names(source, drafter="none", k=1, backend="llamacpp").target_backend
    total, count = 0.0, 0
    for prompt, output in zip(prompts, outputs):
        backend.reset()
        logits = backend.score(prompt.ids + output)  # [P + N, V]
        rows = torch.log_softmax(logits[len(prompt.ids) - 1:-1].float(), dim=-1)  # [N, V]: row i predicts output[i]
        total += rows.gather(1, torch.tensor(output).unsqueeze(1)).sum().item()
        count += len(output)
    return total / count if count else 0.0


def print_dataset(dataset: str, rows: dict, args) -> None:
    print(f"{dataset}: {rows[SHIPPED]['prompts']} prompts, {args.max_new_tokens} new tokens, llama-server, end to end")
    print(f"{'type':<9}{'plain tok/s':>12}{'x shipped':>10}  {'best configuration':<20}{'tok/s':>8}{'x shipped':>10}"
          f"{'plain = shipped':>17}{'best = own plain':>18}{'loglik/token':>14}")
    for kind, row in rows.items():
        n = row["prompts"]
        print(f"{kind:<9}{row['plain_tokens_per_s']:>12.1f}{row['plain_vs_shipped_plain']:>9.2f}x  {row['best']:<20}"
              f"{row['best_tokens_per_s']:>8.1f}{row['best_vs_shipped_plain']:>9.2f}x"
              f"{row['plain_identical_to_shipped']:>14}/{n}{row['best_identical_to_own_plain']:>15}/{n}"
              f"{row['loglik_per_token']:>14.4f}")
    best_kind = max(rows, key=lambda kind: rows[kind]["best_tokens_per_s"])
    print(f"fastest: {best_kind} {rows[best_kind]['best']}, {rows[best_kind]['best_vs_shipped_plain']:.2f}x the shipped "
          "type's plain decoding on llama-server")


if __name__ == "__main__":
    main()

"""Our engine against Hugging Face `generate`, on the same pair, K and prompts, in one run.

Measures, per drafter, on real prompts and the real target:
  ar      our autoregressive loop (the engine with no drafter)
  hf      HF generate, greedy
  hf_asg  HF generate(assistant_model=draft) with a constant K and no confidence cut-off
          (for ngram: generate(prompt_lookup_num_tokens=K))
  sps     our speculative engine
and prints tokens/s, the ratios sps/hf_asg and ar/hf, and how close sps comes
to the throughput TAR / (t_target + t_draft) predicts from its own timings.
Methods run back to back on each prompt, so that machine drift hits all alike.
The last line of stdout is one JSON document.

    python benchmarks/engine_vs_hf.py --drafters layers:0-3 model:smollm2-135m ngram --k 4 --limit 6
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from draftlab.api import SpeculativeDecoder, eos_ids, parse_drafter_spec, prompt_ids
from draftlab.hf_reference import hf_assist, hf_generate
from draftlab.datasets import load_prompts
from draftlab.models import load_model


def bench_drafter(target, spec: str, k: int, encoded, max_new_tokens: int) -> dict:
    sps = SpeculativeDecoder.from_names(target, drafter=spec, k=k)
    ar = sps.autoregressive()
    eos = eos_ids(target)
    assist = hf_assist(parse_drafter_spec(spec), sps.draft_model, k)
    totals = {m: [0, 0.0] for m in ("ar", "hf", "hf_asg", "sps")}
    busy = tar_steps = 0.0
    identical = 0
    for i, ids in enumerate(encoded):
        warm = i == 0  # the first prompt also warms every path up, untimed
        for _ in range(2 if warm else 1):
            r_ar = ar.generate(ids, max_new_tokens=max_new_tokens)
            hf_ids, hf_wall = hf_generate(target, ids, max_new_tokens, eos)
            asg_ids, asg_wall = hf_generate(target, ids, max_new_tokens, eos, assist=assist)
            r_sps = sps.generate(ids, max_new_tokens=max_new_tokens)
        identical += r_ar.token_ids == r_sps.token_ids
        for name, (tokens, wall) in {
            "ar": (r_ar.stats.new_tokens, r_ar.stats.wall_s),
            "sps": (r_sps.stats.new_tokens, r_sps.stats.wall_s),
            "hf": (len(hf_ids), hf_wall), "hf_asg": (len(asg_ids), asg_wall),
        }.items():
            totals[name][0] += tokens
            totals[name][1] += wall
        s = r_sps.stats
        busy += s.prefill_s + s.draft_s + s.target_s
        tar_steps += s.steps
    tps = {m: t / w for m, (t, w) in totals.items()}
    return {
        "drafter": spec, "k": k, "prompts": len(encoded), "identical": identical, "tokens_per_s": tps,
        "sps_over_hf_asg": tps["sps"] / tps["hf_asg"], "ar_over_hf": tps["ar"] / tps["hf"],
        "sps_over_ar": tps["sps"] / tps["ar"], "sps_tokens_per_step": totals["sps"][0] / tar_steps,
        "sps_over_model_prediction": (totals["sps"][0] / totals["sps"][1]) / (totals["sps"][0] / busy),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--drafters", nargs="+", default=["layers:0-3", "model:smollm2-135m", "ngram"])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--dataset", default="mixed")
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    target = load_model(args.target)
    prompts = load_prompts(args.dataset, args.limit)
    encoded = [prompt_ids(target.tokenizer, p) for p in prompts]
    results = [bench_drafter(target, spec, args.k, encoded, args.max_new_tokens) for spec in args.drafters]
    print(f"target={args.target} k={args.k} dataset={args.dataset} prompts={len(prompts)} "
          f"max_new_tokens={args.max_new_tokens} torch={torch.__version__} threads={torch.get_num_threads()}")
    print(f"{'drafter':<22}{'AR':>7}{'HF':>7}{'HF-AsG':>8}{'SpS':>7}{'TAR':>6}  {'SpS/AsG':>8}{'AR/HF':>7}{'SpS/AR':>8}{'SpS/model':>10}{'identical':>10}")
    for r in results:
        t = r["tokens_per_s"]
        print(f"{r['drafter']:<22}{t['ar']:>7.1f}{t['hf']:>7.1f}{t['hf_asg']:>8.1f}{t['sps']:>7.1f}"
              f"{r['sps_tokens_per_step']:>6.2f}  {r['sps_over_hf_asg']:>7.2f}x{r['ar_over_hf']:>6.2f}x"
              f"{r['sps_over_ar']:>7.2f}x{r['sps_over_model_prediction']:>9.2f}x{r['identical']:>7}/{r['prompts']}")
    print("tokens/s; SpS/model = measured SpS throughput over TAR / (t_target + t_draft) from the same runs")
    print("reproduce: python " + " ".join(sys.argv))
    print(json.dumps({"machine": platform.machine(), "torch": torch.__version__, "args": vars(args), "results": results}))


if __name__ == "__main__":
    main()

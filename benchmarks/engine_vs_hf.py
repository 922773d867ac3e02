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
from draftlab.contenders.hf import HFGenerate, hf_assist
from draftlab.measure import DECODE, END_TO_END, EncodedPrompt, RunSettings, measure
from draftlab.contenders.plain import autoregressive
from draftlab.files.datasets import load_prompts
from draftlab.models import load_model


def bench_drafter(target, spec: str, k: int, encoded, max_new_tokens: int) -> dict:
    """Our plain and speculative decoding beside HF `generate` and assisted generation, through the measurement
    loop (interleaved per prompt, warm-up first)."""
    sps = SpeculativeDecoder.from_names(target, drafter=spec, k=k)
    eos = eos_ids(target)
    assist = hf_assist(parse_drafter_spec(spec), sps.draft_model, k)
    contenders = {"ar": autoregressive(sps), "hf": HFGenerate(target, eos), "hf_asg": HFGenerate(target, eos, assist),
                  "sps": sps}
    prompts = [EncodedPrompt(str(i), "", ids) for i, ids in enumerate(encoded)]
    measured = measure(contenders, prompts, RunSettings(max_new_tokens), warmup=1)
    tps = {m: measured.tokens_per_s(m, END_TO_END) for m in contenders}
    runs = measured.records["sps"]
    busy = sum(r.stats.prefill_s + r.stats.draft_s + r.stats.target_s for r in runs)
    new_tokens = sum(r.new_tokens for r in runs)
    return {
        "drafter": spec, "k": k, "prompts": len(encoded), "tokens_per_s": tps,
        "identical": sum(a.token_ids == b.token_ids for a, b in zip(measured.records["ar"], runs)),
        "sps_over_hf_asg": measured.speedup("sps", "hf_asg", END_TO_END),
        "ar_over_hf": measured.speedup("ar", "hf", END_TO_END), "sps_over_ar": measured.speedup("sps", "ar", END_TO_END),
        "sps_decode_over_ar": measured.speedup("sps", "ar", DECODE),
        "sps_tokens_per_step": new_tokens / sum(r.stats.steps for r in runs),
        "sps_over_model_prediction": tps["sps"] / (new_tokens / busy),
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

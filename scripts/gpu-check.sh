#!/usr/bin/env bash
# draftlab on an NVIDIA GPU, in one run: row invariance per op and model shape (`draftlab check exact`), the GPU tests
# (the shape matrix in fp32, bf16 and fp16, trees included; greedy equality in bf16 for every drafter at K 1, 3, 5, 8;
# bitwise block rows on the route timed there), the block-cost curve to 16 tokens on the GPU beside this machine's
# CPU, and a small study on CUDA (HumanEval) with HF assisted generation beside draftlab, each against its own plain
# decoding, ending with the configuration in vLLM's, SGLang's and llama-server's syntax.
#
#   bash scripts/gpu-check.sh [OUT_DIR]        (PYTHON=... to pick the interpreter; default python3)
#
# Each stage has its own time limit and writes its log under OUT_DIR; a failing stage does not stop the next.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
stage() {  # stage NAME SECONDS COMMAND...: run it with a time limit, log to OUT/NAME.log, say how it ended
  local name=$1 seconds=$2 start=$SECONDS
  shift 2
  timeout "$seconds" "$@" >"$out/$name.log" 2>&1
  echo "gpu-check: $name ended with $? after $((SECONDS - start)) s (log: $out/$name.log)"
}
nvidia-smi -L | tee "$out/gpu.txt"
$py -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__, '|',
torch.cuda.get_device_name())" | tee -a "$out/gpu.txt"
stage exact 120 $py -m draftlab.cli check exact --device cuda --prefixes 17 300 700
stage tests 200 $py -m pytest -m gpu -rs -q tests/gpu tests/test_shape_matrix.py --durations=15
stage blocks 120 $py benchmarks/backend_limits.py --devices cuda cpu --dtypes bf16 --tokens 32 --rounds 5 \
  --routes linear exact-linear/1 exact-linear/8 exact-linear/16 exact-wm/16 --prefill-tokens 1024
stage sweep 190 $py -m draftlab.cli sweep --db "$out/study.sqlite" --targets smollm2-135m --device cuda --dtype bf16 \
  --methods sps asg hf --drafters ngram layers:0-3 designed tree:2x2:designed eagle3 tree:2x2:eagle3 suffix --ks 1,3,5 \
  --datasets humaneval --limit 3 --max-new-tokens 96 --no-progress
stage report 60 $py -m draftlab.cli report --db "$out/study.sqlite" --out "$out/report" --export vllm sglang llama-server
tail -n 25 "$out/exact.log" "$out/tests.log" "$out/blocks.log"
grep -E "^(Fastest|Use|vllm|sglang|llama-server|smollm2)" "$out/report.log"

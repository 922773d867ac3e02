#!/usr/bin/env bash
# draftlab on an NVIDIA GPU, in one run of about 5 minutes (a lent GPU's time is short): row invariance per op and
# model shape for each way the exact route can run its blocks (`draftlab check exact --step ...`: the eager step,
# static passes replayed as CUDA graphs with attention by rows or in one call), the shape matrix's tests, and plain
# decoding's share of the bandwidth limit with the block-cost curve to 16 tokens on random weights in the Qwen2.5 7B
# and 1.5B shapes (bf16), each step beside the others in one run.
#
#   bash scripts/gpu-check.sh [OUT_DIR]        (PYTHON=... to pick the interpreter; default python3)
#
# Each stage has its own time limit and writes its log under OUT_DIR; a failing stage does not stop the next. No
# stage needs a download: the weights are random, in real models' shapes.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
$py -c "import draftlab" 2>/dev/null || export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
label=gpu-check
source scripts/gpu-stage.sh
{ nvidia-smi -L; $py -c "import torch, transformers; print('torch', torch.__version__, '| transformers',
transformers.__version__, '|', torch.cuda.get_device_name())"; } | tee "$out/gpu.txt"
stage exact 90 $py -m draftlab.cli check exact --device cuda --step graphs off --dtypes fp32 bf16 --prefixes 17 300
stage exact-block 40 $py -m draftlab.cli check exact --device cuda --step graphs-block --dtypes fp32 bf16 --prefixes 300
steps="off graphs graphs-block"
stage blocks-7b 80 $py benchmarks/backend_limits.py --shape qwen2.5-7b --devices cuda --dtypes bf16 --tokens 32 \
  --rounds 3 --routes linear exact-linear/16 --steps $steps --prefill-tokens 512
stage blocks-1.5b 50 $py benchmarks/backend_limits.py --shape qwen2.5-1.5b --devices cuda --dtypes bf16 --tokens 32 \
  --rounds 3 --routes linear exact-linear/16 --steps $steps --prefill-tokens 512
stage tests 40 $py -m pytest -m gpu -rs -q -x tests/test_shape_matrix.py -k "bf16 and graphs-block" --durations=5
grep -hE "DIFFER|^check exact|rror" "$out/exact.log" "$out/exact-block.log" | tail -n 16
for log in blocks-7b blocks-1.5b; do grep -E "^cuda |auto|fastest|HF|rror|failed" "$out/$log.log" | head -n 12; done
tail -n 6 "$out/tests.log"

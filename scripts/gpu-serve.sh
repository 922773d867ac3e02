#!/usr/bin/env bash
# draftlab serve on an NVIDIA GPU (the torch backend), in one run of about 5 minutes, after scripts/gpu-check.sh:
# the serve tests under `pytest -m gpu` (each request decodes as alone whatever else is in flight, in process and as
# a started server answering over HTTP), served throughput at 1, 2 and 4 requests in flight on random weights in the
# Qwen2.5-1.5B shape against `draftlab generate`, and the Qwen2.5-0.5B shape's step beside the 1.5B's (a draft
# token's price on the GPU).
#
#   bash scripts/gpu-serve.sh [OUT_DIR]        (PYTHON=... to pick the interpreter; default python3)
#
# The server needs fastapi and uvicorn where it runs. Each stage has its own time limit and writes its log under
# OUT_DIR; a failing stage does not stop the next. No stage needs a download.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-serve}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
label=gpu-serve
source scripts/gpu-stage.sh
stage serve-tests 150 $py -m pytest -m gpu -rs -q tests/test_serve_torch.py --durations=3
stage serve-slots 100 $py benchmarks/serve_slots.py --shape qwen2.5-1.5b --layers 28 --device cuda --dtype bf16 \
  --tokens 64
stage draft-0.5b 45 $py benchmarks/backend_limits.py --shape qwen2.5-0.5b --devices cuda --dtypes bf16 --tokens 32 \
  --rounds 3 --routes linear exact-linear/16 --steps graphs-block --prefill-tokens 512
tail -n 4 "$out/serve-tests.log"
grep -vE "^\{" "$out/serve-slots.log" | tail -n 9
grep -E "^cuda |auto|fastest|rror|failed" "$out/draft-0.5b.log" | head -n 8

#!/usr/bin/env bash
# Build the designed draft for smollm2-135m: 2 layers searched for agreement with the target, an output
# vocabulary cut to the tokens of the calibration text (up to 8192; 3725 with these settings), then ~15
# minutes of distillation on the target's own outputs (2 CPU cores).
#   bash scripts/build-draft.sh [OUT]        (default OUT: drafts/smollm2-d2-kd; about 30 minutes in all)
# Use it with: draftlab bench --drafter model:OUT --k 2 --dataset mt-bench --skip 40 --limit 8
# MT-Bench prompts 0-39 (round-robin over categories) are training text; evaluate with --skip 40.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-drafts/smollm2-d2-kd}
PRUNED="$OUT-pruned"
.venv/bin/draftlab design prune --target smollm2-135m --search 2 --vocab 8192 --generate 0 --limit 30 --out "$PRUNED"
.venv/bin/draftlab design distill --target smollm2-135m --init "$PRUNED" --out "$OUT" --budget 900 \
  --checkpoint-every 150 --datasets mt-bench:40 humaneval:60 xsum:300 math:300 --generate 100 --max-new-tokens 128

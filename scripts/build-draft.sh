#!/usr/bin/env bash
# Build the designed draft for smollm2-135m: a feature draft (EAGLE-style: one decoder layer that reads the
# target's hidden states, initialised from the target's last layer, an 8192-token output vocabulary), trained
# on the target's own answers to 1200 prompts (bf16 batched generation, ~20 min on 2 CPU cores), then 30
# minutes of training. About an hour in all; resumes where it stopped when run again.
#   bash scripts/build-draft.sh [OUT]        (default OUT: drafts/smollm2-feature)
# Use it with: draftlab bench --drafter model:OUT --k 2 --dataset mt-bench --skip 40 --limit 8
# MT-Bench prompts 0-39 (round-robin over categories) are training text; evaluate with --skip 40.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-drafts/smollm2-feature}
.venv/bin/draftlab design feature --target smollm2-135m --out "$OUT" --budget 1800 --checkpoint-every 120 \
  --datasets mt-bench:40 questions:960 math:100 humaneval:60 xsum:40 --generate 1200 --max-new-tokens 160 \
  --vocab 8192

#!/usr/bin/env bash
# Build the designed draft for smollm2-135m: a feature draft (EAGLE-style: one decoder layer that reads the
# target's hidden states, initialised from the target's last layer, an 8192-token output vocabulary), trained
# on the target's own answers to 480 of the 1200 prompts (batched generation in the dtype `auto` picks: ~13
# min on 2 CPU cores without native bf16), then 15 minutes of training. About 30 minutes in all; resumes
# where it stopped when run again. This is the command that made the draft shipped in
# src/draftlab/drafts/smollm2-135m (its record says how long each part took).
#   bash scripts/build-draft.sh [OUT]        (default OUT: drafts/smollm2-feature)
# Use it with: draftlab bench --drafter model:OUT --k 2 --dataset mt-bench --skip 40 --limit 8
# MT-Bench prompts 0-39 (round-robin over categories) are training text; evaluate with --skip 40.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-drafts/smollm2-feature}
.venv/bin/draftlab design feature --target smollm2-135m --out "$OUT" --budget 900 --checkpoint-every 120 \
  --datasets mt-bench:40 questions:960 math:100 humaneval:60 xsum:40 --generate 480 --max-new-tokens 128 \
  --vocab 8192

#!/usr/bin/env bash
# Build the EAGLE-3 draft shipped for smollm2-135m: one decoder layer reading the target's layers 2, 15 and 27
# (fused by fc), initialised from the target's last layer with its MLP cut to its 1024 strongest channels, an
# 8192-token output vocabulary (the target's head rows), trained with training-time test (3 drafted positions)
# for 700 steps (~35 min on 2 AVX2 cores): a step budget, so that the same command writes the same draft again
# (on the same host: another CPU may round differently).
# The training text is the designed feature draft's (scripts/build-draft.sh: the target's own answers to 480 of
# 1200 prompts; ~17 min on 2 CPU cores without native bf16, reused from --reuse-text DIR when given). Resumes
# where it stopped when run again. Also writes the engines' checkpoint (vLLM, SGLang) and, with llama-server
# built (scripts/build-llama-cpp.sh), llama.cpp's GGUF.
#   bash scripts/build-eagle3.sh [OUT]        (default OUT: drafts/smollm2-eagle3)
# Use it with: draftlab bench --drafter model:OUT --k 3 --dataset humaneval --skip 60 --limit 20
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-drafts/smollm2-eagle3}
.venv/bin/draftlab design eagle3 --target smollm2-135m --out "$OUT" --steps "${STEPS:-700}" --checkpoint-every 120 \
  --datasets mt-bench:40 questions:960 math:100 humaneval:60 xsum:40 --generate 480 --max-new-tokens 128 \
  --vocab 8192 --intermediate-size 1024 --gguf

#!/usr/bin/env bash
# Build an EAGLE-3 draft: one decoder layer reading three target layers' inputs (fused by fc), initialised from the
# target's last layer with its MLP cut to its 1024 strongest channels, an 8192-token output vocabulary (the target's
# head rows), trained with training-time test (3 drafted positions) for a step budget, so that the same command writes
# the same draft again (on the same host: another CPU may round differently). Resumes where it stopped when run again.
#
#   bash scripts/build-eagle3.sh [OUT]
#     the draft shipped for smollm2-135m (default OUT: drafts/smollm2-eagle3), reading layers 2, 15 and 27: 700 steps
#     (~35 min on 2 AVX2 cores) on the designed feature draft's text (scripts/build-draft.sh: the target's own answers
#     to 480 of 1200 prompts; ~17 min on 2 CPU cores without native bf16, reused from --reuse-text DIR when given);
#     also the engines' checkpoint (vLLM, SGLang) and, with llama-server built (scripts/build-llama-cpp.sh),
#     llama.cpp's GGUF. Use it with: draftlab bench --drafter model:OUT --k 3 --dataset humaneval --skip 60 --limit 20
#   bash scripts/build-eagle3.sh --target qwen2.5-coder-1.5b [OUT]
#     the draft `--drafter eagle3` (and `draftlab study --preset family`) finds for the Qwen2.5-Coder 1.5B (default
#     OUT: draftlab's cache, `draftlab.drafters.shipped.built_draft_dir`), trained on the pure-Q4_0 GGUF the family
#     study runs in llama.cpp (de-quantized into torch): the target's answers to 64 HumanEval stubs (16-79: none of the
#     ones the study measures, nor the functions its code edits copy), 16 more stubs, 40 MT-Bench and 100 questions
#     prompts as text, 100 steps of 8 x 128 tokens (~45 min on 2 AVX2 cores, ~14 GB of memory).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--target" ]; then
  target=${2:?--target needs a name}
  [ "$target" = "qwen2.5-coder-1.5b" ] || { echo "build-eagle3: a recipe exists for smollm2-135m and qwen2.5-coder-1.5b, not $target" >&2; exit 2; }
  OUT=${3:-$(.venv/bin/python -c "from draftlab.drafters.shipped import built_draft_dir; print(built_draft_dir('$target', 'eagle3'))")}
  exec .venv/bin/draftlab design eagle3 --target "$target@Q4_0_PURE" --out "$OUT" --steps "${STEPS:-100}" \
    --checkpoint-every 300 --datasets humaneval:16-96 mt-bench:40 questions:100 --generate 64 --max-new-tokens 128 \
    --seq-len 128 --vocab 8192 --intermediate-size 1024
fi
OUT=${1:-drafts/smollm2-eagle3}
.venv/bin/draftlab design eagle3 --target smollm2-135m --out "$OUT" --steps "${STEPS:-700}" --checkpoint-every 120 \
  --datasets mt-bench:40 questions:960 math:100 humaneval:60 xsum:40 --generate 480 --max-new-tokens 128 \
  --vocab 8192 --intermediate-size 1024 --gguf

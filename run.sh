#!/usr/bin/env bash
# Set up draftlab in ./.venv and run the main job on the embedded default model.
#   ./run.sh              set up, then the main job
#   ./run.sh --setup-only set up only (what CI does before the tests)
# Extra arguments after the flags go to the main job.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first: 2.13.0 is the CPU wheel on CPU-only machines; on a machine that
# already has a torch (a CUDA build, say) we keep it.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
fi
.venv/bin/python -m pip install --quiet -e ".[test]"
if [ "${1:-}" = "--setup-only" ]; then
  exit 0
fi
exec .venv/bin/draftlab bench --target smollm2-135m --drafter ngram --k 4 --dataset mixed --limit 8 "$@"

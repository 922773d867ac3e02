#!/usr/bin/env bash
# Set up draftlab in ./.venv and run the main job on the embedded default model:
# the quick study (sweep over drafts x K x SpS/AsG on smollm2-135m, on draftlab's torch backend and on llama.cpp,
# with llama-cpp-python's own prompt lookup and llama-server's own n-gram speculation; then the report).
#   ./run.sh              set up, then the quick study into results/quick/
#   ./run.sh --preset full   the full study (extra arguments go to `draftlab study`)
#   ./run.sh --setup-only set up only (what CI does before the tests)
#   ./run.sh --with vllm [...]  also make vLLM's own environment in draftlab's cache (3.4 GB, minutes; once), then go on
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
# llama.cpp, compiled once here (~6 minutes on 2 cores, cached in ~/.cache/draftlab) for both of its engines:
# llama-cpp-python (the llamacpp backend) and llama-server, the server CPU users deploy, load the same libraries, with
# draftlab's exact kernels (scripts/llama-cpp/*.patch: a row of a block rounds as the row scored alone, at every block
# size); llama.cpp's stock ggml-cpu is built beside them only when a benchmark asks (--stock). Both without ggml's AMX kernels, which crash every
# decode on AMX CPUs; what is installed is checked (docs/backends.md). The study races llama-server's own
# speculation beside draftlab's; a failed build leaves the llama.cpp engines out, with one line.
if ! bash scripts/build-llama-cpp.sh .venv/bin/python >/dev/null; then
  # An installed library that holds AMX kernels (exit 1) stops here; a build that failed leaves the engines out.
  if [ "$(bash scripts/check-no-amx.sh .venv/bin/python 2>/dev/null; echo $?)" = 1 ]; then
    echo "run.sh: the installed llama.cpp holds ggml's AMX kernels (scripts/check-no-amx.sh)" >&2; exit 1
  fi
  echo "run.sh: llama.cpp was not built (see above); the study leaves its llama.cpp cells out"
fi
# Suffix decoding (--drafter suffix) runs Arctic Inference's suffix trees, as vLLM does. 0.3.0 is a source package
# (~20 s to build) whose build needs these tools and this venv's Python first on PATH (else CMake finds another).
if ! .venv/bin/python -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet "nanobind==2.9.2" grpcio-tools "protobuf==5.29.6" cmake ninja
  PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -m pip install --quiet --no-build-isolation --no-deps \
    "arctic-inference==0.3.0"
fi
# The quick study's llama.cpp target: SmolLM2 in pure Q4_0, derived once from the shipped Q4_1 (seconds, cached).
if .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
  .venv/bin/python -c "from draftlab.models import gguf_path; gguf_path('smollm2-135m@Q4_0_PURE')" >/dev/null
fi
# vLLM, on demand only: its own environment in draftlab's cache, never this venv (draftlab.contenders.vllm_env).
if [ "${1:-}" = "--with" ] && [ "${2:-}" = "vllm" ]; then
  .venv/bin/python -m draftlab.contenders.vllm_env || echo "run.sh: vLLM was not installed (see above); its cells are left out"
  shift 2
fi
if [ "${1:-}" = "--setup-only" ]; then
  exit 0
fi
exec .venv/bin/draftlab study --out results/quick "$@"

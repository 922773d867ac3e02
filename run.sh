#!/usr/bin/env bash
# Set up draftlab in ./.venv and run the main job on the embedded default model:
# the quick study (sweep over drafts x K x SpS/AsG on smollm2-135m, on draftlab's torch backend and on llama.cpp,
# with llama-cpp-python's own prompt lookup and llama-server's own n-gram speculation; then the report).
#   ./run.sh              set up, then the quick study into results/quick/
#   ./run.sh --preset full   the full study (extra arguments go to `draftlab study`)
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
# llama.cpp (the llamacpp backend) compiles with this machine's compiler, ~4 minutes on 2 cores the first time
# (pip caches the wheel). Without llamafile's sgemm, a row of a block rounds as the row scored alone. Without ggml's
# AMX kernels (which `-march=native` compiles in on AMX CPUs): they crash every decode there (docs/backends.md).
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_LLAMAFILE=OFF -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'"
CMAKE_ARGS="$LLAMA_CMAKE_ARGS" .venv/bin/python -m pip install --quiet -e ".[test,llamacpp]"
# pip reuses a cached wheel whatever CMAKE_ARGS says: check what is installed, and rebuild a library that holds AMX.
if ! bash scripts/check-no-amx.sh .venv/bin/python; then
  echo "run.sh: the installed llama.cpp holds ggml's AMX kernels (a cached wheel); rebuilding it without them (~4 min)"
  CMAKE_ARGS="$LLAMA_CMAKE_ARGS" .venv/bin/python -m pip install --quiet --no-cache-dir --force-reinstall --no-deps \
    "llama-cpp-python==0.3.36"
  bash scripts/check-no-amx.sh .venv/bin/python || { echo "run.sh: llama.cpp still holds AMX kernels" >&2; exit 1; }
fi
# Suffix decoding (--drafter suffix) runs Arctic Inference's suffix trees, as vLLM does. 0.3.0 is a source package
# (~20 s to build) whose build needs these tools and this venv's Python first on PATH (else CMake finds another).
if ! .venv/bin/python -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet "nanobind==2.9.2" grpcio-tools "protobuf==5.29.6" cmake ninja
  PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -m pip install --quiet --no-build-isolation --no-deps \
    "arctic-inference==0.3.0"
fi
# llama-server, the server CPU users deploy, from the same llama.cpp source (~4-10 minutes on 2 cores, once, cached):
# the study races its own speculative types beside draftlab's. Without it those cells are left out, with one line.
PYTHON=.venv/bin/python bash scripts/build-llama-server.sh >/dev/null \
  || echo "run.sh: llama-server was not built (see above); the study leaves its cells out"
if [ "${1:-}" = "--setup-only" ]; then
  exit 0
fi
exec .venv/bin/draftlab study --out results/quick "$@"

#!/usr/bin/env bash
# Exit 0 when the llama.cpp library that llama-cpp-python installed in PYTHON's environment holds none of ggml's AMX
# kernels (`nm -D` shows no ggml_backend_amx_* symbol), 1 when it does, 2 when there is no such library. What is
# installed is checked, not what was asked for: pip reuses a cached wheel whatever CMAKE_ARGS says.
#   scripts/check-no-amx.sh [PYTHON]
set -uo pipefail
PYTHON=${1:-python3}
libdir=$("$PYTHON" -c "import importlib.util, pathlib; s = importlib.util.find_spec('llama_cpp'); \
print(pathlib.Path(s.origin).parent / 'lib')" 2>/dev/null) || { echo "check-no-amx: llama-cpp-python is not installed" >&2; exit 2; }
shopt -s nullglob
libs=("$libdir"/libggml*.so*)
[ ${#libs[@]} -gt 0 ] || { echo "check-no-amx: no ggml library in $libdir" >&2; exit 2; }
for lib in "${libs[@]}"; do
  if nm -D "$lib" 2>/dev/null | grep -q 'ggml_backend_amx'; then
    echo "check-no-amx: $lib holds ggml's AMX kernels" >&2
    exit 1
  fi
done

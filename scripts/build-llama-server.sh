#!/usr/bin/env bash
# Build llama-server, llama.cpp's OpenAI-compatible server, from the llama.cpp that llama-cpp-python 0.3.36
# vendors (its source package from the package index: the same llama.cpp as draftlab's llamacpp backend), once,
# into $DRAFTLAB_CACHE/llama-server/0.3.36/ (default ~/.cache/draftlab). ~10 minutes on 2 cores; no network
# beyond the package index (the web UI, which the default build downloads, is left out). The same llama.cpp's
# GGUF converter (convert_hf_to_gguf.py with its conversion/ and gguf-py/) is kept in $out/convert/: it turns
# EAGLE-3 drafts into the GGUF llama-server loads (`draftlab design eagle3 --gguf`).
#   scripts/build-llama-server.sh            build unless built; print the binary's path
#   PYTHON=.venv/bin/python scripts/build-llama-server.sh
set -euo pipefail
VERSION=0.3.36
PYTHON=${PYTHON:-python3}
cache=${DRAFTLAB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/draftlab}
out="$cache/llama-server/$VERSION"
converter="$out/convert/convert_hf_to_gguf.py"
patched="$out/patched-qwen2-layer-inputs"  # built with the hook below (a binary built without it is rebuilt)
# ggml's AMX kernels crash on AMX CPUs (a general protection fault in ggml_backend_amx_mul_mat at the first request);
# `-march=native` compiles them in there unless told not to. A binary that holds them is rebuilt.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
holds_amx() { nm "$1" 2>/dev/null | grep -q 'ggml_backend_amx'; }
if [ -x "$out/llama-server" ] && holds_amx "$out/llama-server"; then
  echo "build-llama-server: the cached llama-server holds ggml's AMX kernels; rebuilding it without them" >&2
  rm -f "$out/llama-server" "$patched"
fi
if [ -x "$out/llama-server" ] && [ -f "$converter" ] && [ -f "$patched" ]; then
  echo "$out/llama-server"
  exit 0
fi
for tool in cmake c++ make tar; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "build-llama-server: '$tool' not found; install it (Debian/Ubuntu: apt-get install cmake g++ make) and run again" >&2
    exit 2
  fi
done
mkdir -p "$out"
work=$(mktemp -d "$out/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT
log="$out/build.log"
echo "build-llama-server: getting llama-cpp-python $VERSION's llama.cpp for llama-server and its converter (a build takes ~10 minutes on 2 cores; log: $log)" >&2
if ! "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work" >"$log" 2>&1; then
  echo "build-llama-server: could not download llama-cpp-python $VERSION's source package; see $log" >&2
  exit 1
fi
tar -xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work"
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -f "$converter" ]; then
  rm -rf "$out/convert.partial"
  mkdir -p "$out/convert.partial"
  cp -r "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py" "$out/convert.partial/"
  rm -rf "$out/convert"
  mv "$out/convert.partial" "$out/convert"
fi
if [ -x "$out/llama-server" ] && [ -f "$patched" ]; then
  echo "$out/llama-server"
  exit 0
fi
# EAGLE-3 drafting (--spec-type draft-eagle3) reads the inputs of three target layers, which each model's graph
# must hand over (`res->t_layer_inp[il] = inpL;`, as its llama graph does); this release's qwen2 graph does not, and
# llama-server aborts on a Qwen2 target ("GGML_ASSERT(t_layer_inp[il] != nullptr ...)"). Add that one line.
qwen2="$src/src/models/qwen2.cpp"
if ! grep -q 't_layer_inp' "$qwen2"; then
  sed -i 's|^\( *\)for (int il = 0; il < n_layer; ++il) {$|&\n\1    res->t_layer_inp[il] = inpL;|' "$qwen2"
  grep -q 'res->t_layer_inp\[il\] = inpL;' "$qwen2" || { echo "build-llama-server: could not add the qwen2 hook" >&2; exit 1; }
fi
if ! { CFLAGS="${CFLAGS:-} $NO_AMX" CXXFLAGS="${CXXFLAGS:-} $NO_AMX" cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
         -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
         -DBUILD_SHARED_LIBS=OFF \
       && cmake --build "$work/build" --target llama-server -j"$(nproc)"; } >>"$log" 2>&1; then
  echo "build-llama-server: the build failed; the last lines of $log:" >&2
  tail -5 "$log" >&2
  exit 1
fi
if holds_amx "$work/build/bin/llama-server"; then
  echo "build-llama-server: the build still holds ggml's AMX kernels (nm shows ggml_backend_amx_*)" >&2
  exit 1
fi
cp "$work/build/bin/llama-server" "$out/llama-server.partial"
mv "$out/llama-server.partial" "$out/llama-server"
touch "$patched"
echo "$out/llama-server"

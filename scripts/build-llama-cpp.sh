#!/usr/bin/env bash
# Build llama.cpp once, from the llama.cpp that llama-cpp-python 0.3.36 vendors (its source package from the package
# index), with draftlab's exact kernels and libllama's additions (scripts/llama-cpp/*.patch: each small, commented,
# tested bitwise by tests/integration/test_exact_kernels.py, test_llamacpp_streams.py, test_draft_chain.py,
# test_gguf_head.py), for both of draftlab's llama.cpp engines, and install llama-cpp-python over it:
#   $out/lib/      libllama, libggml*, libmtmd: what llama-cpp-python loads (copied into its package's lib/): every
#                  kernel serves every row count of a block, so a row of a block rounds as the row scored alone;
#   $out/server/   llama-server on the same libraries, so its own speculation is exact too;
#   $out/convert/  the same llama.cpp's GGUF converter (EAGLE-3 drafts for llama-server, `draftlab design eagle3`).
# $out is $DRAFTLAB_CACHE/llama.cpp/0.3.36 (default ~/.cache/draftlab). ~7 minutes on 2 cores, once; no network
# beyond the package index (the server's web UI, which the default build downloads, is left out). ggml's AMX kernels
# are compiled out everywhere: they crash every decode on AMX CPUs (docs/backends.md); a build holding them is
# refused, a cached one rebuilt.
#   scripts/build-llama-cpp.sh [PYTHON]   build unless built, install llama-cpp-python into PYTHON's environment
#                                         (default python3) unless it is there, copy the libraries in, check them
#   scripts/build-llama-cpp.sh --avx2 [PYTHON]  after that build, its ggml-cpu again for AVX2 only (no AVX-512, whatever
#                                         this CPU has) into $out/avx2/ beside the same other libraries (~3 minutes,
#                                         once): the kernels' AVX2 path, tested bitwise on any x86 host
#                                         (tests/integration/test_exact_kernels.py); prints the directory
#   scripts/build-llama-cpp.sh --stock [PYTHON]  after that build, llama.cpp's own ggml-cpu (no patch, sgemm gated to 2+
#                                         rows) into $out/stock/ beside the same other libraries (~25 s, once):
#                                         the stock kernels benchmarks/exact_kernels.py compares with
#                                         (LLAMA_CPP_LIB_PATH); prints the directory. Only the benchmark and its
#                                         tests need it, so the main build leaves it out.
set -euo pipefail
VERSION=0.3.36
extra=""
if [ "${1:-}" = --avx2 ] || [ "${1:-}" = --stock ]; then extra=${1#--}; shift; fi
PYTHON=${1:-${PYTHON:-python3}}
here=$(cd "$(dirname "$0")" && pwd)
cache=${DRAFTLAB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/draftlab}
out="$cache/llama.cpp/$VERSION"
sdist="$out/llama_cpp_python-$VERSION.tar.gz"
stamp="$out/built"  # written last, holding the patches' checksum: a build killed half way, or of other patches, is redone
patches=("$here"/llama-cpp/*.patch)
kernels_id=$(cat "${patches[@]}" | sha256sum | cut -c1-16)
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
work=""
trap '[ -z "$work" ] || rm -rf "$work"' EXIT
holds_amx() { nm -D "$1" 2>/dev/null | grep -q 'ggml_backend_amx'; }

built_without_amx() {
  [ -f "$stamp" ] && [ -x "$out/server/llama-server" ] && [ -f "$out/lib/libllama.so" ] || return 1
  if [ "$(cat "$stamp")" != "$kernels_id" ]; then
    echo "build-llama-cpp: the cached build holds other kernels than scripts/llama-cpp/*.patch; rebuilding" >&2
    return 1
  fi
  local lib
  for lib in "$out"/lib/libggml*.so "$out"/server/libggml*.so; do
    if holds_amx "$lib"; then
      echo "build-llama-cpp: the cached $lib holds ggml's AMX kernels; rebuilding without them" >&2
      return 1
    fi
  done
}

need_tools() {
  local tool
  for tool in cmake c++ make tar nm patch; do
    if ! command -v "$tool" >/dev/null 2>&1; then
      echo "build-llama-cpp: '$tool' not found; install it (Debian/Ubuntu: apt-get install cmake g++ make binutils patch)" >&2
      exit 2
    fi
  done
}

# EAGLE-3 drafting in llama-server (--spec-type draft-eagle3) reads the inputs of three target layers, which each
# model's graph must hand over (`res->t_layer_inp[il] = inpL;`, as its llama graph does); this release's qwen2 graph
# does not, and llama-server aborts on a Qwen2 target. Add that one line (it only records a tensor's address).
patch_qwen2() {
  local qwen2="$1/src/models/qwen2.cpp"
  if ! grep -q 't_layer_inp' "$qwen2"; then
    sed -i 's|^\( *\)for (int il = 0; il < n_layer; ++il) {$|&\n\1    res->t_layer_inp[il] = inpL;|' "$qwen2"
    grep -q 'res->t_layer_inp\[il\] = inpL;' "$qwen2" || { echo "build-llama-cpp: could not add the qwen2 hook" >&2; exit 1; }
  fi
}

# draftlab's exact kernels: every patch in scripts/llama-cpp/, in name order (each says what upstream code it changes).
patch_exact_kernels() {
  local p
  for p in "${patches[@]}"; do
    patch -p1 --forward --quiet -d "$1" <"$p" || { echo "build-llama-cpp: could not apply $p" >&2; exit 1; }
  done
}

# configure SRC BUILD SGEMM [CMAKE_ARG ...]: shared libraries finding each other beside themselves ($ORIGIN), no AMX.
configure() {
  CFLAGS="${CFLAGS:-} $NO_AMX" CXXFLAGS="${CXXFLAGS:-} $NO_AMX" cmake -G "Unix Makefiles" -S "$1" -B "$2" \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_LLAMAFILE="$3" \
    -DCMAKE_INSTALL_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF "${@:4}"
}

build() {
  need_tools
  mkdir -p "$out"
  local log src jobs
  work=$(mktemp -d "$out/.build.XXXXXX")
  log="$out/build.log"
  jobs=$(nproc)
  echo "build-llama-cpp: building llama-cpp-python $VERSION's llama.cpp once for draftlab's llamacpp backend and llama-server (~7-10 minutes on 2 cores; log: $log)" >&2
  if [ ! -f "$sdist" ]; then
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work" >"$log" 2>&1 \
      || { echo "build-llama-cpp: could not download llama-cpp-python $VERSION's source package; see $log" >&2; exit 1; }
    mv "$work/llama_cpp_python-$VERSION.tar.gz" "$sdist"
  fi
  tar -xzf "$sdist" -C "$work"
  src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
  patch_qwen2 "$src"
  patch_exact_kernels "$src"
  # One build of everything with draftlab's kernels ...
  if ! { configure "$src" "$work/exact" ON \
         && cmake --build "$work/exact" --target llama mtmd llama-server -j"$jobs"; } >>"$log" 2>&1; then
    echo "build-llama-cpp: the build failed; the last lines of $log:" >&2; tail -5 "$log" >&2; exit 1
  fi
  # the stock and AVX2-only ggml-cpu built beside an earlier build link to its libraries: built again on demand
  rm -rf "$out/lib" "$out/server" "$out/stock" "$out/avx2" "$out/convert" "$stamp"
  mkdir -p "$out/lib" "$out/server"
  cp -a "$work/exact/bin/"lib{llama,ggml,ggml-base,ggml-cpu,mtmd}.so* "$out/lib/"
  cp -a "$work/exact/bin/"*.so* "$work/exact/bin/llama-server" "$out/server/"
  mkdir -p "$out/convert"
  cp -r "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py" "$out/convert/"
  for lib in "$out"/lib/libggml*.so "$out"/server/libggml*.so; do
    if holds_amx "$lib"; then
      echo "build-llama-cpp: the build still holds ggml's AMX kernels ($lib: nm -D shows ggml_backend_amx_*)" >&2
      exit 1
    fi
  done
  echo "$kernels_id" >"$stamp"
}

# llama-cpp-python's Python package without a build of its own (LLAMA_BUILD=OFF), then the libraries above in its
# lib/. Not from pip's wheel cache: a wheel cached by an earlier build (or this one's empty one) is not reused.
install_python_package() {
  local libdir
  if ! "$PYTHON" -c "import importlib.metadata as m; assert m.version('llama_cpp_python') == '$VERSION'" 2>/dev/null; then
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$PYTHON" -m pip install --quiet --no-cache-dir "$sdist" \
      || { echo "build-llama-cpp: pip could not install llama-cpp-python from $sdist" >&2; exit 1; }
  fi
  libdir=$("$PYTHON" -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llama_cpp').origin).parent / 'lib')")
  mkdir -p "$libdir"
  rm -f "$libdir"/lib*.so*
  cp -a "$out/lib/"*.so* "$libdir/"
}

# llama.cpp's stock ggml-cpu: the unpatched source's one target, the same switches; `ggml-cpu/fast` builds the target
# without rebuilding what it links to (the exact build's libggml-base).
build_stock() {
  local stock="$out/stock" log="$out/build-stock.log"
  [ -f "$stock/built" ] && [ "$(cat "$stock/built")" = "$kernels_id" ] && ! holds_amx "$stock/libggml-cpu.so" \
    && { echo "$stock"; return; }
  work=$(mktemp -d "$out/.build.XXXXXX")
  tar -xzf "$sdist" -C "$work"
  if ! { configure "$work/llama_cpp_python-$VERSION/vendor/llama.cpp" "$work/stock" ON \
         && mkdir -p "$work/stock/bin" && cp -a "$out/lib/"libggml-base.so* "$work/stock/bin/" \
         && make -C "$work/stock" ggml-cpu/fast -j"$(nproc)"; } >"$log" 2>&1; then
    echo "build-llama-cpp: the stock ggml-cpu failed to build; the last lines of $log:" >&2; tail -5 "$log" >&2
    exit 1
  fi
  if holds_amx "$work/stock/bin/libggml-cpu.so"; then
    echo "build-llama-cpp: the stock ggml-cpu holds ggml's AMX kernels (nm -D shows ggml_backend_amx_*)" >&2; exit 1
  fi
  rm -rf "$stock" && mkdir -p "$stock"
  cp -a "$out/lib/"*.so* "$stock/"
  cp -a "$work/stock/bin/"libggml-cpu.so* "$stock/"
  echo "$kernels_id" >"$stock/built"
  echo "$stock"
}

# The AVX2-only ggml-cpu: the patched source's one target, with llama.cpp's instruction-set switches instead of
# -march=native (AVX, AVX2, FMA, F16C, BMI2; no AVX-512, VNNI or AMX), linked to the exact build's libggml-base.
build_avx2() {
  local avx2="$out/avx2" log="$out/build-avx2.log" src
  [ -f "$avx2/built" ] && [ "$(cat "$avx2/built")" = "$kernels_id" ] && { echo "$avx2"; return; }
  work=$(mktemp -d "$out/.build.XXXXXX")
  tar -xzf "$sdist" -C "$work"
  src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
  patch_exact_kernels "$src"
  if ! { configure "$src" "$work/avx2" ON -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
           -DGGML_F16C=ON -DGGML_BMI2=ON \
         && mkdir -p "$work/avx2/bin" && cp -a "$out/lib/"libggml-base.so* "$work/avx2/bin/" \
         && make -C "$work/avx2" ggml-cpu/fast -j"$(nproc)"; } >"$log" 2>&1; then
    echo "build-llama-cpp: the AVX2-only ggml-cpu failed to build; the last lines of $log:" >&2; tail -5 "$log" >&2
    exit 1
  fi
  rm -rf "$avx2" && mkdir -p "$avx2"
  cp -a "$out/lib/"*.so* "$avx2/"
  cp -a "$work/avx2/bin/"libggml-cpu.so* "$avx2/"
  echo "$kernels_id" >"$avx2/built"
  echo "$avx2"
}

built_without_amx || build
if [ -n "$extra" ]; then
  "build_$extra"
  exit 0
fi
install_python_package
bash "$here/check-no-amx.sh" "$PYTHON"
echo "$out/server/llama-server"

#!/usr/bin/env bash
# Build llama.cpp's own HTTP server (`llama-server`) portably, once per machine, into a
# cache outside the clone; print the binary's path on stdout.
#
# The source is the llama.cpp that the pinned llama-cpp-python sdist vendors (MIT), so
# the server and the embedded engine are one llama.cpp revision. The instruction-set
# baseline is the one scripts/build-engine.sh explains (x86-64-v3; no AVX-512, no AMX),
# shared through scripts/engine-flags.sh so the two builds cannot drift apart.
#
# Nothing is fetched beyond the sdist from the package index: the web UI's prebuilt
# assets (a download at build time) are off, and so are OpenSSL and the UI build. The
# binary is linked statically against llama.cpp, so the cached file runs on its own.
#
# The key is the source version, the flags and the architecture. The build time is
# recorded in BUILD-INFO next to the binary.
#
# Usage: scripts/build-llama-server.sh [python]   (default: .venv/bin/python)
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
PY=${1:-.venv/bin/python}
PINNED=$(grep -oP '"llama-cpp-python==\K[^"]+' "$HERE/../pyproject.toml")
VERSION=${SWITCHYARD_LLAMA_CPP_VERSION:-$PINNED}
CACHE=${SWITCHYARD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/switchyard}
# shellcheck source=engine-flags.sh
. "$HERE/engine-flags.sh"
SERVER_FLAGS="-DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release"
ALL_FLAGS=$(echo "$ENGINE_FLAGS $SERVER_FLAGS" | tr -s ' ')

KEY=$(printf '%s\n%s\n%s\n' "$VERSION" "$ALL_FLAGS" "$(uname -m)" | sha256sum | cut -c1-16)
DIR="$CACHE/engines/llama-server-$VERSION-$(uname -m)-$KEY"

if [ -x "$DIR/llama-server" ]; then
  echo "$DIR/llama-server"
  exit 0
fi

echo "building llama-server from llama-cpp-python $VERSION's vendored llama.cpp (4-9 minutes on 2 cores; once per machine)" >&2
echo "  flags: $ALL_FLAGS" >&2
unpack_sdist "$PY" "$VERSION"
work=$WORK
src=$SDIST_DIR/vendor/llama.cpp
echo "  log: $work/build.log" >&2
start=$(date +%s)
# shellcheck disable=SC2086
build() {
  cmake -S "$src" -B "$work/build" $ALL_FLAGS &&
    cmake --build "$work/build" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
}
if ! with_progress llama-server "$work/build.log" "4-9 min" build; then
  tail -n 40 "$work/build.log" >&2
  echo "build-llama-server: the build failed (log above)" >&2
  exit 1
fi
seconds=$(($(date +%s) - start))
bin="$work/build/bin/llama-server"
# What was compiled, in the server's own words (its system_info line at start).
info=$("$bin" --version 2>&1 | tr '\n' ' ' || true)
echo "  built in ${seconds}s: $info" >&2
# The flags must be what was compiled: with AVX-512 and AMX off, no instruction may
# name their registers (zmm, tmm, the mask registers k0-k7).
if grep -q -- '-DGGML_AVX512=OFF' <<<"$ALL_FLAGS" && command -v objdump >/dev/null; then
  n=$(objdump -d --no-show-raw-insn "$bin" | grep -cE '%zmm[0-9]|%tmm[0-9]|%k[0-7]\b' || true)
  if [ "$n" != 0 ]; then
    echo "build-llama-server: $n AVX-512/AMX instructions although the flags turn them off" >&2
    exit 1
  fi
  echo "  checked: no AVX-512 or AMX instructions in the binary" >&2
fi
mkdir -p "$DIR"
cp "$work/build.log" "$DIR/build.log"
cp "$bin" "$DIR/llama-server.tmp" && mv "$DIR/llama-server.tmp" "$DIR/llama-server"
# The converter that turns a PEFT adapter into a GGUF adapter (scripts/train-adapters.py)
# comes from the same llama.cpp revision, with the gguf-py package it imports.
cp "$src/convert_lora_to_gguf.py" "$src/convert_hf_to_gguf.py" "$DIR/"
cp -r "$src/gguf-py" "$DIR/gguf-py"
[ -d "$src/conversion" ] && cp -r "$src/conversion" "$DIR/conversion"
printf '%s\n' "version=$VERSION" "flags=$ALL_FLAGS" "built=$(date -u +%FT%TZ)" \
  "build_seconds=$seconds" "nproc=$(nproc)" \
  "cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')" \
  "version_info=$info" >"$DIR/BUILD-INFO"
echo "$DIR/llama-server"

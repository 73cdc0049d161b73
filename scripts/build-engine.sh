#!/usr/bin/env bash
# Build the embedded engine (llama-cpp-python, which vendors llama.cpp) portably, once
# per machine, into a cache outside the clone; print the wheel's path on stdout.
#
# Why our own cache: pip's wheel cache is keyed by the source link, not by CMAKE_ARGS,
# so a wheel compiled with `-march=native` on one CPU (AVX-512, AMX) would be reused on
# another and either crash or carry instructions that CPU lacks. Here the key is the
# source version, the flags and the Python tag; the source is built from an unpacked
# directory, which pip never caches, so the flags below are always the ones compiled.
#
# The instruction-set baseline (x86-64-v3; no AVX-512, no AMX: why in
# scripts/engine-flags.sh) is shared with scripts/build-llama-server.sh.
#
# Usage: scripts/build-engine.sh [python]   (default: .venv/bin/python)
set -euo pipefail

PY=${1:-.venv/bin/python}
# The version pyproject.toml pins, so the two cannot disagree.
PINNED=$(grep -oP '"llama-cpp-python==\K[^"]+' "$(dirname "$0")/../pyproject.toml")
VERSION=${SWITCHYARD_LLAMA_CPP_VERSION:-$PINNED}
CACHE=${SWITCHYARD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/switchyard}

# shellcheck source=engine-flags.sh
. "$(dirname "$0")/engine-flags.sh"
FLAGS=$ENGINE_FLAGS

PYTAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
KEY=$(printf '%s\n%s\n%s\n%s\n' "$VERSION" "$FLAGS" "$PYTAG" "$(uname -m)" | sha256sum | cut -c1-16)
DIR="$CACHE/engines/llama-cpp-python-$VERSION-$PYTAG-$(uname -m)-$KEY"

wheel=$(ls "$DIR"/llama_cpp_python-*.whl 2>/dev/null | head -n1 || true)
if [ -n "$wheel" ]; then
  echo "$wheel"
  exit 0
fi

echo "building llama-cpp-python $VERSION portably (3-10 minutes on 2 cores; once per machine)" >&2
echo "  flags: $FLAGS" >&2
unpack_sdist "$PY" "$VERSION"
work=$WORK
src=$SDIST_DIR
echo "  log: $work/build.log" >&2
if ! CMAKE_ARGS="$FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
  with_progress llama-cpp-python "$work/build.log" "3-10 min" \
  "$PY" -m pip wheel -v --no-deps "$src" -w "$work/out"; then
  tail -n 40 "$work/build.log" >&2
  echo "build-engine: the build failed (log above)" >&2
  exit 1
fi
# The flags must be what was compiled: read the engine's own account of its
# instruction sets (llama_print_system_info) from the wheel just built. With its
# dependencies: on a fresh machine the venv has none of them yet (`import llama_cpp`
# needs diskcache and numpy).
"$PY" -m pip install -q --target "$work/check" "$work"/out/llama_cpp_python-*.whl >&2
info=$(PYTHONPATH="$work/check" "$PY" -c \
  'import llama_cpp; print(llama_cpp.llama_print_system_info().decode().strip())')
echo "  built: $info" >&2
grep -q -- '-DGGML_AVX512=OFF' <<<"$FLAGS" && grep -q 'AVX512 = 1' <<<"$info" && {
  echo "build-engine: AVX-512 is compiled in although the flags turn it off" >&2; exit 1; }
grep -q -- '-DGGML_AMX_INT8=OFF' <<<"$FLAGS" && grep -q 'AMX' <<<"$info" && {
  echo "build-engine: AMX is compiled in although the flags turn it off" >&2; exit 1; }
mkdir -p "$DIR"
cp "$work/build.log" "$DIR/build.log"
printf '%s\n' "version=$VERSION" "flags=$FLAGS" "python=$PYTAG" "built=$(date -u +%FT%TZ)" \
  "cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')" \
  "system_info=$info" >"$DIR/BUILD-INFO"
mv "$work"/out/llama_cpp_python-*.whl "$DIR/"
ls "$DIR"/llama_cpp_python-*.whl | head -n1

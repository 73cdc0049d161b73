# shellcheck shell=bash
# What the engine builds share (sourced by scripts/build-engine.sh and
# scripts/build-llama-server.sh): the instruction-set baseline (ENGINE_FLAGS) and
# where the source comes from (unpack_sdist).
#
# x86-64-v3 (AVX, AVX2, FMA, F16C, BMI2): every x86 server CPU of the last decade has
# it. AVX-512 and AMX are off: AMX's repacked buffers crash llama.cpp on prompts longer
# than one token on some Xeons (issue #16), and an AVX-512 build would not run on a CPU
# without it. Override with SWITCHYARD_ENGINE_CMAKE_ARGS.
case "$(uname -m)" in
  x86_64)
    _default="-DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF \
-DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF \
-DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    ;;
  *)
    # Other architectures: the compiler's generic baseline for the target.
    _default="-DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF"
    ;;
esac
ENGINE_FLAGS=$(echo "${SWITCHYARD_ENGINE_CMAKE_ARGS:-$_default}" | tr -s ' ')
unset _default

# The pinned llama-cpp-python sdist (it vendors llama.cpp), never a binary, unpacked
# into a fresh folder under $CACHE/engines that is removed when the calling script
# exits. Usage: unpack_sdist PYTHON VERSION; sets WORK and SDIST_DIR (no trailing /).
unpack_sdist() {
  mkdir -p "$CACHE/engines"
  WORK=$(mktemp -d "$CACHE/engines/build.XXXXXX")
  # shellcheck disable=SC2064  # expand now: WORK is this call's folder
  trap "rm -rf '$WORK'" EXIT
  "$1" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$2" -d "$WORK/sdist" >&2
  tar -xzf "$WORK"/sdist/llama_cpp_python-*.tar.gz -C "$WORK"
  SDIST_DIR=$(ls -d "$WORK"/llama_cpp_python-*/ | head -n1)
  SDIST_DIR=${SDIST_DIR%/}
}

# Run a long build with a progress line on stderr every 30 s: what is being built, how
# long so far, the expected total (as measured on 2-core machines of this kind) and the
# last percentage the build tool printed into its log.
# Usage: with_progress WHAT LOG EXPECTED COMMAND...   (EXPECTED: e.g. "4-9 min")
with_progress() {
  local what=$1 log=$2 expected=$3 start pid now pct
  shift 3
  start=$(date +%s)
  "$@" >"$log" 2>&1 &
  pid=$!
  now=$start
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if (( $(date +%s) - now >= 30 )); then
      now=$(date +%s)
      # make prints "[ 42%]", ninja "[142/193]"
      pct=$(grep -oE '^ *\[ *[0-9]+(%|/[0-9]+)\]' "$log" 2>/dev/null | tail -n1 | tr -d '[] ' || true)
      printf '  building %s: %dm%02ds so far of an expected %s on 2 cores%s\n' "$what" \
        $(( (now - start) / 60 )) $(( (now - start) % 60 )) "$expected" \
        "${pct:+ (compiled: $pct)}" >&2
    fi
  done
  wait "$pid"
}

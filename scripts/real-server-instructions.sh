#!/usr/bin/env bash
# Instructions per request of the real servers under wrk at 32 connections: the bare
# floor (bench/passthrough_proxy.py --bare) and Switchyard (`switchyard serve`), each run
# under valgrind's callgrind against the scripted instant upstream. Unlike req/s on a
# shared 2-core VM, the counts do not drift with the machine (see docs/benchmarks/index.md,
# "Hot-path mode"). Needs valgrind and wrk; takes ~2 minutes.
#
#   scripts/real-server-instructions.sh [SECONDS]       (default 15 s measured per server)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "needs valgrind (apt-get install valgrind)" >&2; exit 2; }
command -v wrk >/dev/null || { echo "needs wrk (make test installs it)" >&2; exit 2; }
PY=.venv/bin/python
D=${1:-15}
W=$(mktemp -d)
PIDS=()
cleanup() { kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$W"; }
trap cleanup EXIT
free_port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
UP_PORT=$(free_port); FLOOR_PORT=$(free_port); SY_PORT=$(free_port)
$PY -m switchyard.bench.scripted_upstream --host 127.0.0.1 --port "$UP_PORT" --tokens 16 \
  --model-name scripted >"$W/up.log" 2>&1 &
PIDS+=($!)
cat >"$W/sy.yaml" <<YAML
server: {host: 127.0.0.1, port: $SY_PORT}
models:
  - alias: scripted
    revision: scripted-v1
    engine: {kind: openai, base_url: "http://127.0.0.1:$UP_PORT/v1"}
embeddings: {enabled: false}
auth: {mode: disabled}
storage: {sqlite_path: "$W/sy.db"}
YAML
BODY='{"model":"scripted","messages":[{"role":"user","content":"hi"}],"max_tokens":16}'
printf 'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\nwrk.body = [[%s]]\n' \
  "$BODY" >"$W/post.lua"

count() {  # name port command... -> prints instructions per request
  local name=$1 port=$2; shift 2
  valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$W/$name.cg.%p" "$@" \
    >"$W/$name.log" 2>&1 &
  local vg=$!
  PIDS+=("$vg")
  for _ in $(seq 300); do
    curl -sf -m 5 -X POST -H 'content-type: application/json' -d "$BODY" \
      "http://127.0.0.1:$port/v1/chat/completions" >/dev/null && break
    sleep 1
  done
  wrk -t1 -c32 -d5s -s "$W/post.lua" "http://127.0.0.1:$port/v1/chat/completions" >/dev/null
  callgrind_control -i on "$vg" >/dev/null 2>&1
  local out
  out=$(wrk -t1 -c32 "-d${D}s" --timeout 10s -s "$W/post.lua" \
    "http://127.0.0.1:$port/v1/chat/completions")
  callgrind_control -i off "$vg" >/dev/null 2>&1
  callgrind_control -d "$vg" >/dev/null 2>&1
  local n ir
  n=$(echo "$out" | awk '/requests in/{print $1}')
  kill -INT "$vg" 2>/dev/null || true
  sleep 3
  kill "$vg" 2>/dev/null || true
  wait "$vg" 2>/dev/null || true
  ir=$(grep -h "^summary:\|^totals:" "$W/$name".cg.* | awk '{s+=$2} END {print s}')
  echo "$name: $n requests, $((ir / n)) instructions per request"
}

count floor "$FLOOR_PORT" $PY -m switchyard.bench.passthrough_proxy --port "$FLOOR_PORT" \
  --upstream "http://127.0.0.1:$UP_PORT/v1" --bare
count switchyard "$SY_PORT" $PY -m switchyard serve --config "$W/sy.yaml"

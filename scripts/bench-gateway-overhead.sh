#!/usr/bin/env bash
# Gateway overhead, measured: the same 4 sim replicas (steps take no modelled time, so what is
# measured is HTTP, parsing, tokenising and routing) called directly, through nginx round-robin
# and through kvgate (prefix_aware), in one run, interleaved, with `hey`.
#   scripts/bench-gateway-overhead.sh [release-binary]
# Needs nginx and hey (Debian packages). Loopback only; every process is stopped at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/release/kvgate}
N_LAT=${N_LAT:-2000}
N_TPUT=${N_TPUT:-6000}
CONC=${CONC:-16}
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$work/nginx.pid" ] && kill "$(cat "$work/nginx.pid")" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

ports=(18101 18102 18103 18104)
for i in 0 1 2 3; do
  "$BIN" replica --port "${ports[$i]}" --replica-id "r$i" --time-scale 0 >"$work/r$i.log" 2>&1 &
  pids+=($!)
done
for p in "${ports[@]}"; do
  until curl -sf "localhost:$p/health" >/dev/null; do sleep 0.2; done
done

cat >"$work/gateway.toml" <<TOML
listen = "127.0.0.1:18180"
admin_listen = "127.0.0.1:18190"
replicas = ["127.0.0.1:18101", "127.0.0.1:18102", "127.0.0.1:18103", "127.0.0.1:18104"]
[model]
tokenizer_dir = "models/qwen3"
TOML
"$BIN" gateway --config "$work/gateway.toml" >"$work/gw.log" 2>&1 &
pids+=($!)
until curl -sf localhost:18180/health >/dev/null; do sleep 0.2; done

cat >"$work/nginx.conf" <<NGINX
worker_processes 1;
pid $work/nginx.pid;
error_log $work/nginx-error.log;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $work;
  proxy_temp_path $work;
  upstream replicas {
    server 127.0.0.1:18101; server 127.0.0.1:18102; server 127.0.0.1:18103; server 127.0.0.1:18104;
    keepalive 64;
  }
  server {
    listen 127.0.0.1:18181;
    location / {
      proxy_pass http://replicas;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
}
NGINX
nginx -c "$work/nginx.conf"
until curl -sf localhost:18181/health >/dev/null; do sleep 0.2; done

body='{"model":"Qwen3-8B","messages":[{"role":"system","content":"You are a support assistant for a company that sells paged KV caches. Be brief."},{"role":"user","content":"How do I pick a block size?"}],"max_tokens":1,"ignore_eos":true}'
run() { # label url n conc
  hey -n "$3" -c "$4" -m POST -T application/json -d "$body" "$2/v1/chat/completions" >"$work/hey.txt"
  local rps p50 p99 ok
  rps=$(awk '/Requests\/sec/ {print $2}' "$work/hey.txt")
  p50=$(awk '/50% in/ {print $3*1000}' "$work/hey.txt")
  p99=$(awk '/99% in/ {print $3*1000}' "$work/hey.txt")
  ok=$(awk '/\[200\]/ {print $2}' "$work/hey.txt")
  printf "%-8s c=%-3s n=%-5s ok=%-5s req/s=%-9s p50=%-7sms p99=%sms\n" "$1" "$4" "$3" "${ok:-0}" "$rps" "$p50" "$p99"
}
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "warm-up"; run warmup http://127.0.0.1:18180 300 4 >/dev/null; run warmup http://127.0.0.1:18181 300 4 >/dev/null
for round in 1 2; do
  echo "round $round: latency, one request at a time"
  run direct http://127.0.0.1:18101 "$N_LAT" 1
  run nginx http://127.0.0.1:18181 "$N_LAT" 1
  run kvgate http://127.0.0.1:18180 "$N_LAT" 1
  echo "round $round: throughput at concurrency $CONC"
  run nginx http://127.0.0.1:18181 "$N_TPUT" "$CONC"
  run kvgate http://127.0.0.1:18180 "$N_TPUT" "$CONC"
done

#!/usr/bin/env bash
# Several kvgate gateways behind nginx round-robin, in front of the same sim replicas (issue
# 30): for each seed, rate, gateway count and index mode, fresh replicas, fresh gateways (each
# listing the others in [peers]), a fresh nginx and one `kvgate bench` through nginx, so every
# turn of a conversation lands on whichever gateway nginx picks. While the bench runs, every
# gateway's own use of the route budget (GET /admin/budget) is sampled every 100 ms and summed:
# the fleet's requests in flight and queued, against the policy's limits.
#   loadtest/multi_gateway.sh --out DIR [--gateways 1,2,4] [--modes events,approx]
#     [--rates 5,10] [--seeds 4,5,6] [--policy FILE] [--restart-at S] [kvgate bench args]
# --restart-at S: S seconds into each run with 2 or more gateways, gateway 0 leaves nginx's
#   upstreams (as a terminating pod leaves its Service), gets SIGTERM (drain), is started again,
#   and rejoins nginx once its /ready says so; times in DIR/.../restart.json.
# Env: KVGATE_BIN (target/release/kvgate, built first), KVGATE_REPLICAS (8),
#   KVGATE_REPLICA_ARGS ("--gpu a100 --num-gpu-blocks 3000"), KVGATE_TIME_SCALE (4),
#   KVGATE_PEERS (1; 0: gateways do not share the budget, for contrast), KVGATE_DURATION (60)
#   and KVGATE_WARMUP (15): the bench's seconds of arrivals and of warm-up.
# Writes DIR/seed-S-rate-R-gwN-MODE/ (report.json, budget.jsonl, access logs) and
# DIR/summary.md (loadtest/multi_gateway_summary.py).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

out=
gateways=1,2,4
modes=events,approx
rates=5,10
seeds=4,5,6
policy=loadtest/policies/multi_gw.toml
restart_at=
extra=()
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=${2:?}; shift ;;
    --gateways) gateways=${2:?}; shift ;;
    --modes) modes=${2:?}; shift ;;
    --rates) rates=${2:?}; shift ;;
    --seeds) seeds=${2:?}; shift ;;
    --policy) policy=${2:?}; shift ;;
    --restart-at) restart_at=${2:?}; shift ;;
    -h | --help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) extra+=("$1") ;;
  esac
  shift
done
[ -n "$out" ] || { echo "multi_gateway.sh: --out is required" >&2; exit 2; }
command -v nginx >/dev/null || { echo "multi_gateway.sh: needs nginx (apt-get install nginx)" >&2; exit 1; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
policy=$(cd "$(dirname "$policy")" && pwd)/$(basename "$policy")
n_replicas=${KVGATE_REPLICAS:-8}
read -r -a replica_args <<<"${KVGATE_REPLICA_ARGS:---gpu a100 --num-gpu-blocks 3000}"
time_scale=${KVGATE_TIME_SCALE:-4}
tokenizer=$root/models/qwen3
if [ -n "${KVGATE_BIN:-}" ]; then
  bin=$KVGATE_BIN
else
  cargo build --release --quiet
  bin=$root/target/release/kvgate
fi
export KVGATE_FLEET_TOKEN=${KVGATE_FLEET_TOKEN:-$(python3 -c 'import secrets; print(secrets.token_hex(24))')}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
wait_until() { # WHAT SECONDS CMD...
  local what=$1 deadline=$((SECONDS + $2))
  shift 2
  until "$@"; do
    [ "$SECONDS" -lt "$deadline" ] || { echo "multi_gateway.sh: $what not ready in time" >&2; return 1; }
    sleep 0.1
  done
}
json_check() { # URL PYEXPR over j
  local body
  body=$(curl -sf --max-time 2 "$1") || return 1
  python3 -c "import json, sys; j = json.loads(sys.argv[1]); sys.exit(0 if ($2) else 1)" "$body" 2>/dev/null
}

pids=()
work=
stop_all() {
  local p
  [ -n "$work" ] && [ -f "$work/nginx.pid" ] && kill "$(cat "$work/nginx.pid")" 2>/dev/null || true
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for _ in $(seq 50); do
    local alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  pids=()
  [ -n "$work" ] && rm -rf "$work"
  work=
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

run_one() { # SEED RATE N MODE DIR
  local seed=$1 rate=$2 n=$3 mode=$4 dir=$5 i
  work=$(mktemp -d)
  mkdir -p "$dir/logs"
  local urls=() addrs=() gw_pids=()
  for i in $(seq 0 $((n_replicas - 1))); do
    "$bin" replica --port 0 --replica-id "r$i" --tokenizer "$tokenizer" \
      --time-scale "$time_scale" "${replica_args[@]}" >"$dir/logs/replica-r$i.log" 2>&1 &
    pids+=($!)
    wait_until "replica r$i" 60 grep -qs 'serving .* at http://' "$dir/logs/replica-r$i.log"
    local url
    url=$(grep -m1 -o 'at http://[^ ]*' "$dir/logs/replica-r$i.log" | cut -c4-)
    urls+=("$url")
    addrs+=("${url#http://}")
  done
  local replicas_toml peers_toml ports=() admins=()
  replicas_toml=$(printf '"%s", ' "${addrs[@]}")
  for i in $(seq 1 "$n"); do ports+=("$(free_port)"); admins+=("$(free_port)"); done
  peers_toml=$(printf '"127.0.0.1:%s", ' "${admins[@]}")
  local kv_events=true
  [ "$mode" = approx ] && kv_events=false
  for i in $(seq 0 $((n - 1))); do
    local peers=""
    if [ "${KVGATE_PEERS:-1}" = 1 ] && [ "$n" -gt 1 ]; then
      peers=$(printf '[peers]\naddrs = [%s]\nevery_ms = 100\n' "${peers_toml%, }")
    fi
    cat >"$work/gw$i.toml" <<TOML
listen = "127.0.0.1:${ports[$i]}"
admin_listen = "127.0.0.1:${admins[$i]}"
replicas = [${replicas_toml%, }]
policy_file = "$policy"
[model]
tokenizer_dir = "$tokenizer"
[index]
kv_events = $kv_events
[cost]
gpu_hour_usd = 2.0
managed_usd_per_mtok = 0.6
window_s = 30
[access_log]
mode = "full"
path = "$dir/logs/access-gw$i.jsonl"
$peers
TOML
    "$bin" gateway --config "$work/gw$i.toml" >"$dir/logs/gateway-$i.log" 2>&1 &
    pids+=($!)
    gw_pids+=($!)
  done
  for i in $(seq 0 $((n - 1))); do
    wait_until "gateway $i" 60 json_check "http://127.0.0.1:${ports[$i]}/ready" "j['status'] == 'ready'"
  done
  local nport
  nport=$(free_port)
  write_nginx() { # indexes of the gateways in the upstream
    local upstreams="" i
    for i in "$@"; do upstreams+="    server 127.0.0.1:${ports[$i]};"$'\n'; done
    cat >"$work/nginx.conf" <<NGINX
worker_processes 1;
pid $work/nginx.pid;
error_log $work/nginx-error.log;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $work;
  proxy_temp_path $work;
  client_max_body_size 64m;
  upstream gateways {
$upstreams    keepalive 256;
  }
  server {
    listen 127.0.0.1:$nport;
    location / {
      proxy_pass http://gateways;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 600s;
    }
  }
}
NGINX
  }
  write_nginx $(seq 0 $((n - 1)))
  nginx -c "$work/nginx.conf"
  wait_until nginx 20 curl -sf -o /dev/null "127.0.0.1:$nport/health"
  # The fleet's use of the budget, sampled while the bench runs.
  local admin_urls=()
  for i in $(seq 0 $((n - 1))); do admin_urls+=("http://127.0.0.1:${admins[$i]}"); done
  python3 - "$dir/budget.jsonl" "${admin_urls[@]}" <<'PY' &
import json, sys, time, urllib.request
out, urls = sys.argv[1], sys.argv[2:]
tick = 0
with open(out, "w") as f:
    while True:
        tick += 1
        t = time.time()
        row = {"t": t, "in_flight": 0, "queued": 0, "tokens": 0, "gateways": 0}
        for u in urls:
            try:
                b = json.load(urllib.request.urlopen(u + "/admin/budget", timeout=1))
            except Exception:
                continue
            row["gateways"] += 1
            for r in b.get("routes", {}).values():
                row["in_flight"] += r["in_flight"]
                row["queued"] += r["queued"]
                row["tokens"] += r["tokens"]
            if tick % 10:
                continue
            try:
                text = urllib.request.urlopen(u + "/metrics", timeout=1).read().decode()
            except Exception:
                continue
            for line in text.splitlines():
                name, _, value = line.partition(" ")
                if name == "kvgate_gateway_scale_signal":
                    row["signal"] = max(row.get("signal", 0.0), float(value))
                elif name == "kvgate_gateway_fleet_cost_per_mtok" and value != "NaN":
                    row["cost_per_mtok"] = float(value)
        f.write(json.dumps(row) + "\n")
        f.flush()
        time.sleep(max(0.0, 0.1 - (time.time() - t)))
PY
  local sampler=$!
  pids+=("$sampler")
  local restarter=
  if [ -n "$restart_at" ] && [ "$n" -gt 1 ]; then
    (
      sleep "$restart_at"
      t_out=$(date +%s.%N)
      write_nginx $(seq 1 $((n - 1)))
      nginx -s reload -c "$work/nginx.conf"
      sleep 2 # nginx's old workers finish handing their connections over
      t_term=$(date +%s.%N)
      kill -TERM "${gw_pids[0]}"
      # (A zombie until the main shell reaps it: gone once its state says Z.)
      while kill -0 "${gw_pids[0]}" 2>/dev/null &&
        [ "$(sed 's/.*) //' "/proc/${gw_pids[0]}/stat" 2>/dev/null | cut -d' ' -f1)" != Z ]; do
        sleep 0.05
      done
      t_exit=$(date +%s.%N)
      "$bin" gateway --config "$work/gw0.toml" >"$dir/logs/gateway-0-restarted.log" 2>&1 &
      echo $! >"$work/gw0-restarted.pid"
      t_start=$(date +%s.%N)
      until json_check "http://127.0.0.1:${ports[0]}/ready" "j['status'] == 'ready'"; do sleep 0.05; done
      t_ready=$(date +%s.%N)
      write_nginx $(seq 0 $((n - 1)))
      nginx -s reload -c "$work/nginx.conf"
      t_in=$(date +%s.%N)
      printf '{"out": %s, "term": %s, "exited": %s, "started": %s, "ready": %s, "back_in": %s}\n' \
        "$t_out" "$t_term" "$t_exit" "$t_start" "$t_ready" "$t_in" >"$dir/restart.json"
    ) &
    restarter=$!
    pids+=("$restarter")
  fi
  local flush=()
  for u in "${urls[@]}"; do flush+=(--flush "$u"); done
  "$bin" bench --target "kvgate_${n}gw_$mode=http://127.0.0.1:$nport" --rate "$rate" --seed "$seed" \
    --workload apps --duration "${KVGATE_DURATION:-60}" --warmup "${KVGATE_WARMUP:-15}" --slo-ttft-ms 2000 --slo-itl-ms 150 \
    --tokenizer "$tokenizer" --no-progress "${flush[@]}" --out "$dir" "${extra[@]}" >"$dir/bench.log" 2>&1
  kill "$sampler" 2>/dev/null || true
  [ -n "$restarter" ] && wait "$restarter" 2>/dev/null || true
  [ -f "$work/gw0-restarted.pid" ] && pids+=("$(cat "$work/gw0-restarted.pid")")
  cp "$policy" "$dir/policy.toml"
  stop_all
}

IFS=, read -r -a seed_list <<<"$seeds"
IFS=, read -r -a rate_list <<<"$rates"
IFS=, read -r -a gw_list <<<"$gateways"
IFS=, read -r -a mode_list <<<"$modes"
for seed in "${seed_list[@]}"; do
  for rate in "${rate_list[@]}"; do
    for mode in "${mode_list[@]}"; do
      for n in "${gw_list[@]}"; do
        dir=$out/seed-$seed-rate-$rate-gw$n-$mode
        [ -f "$dir/report.json" ] && { echo "done already: $dir"; continue; }
        echo "multi_gateway: seed $seed, rate $rate, $n gateway(s), $mode"
        run_one "$seed" "$rate" "$n" "$mode" "$dir" || { echo "run failed: $dir" >&2; exit 1; }
      done
    done
  done
done
python3 loadtest/multi_gateway_summary.py "$out" | tee "$out/summary.md"

#!/usr/bin/env bash
# Side-by-side routing benchmark: N sim replicas, five kvgate gateways (one per policy) and
# sglang-router (cache_aware) in front of the same replicas, then one `kvgate bench` in compare
# mode (every target at every rate; replicas flushed before each run).
#   loadtest/compare.sh [--smoke] [--out DIR] [extra `kvgate bench` args, which override ours]
# Env: KVGATE_BIN (default target/release/kvgate, built if missing), KVGATE_RATES (4,8,12),
#   KVGATE_TIME_SCALE (1), KVGATE_REPLICAS (8; 2 with --smoke), KVGATE_REPLICA_ARGS,
#   KVGATE_ACCESS_LOG (1: each kvgate gateway writes a full access log under the logs folder),
#   KVGATE_SGLANG_VENV (.venv-sglang), KVGATE_SGLANG_ARGS (appended to launch_router),
#   KVGATE_SGLANG=0 (leave sglang-router out), KVGATE_SGLANG_VARIANTS ("name=extra args;..."
#   one sglang-router per entry, default "sglang_cache_aware=$KVGATE_SGLANG_ARGS"),
#   KVGATE_POLICY_FILES ("name=file.toml ..."):
#   instead of the five policy gateways, one gateway per policy file (KV events on),
#   KVGATE_GATEWAY_BINS ("name=path ..."): the kvgate binary a named gateway runs instead of
#   KVGATE_BIN (an A/B of two builds in front of the same replicas).
# Writes DIR/report.json, DIR/report.md and plots (bench), DIR/setup.txt and DIR/logs/.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

smoke=0
out=
extra=()
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) smoke=1 ;;
    --out) out=${2:?--out needs a folder}; shift ;;
    --out=*) out=${1#--out=} ;;
    -h | --help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) extra+=("$1") ;;
  esac
  shift
done

if [ "$smoke" = 1 ]; then
  n_replicas=${KVGATE_REPLICAS:-2}
  defaults=(--rates 1 --duration 8 --warmup 2)
  out=${out:-loadtest/out/compare-smoke-$(date +%Y%m%d-%H%M%S)}
else
  n_replicas=${KVGATE_REPLICAS:-8}
  defaults=(--rates "${KVGATE_RATES:-4,8,12}" --duration 120 --warmup 20)
  out=${out:-loadtest/out/compare-$(date +%Y%m%d-%H%M%S)}
fi
defaults+=(--workload chat --seed 1 --slo-ttft-ms 1000 --slo-itl-ms 50)
time_scale=${KVGATE_TIME_SCALE:-1}
venv=${KVGATE_SGLANG_VENV:-.venv-sglang}
tokenizer=$root/models/qwen3
mkdir -p "$out/logs"
out=$(cd "$out" && pwd)
logs=$out/logs

if [ -n "${KVGATE_BIN:-}" ]; then
  bin=$KVGATE_BIN
else
  bin=target/release/kvgate
  [ -x "$bin" ] || cargo build --release
fi
[ -x "$bin" ] || { echo "compare.sh: $bin is not an executable" >&2; exit 1; }
[ -f "$tokenizer/tokenizer.json" ] || { echo "compare.sh: no $tokenizer/tokenizer.json (scripts/fetch-models.sh)" >&2; exit 1; }

work=$(mktemp -d)
pids=()
# One fleet token for the replicas, the kvgate gateways (KV events) and the bench (flush).
export KVGATE_FLEET_TOKEN=${KVGATE_FLEET_TOKEN:-$(python3 -c 'import secrets; print(secrets.token_hex(24))')}
any_alive() {
  local p
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && return 0; done
  return 1
}
cleanup() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for _ in $(seq 50); do any_alive || break; sleep 0.1; done # up to 5 s, then SIGKILL
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# wait_until WHAT PID SECONDS CMD...: polls CMD until it succeeds; fails if PID dies or time runs out.
wait_until() {
  local what=$1 pid=$2 deadline=$((SECONDS + $3))
  shift 3
  until "$@"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "compare.sh: $what exited; see $logs" >&2
      return 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "compare.sh: $what not ready in time; see $logs" >&2
      return 1
    fi
    sleep 0.1
  done
}

# json_check URL PYEXPR: true when URL answers 200 with JSON for which PYEXPR (over `j`) holds.
json_check() {
  local body
  body=$(curl -sf --max-time 2 "$1") || return 1
  python3 -c "import json, sys; j = json.loads(sys.argv[1]); sys.exit(0 if ($2) else 1)" "$body" 2>/dev/null
}

# sglang-router in a virtualenv; in --smoke a failed install skips it instead of failing.
sglang_ok=0
want_sglang=${KVGATE_SGLANG:-1}
sglang_ready() {
  [ -x "$venv/bin/python" ] &&
    "$venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("sglang-router") != "0.3.2")' 2>/dev/null
}
if [ "$want_sglang" = 0 ]; then
  :
elif ! sglang_ready; then
  echo "installing sglang-router 0.3.2 into $venv (log: $logs/pip.log)"
  { [ -x "$venv/bin/python" ] || python3 -m venv "$venv"; } >"$logs/pip.log" 2>&1 &&
    "$venv/bin/pip" install --retries 2 sglang-router==0.3.2 >>"$logs/pip.log" 2>&1 || true
fi
if [ "$want_sglang" = 0 ]; then
  echo "sglang-router left out (KVGATE_SGLANG=0)"
elif sglang_ready; then
  sglang_ok=1
elif [ "$smoke" = 1 ]; then
  echo "compare.sh: SKIPPING sglang_cache_aware: could not install sglang-router 0.3.2 into $venv (no network?); see $logs/pip.log" >&2
else
  echo "compare.sh: cannot install sglang-router 0.3.2 into $venv; see $logs/pip.log" >&2
  exit 1
fi

# Replicas on free ports: each prints "... at http://HOST:PORT" on stdout once bound.
replica_urls=()
replica_addrs=()
read -r -a replica_args <<<"${KVGATE_REPLICA_ARGS:-}"
for i in $(seq 0 $((n_replicas - 1))); do
  "$bin" replica --port 0 --replica-id "r$i" --tokenizer "$tokenizer" \
    --time-scale "$time_scale" "${replica_args[@]}" >"$logs/replica-r$i.log" 2>&1 &
  pid=$!
  pids+=("$pid")
  wait_until "replica r$i" "$pid" 60 grep -q 'serving .* at http://' "$logs/replica-r$i.log"
  url=$(grep -m1 -o 'at http://[^ ]*' "$logs/replica-r$i.log" | cut -c4-)
  replica_urls+=("$url")
  replica_addrs+=("${url#http://}")
done
for i in "${!replica_urls[@]}"; do
  wait_until "replica r$i" "${pids[$i]}" 60 curl -sf --max-time 2 -o /dev/null "${replica_urls[$i]}/health"
done
echo "replicas: ${replica_urls[*]}"

# Five gateways, one per policy. Only prefix_aware_events subscribes to KV events.
targets=()
replicas_toml=$(printf '"%s", ' "${replica_addrs[@]}")
replicas_toml="[${replicas_toml%, }]"
start_gateway() { # NAME KIND KV_EVENTS [POLICY_FILE]
  local name=$1 port admin pid policy access_log=
  # KVGATE_ACCESS_LOG=1: every request's decision (route reason, predicted TTFT, replica) in
  # $logs/access-NAME.jsonl, for reading why a router chose what it chose.
  if [ "${KVGATE_ACCESS_LOG:-0}" = 1 ]; then
    access_log=$(printf '[access_log]\nmode = "full"\npath = "%s"' "$logs/access-$name.jsonl")
  fi
  port=$(free_port)
  admin=$(free_port)
  if [ -n "${4:-}" ]; then
    policy="policy_file = \"$(cd "$(dirname "$4")" && pwd)/$(basename "$4")\""
  else
    # One catch-all route with the policy; exact hit signals, since the bench reads them.
    cat >"$work/$name-policy.toml" <<TOML
hit_signals = "exact"
[policy]
kind = "$2"
TOML
    policy="policy_file = \"$work/$name-policy.toml\""
  fi
  cat >"$work/$name.toml" <<TOML
listen = "127.0.0.1:$port"
admin_listen = "127.0.0.1:$admin"
replicas = $replicas_toml
$policy
[model]
tokenizer_dir = "$tokenizer"
[index]
kv_events = $3
[policy]
kind = "$2"
$access_log
TOML
  local gw_bin=$bin spec
  for spec in ${KVGATE_GATEWAY_BINS:-}; do
    [ "${spec%%=*}" = "$name" ] && gw_bin=${spec#*=}
  done
  [ -x "$gw_bin" ] || { echo "compare.sh: gateway $name: no binary at $gw_bin" >&2; exit 1; }
  "$gw_bin" gateway --config "$work/$name.toml" >"$logs/gateway-$name.log" 2>&1 &
  pid=$!
  pids+=("$pid")
  wait_until "gateway $name" "$pid" 60 \
    json_check "http://127.0.0.1:$port/health" "j['healthy_replicas'] == $n_replicas"
  if [ "$3" = true ]; then
    wait_until "gateway $name (kv events)" "$pid" 60 \
      json_check "http://127.0.0.1:$admin/admin/replicas" "all(r['kv_events'] for r in j)"
  fi
  targets+=("$name=http://127.0.0.1:$port")
  echo "gateway $name: http://127.0.0.1:$port (admin http://127.0.0.1:$admin)"
}
if [ -n "${KVGATE_POLICY_FILES:-}" ]; then
  for spec in $KVGATE_POLICY_FILES; do
    start_gateway "${spec%%=*}" prefix_aware true "${spec#*=}"
  done
else
  start_gateway round_robin round_robin false
  start_gateway least_load least_load false
  start_gateway consistent_hash consistent_hash false
  start_gateway prefix_aware_approx prefix_aware false
  start_gateway prefix_aware_events prefix_aware true
fi

# sglang-router, cache_aware with its default thresholds spelled out, then each variant's
# extra args (argparse: a flag given again wins); its metrics port kept on loopback; a worker
# that cannot register fails in 30 s instead of 30 min.
sglang_cmds=()
if [ "$sglang_ok" = 1 ]; then
  IFS=';' read -r -a variants <<<"${KVGATE_SGLANG_VARIANTS:-sglang_cache_aware=${KVGATE_SGLANG_ARGS:-}}"
  for variant in "${variants[@]}"; do
    [ -n "$variant" ] || continue
    name=${variant%%=*}
    port=$(free_port)
    read -r -a sglang_extra <<<"${variant#*=}"
    sglang_cmd=("$venv/bin/python" -m sglang_router.launch_router
      --worker-urls "${replica_urls[@]}" --policy cache_aware
      --cache-threshold 0.3 --balance-abs-threshold 64 --balance-rel-threshold 1.5
      --host 127.0.0.1 --port "$port"
      --prometheus-host 127.0.0.1 --prometheus-port "$(free_port)"
      --request-timeout-secs 600 --worker-startup-timeout-secs 30
      --worker-startup-check-interval 1 --shutdown-grace-period-secs 1 --log-level warn
      "${sglang_extra[@]}")
    "${sglang_cmd[@]}" >"$logs/$name.log" 2>&1 &
    pid=$!
    pids+=("$pid")
    # /health is 200 before any worker registers; /workers shows registration and health.
    wait_until "$name" "$pid" 120 json_check "http://127.0.0.1:$port/workers" \
      "j['total'] == $n_replicas and all(w['is_healthy'] for w in j['workers'])"
    targets+=("$name=http://127.0.0.1:$port")
    sglang_cmds+=("$name: ${sglang_cmd[*]}")
    echo "$name: http://127.0.0.1:$port"
  done
fi

# Our defaults, minus any the extra args set themselves.
bench_args=()
set -- "${defaults[@]}"
while [ $# -gt 0 ]; do
  flag=$1 value=$2
  shift 2
  for e in "${extra[@]}"; do
    if [ "$e" = "$flag" ] || [ "${e%%=*}" = "$flag" ]; then continue 2; fi
  done
  bench_args+=("$flag" "$value")
done
for t in "${targets[@]}"; do bench_args+=(--target "$t"); done
for u in "${replica_urls[@]}"; do bench_args+=(--flush "$u"); done
bench_args+=(--out "$out" "${extra[@]}")

{
  echo "date: $(date -u +%FT%TZ)"
  echo "kvgate: $bin ($("$bin" --version 2>/dev/null || echo unknown))"
  echo "replicas: $n_replicas, time scale $time_scale, extra args: ${KVGATE_REPLICA_ARGS:-none}"
  echo "targets: ${targets[*]}"
  if [ "$sglang_ok" = 1 ]; then
    for c in "${sglang_cmds[@]}"; do echo "sglang-router 0.3.2 $c"; done
  else
    echo "sglang-router: skipped (could not install)"
  fi
  echo "bench: $bin bench ${bench_args[*]}"
} >"$out/setup.txt"

echo "bench: $bin bench ${bench_args[*]}"
# In the background so that INT/TERM reach the trap at once; the trap stops bench too.
"$bin" bench "${bench_args[@]}" &
pid=$!
pids+=("$pid")
rc=0
wait "$pid" || rc=$?
echo "results in $out (bench exit status $rc)"
exit "$rc"

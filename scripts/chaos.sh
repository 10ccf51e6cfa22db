#!/usr/bin/env bash
# The gateway's hostile-client and careless-operator probes, against real processes (release
# build, sim replicas, one gateway), each printing PASS/FAIL with its measured figure. What
# docs/RELIABILITY.md reports comes from here.
#   scripts/chaos.sh [--only NAME[,NAME]] [--soak [MINUTES]] [--out DIR]
# Cases: big_prompt slowloris fd_exhaustion sigkill_replica sigstop_replica sigterm_drain
#   empty_policy priority_forgery prompt_list kv_events_token nonstream_cancel admin_token
#   tenant_timing garbage_upstream upstream_bounds event_flood half_close tools_head;
#   --soak adds a run at the knee with the gateway's RSS sampled every 10 s (default 20 min;
#   PASS when, after the first 10 minutes, RSS stays within 5% of its mean); `--only none
#   --soak 60` runs the soak alone.
# The upstream cases run misbehaving replicas from tests/python/fake_replica.py.
# Env: KVGATE_BIN (default target/release/kvgate, built if missing); KVGATE_SOAK_RATE (9
# requests/s); KVGATE_SOAK_GATEWAY_TOML (extra gateway-file lines for the soak's gateway).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

only=
soak=0
soak_min=20
out=
while [ $# -gt 0 ]; do
  case $1 in
    --only) only=,${2:?}, ; shift ;;
    --soak) soak=1; if [[ ${2:-} =~ ^[0-9]+$ ]]; then soak_min=$2; shift; fi ;;
    --out) out=${2:?}; shift ;;
    -h | --help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "chaos.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
out=${out:-loadtest/out/chaos-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out/logs"
out=$(cd "$out" && pwd)
logs=$out/logs
results=$out/results.txt
: >"$results"

bin=${KVGATE_BIN:-target/release/kvgate}
if [ -z "${KVGATE_BIN:-}" ] && [ ! -x "$bin" ]; then cargo build --release; fi
[ -x "$bin" ] || { echo "chaos.sh: no $bin" >&2; exit 1; }
bin=$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")
tokenizer=$root/models/qwen3
[ -f "$tokenizer/tokenizer.json" ] || ./scripts/fetch-models.sh
python3 -c 'import openai' 2>/dev/null || python3 -m pip install --quiet openai

work=$(mktemp -d)
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  sleep 0.5
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

export KVGATE_FLEET_TOKEN=chaos-fleet-token-$(python3 -c 'import secrets; print(secrets.token_hex(12))')
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
want() { [ -z "$only" ] || [[ $only == *",$1,"* ]]; }
record() { # NAME PASS|FAIL DETAIL
  printf '%-18s %s  %s\n' "$1" "$2" "$3" | tee -a "$results"
}
rss_kib() { awk '/VmRSS/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }

# start_replica NAME [ARGS...]: sets PID and ADDR (a child of this shell, stopped on exit).
start_replica() {
  local name=$1
  shift
  "$bin" replica --port 0 --replica-id "$name" --tokenizer "$tokenizer" "$@" >"$logs/replica-$name.log" 2>&1 &
  PID=$!
  pids+=("$PID")
  for _ in $(seq 300); do
    grep -q 'serving .* at http://' "$logs/replica-$name.log" && break
    sleep 0.1
  done
  ADDR=$(grep -m1 -o 'at http://[^ ]*' "$logs/replica-$name.log" | cut -c11-)
}

# start_gateway NAME REPLICAS_TOML [EXTRA_TOML]: sets PID, PORT and ADMIN.
start_gateway() {
  local name=$1 replicas=$2 extra=${3:-} port admin
  port=$(free_port)
  admin=$(free_port)
  cat >"$work/$name.toml" <<TOML
listen = "127.0.0.1:$port"
admin_listen = "127.0.0.1:$admin"
replicas = $replicas
policy_file = "$work/$name-policy.toml"
[model]
tokenizer_dir = "$tokenizer"
[health]
interval_ms = 200
timeout_ms = 300
$extra
TOML
  [ -f "$work/$name-policy.toml" ] || cp "${KVGATE_CHAOS_POLICY:-config/policy.toml}" "$work/$name-policy.toml"
  "$bin" gateway --config "$work/$name.toml" >"$logs/gateway-$name.log" 2>&1 &
  PID=$!
  pids+=("$PID")
  for _ in $(seq 300); do
    curl -sf --max-time 1 "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    sleep 0.1
  done
  PORT=$port
  ADMIN=$admin
}

metric() { # ADMIN_PORT NAME_WITH_LABELS → value (sum)
  curl -s "http://127.0.0.1:$1/metrics" | awk -v n="$2" 'index($0, n) == 1 {s += $NF} END {print s + 0}'
}

start_replica r0; r0=$ADDR
start_replica r1; r1=$ADDR
echo "replicas: $r0 $r1"
two="[\"$r0\", \"$r1\"]"
start_gateway main "$two"; gw_pid=$PID gw=$PORT gw_admin=$ADMIN
echo "gateway: http://127.0.0.1:$gw (admin $gw_admin), logs in $logs"
base=http://127.0.0.1:$gw

if want big_prompt; then
  before=$(rss_kib "$gw_pid")
  python3 - "$base" >"$work/big.txt" <<'PY'
import json, sys, time, threading, urllib.request
base = sys.argv[1]
text = "the quick brown fox jumps over the lazy dog " * 160000   # ~7 MB
body = json.dumps({"model": "Qwen3-8B", "messages": [{"role": "user", "content": text}], "max_tokens": 4}).encode()
out = []
def one():
    t = time.time()
    req = urllib.request.Request(base + "/v1/chat/completions", body, {"content-type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=120)
        code = 200
    except urllib.error.HTTPError as e:
        code = e.code
    out.append((code, time.time() - t))
ts = [threading.Thread(target=one) for _ in range(4)]
[t.start() for t in ts]; [t.join() for t in ts]
print(max(d for _, d in out), " ".join(str(c) for c, _ in out))
PY
  read -r worst codes <"$work/big.txt"
  sleep 1
  after=$(rss_kib "$gw_pid")
  grown=$(( (after - before) / 1024 ))
  if [[ "$codes" == "400 400 400 400" ]] && awk -v w="$worst" 'BEGIN {exit !(w < 1.0)}' && [ "$grown" -lt 1024 ]; then
    record big_prompt PASS "4 x 7 MB prompts: all 400, slowest answer ${worst}s, gateway RSS +${grown} MiB (now $((after / 1024)) MiB)"
  else
    record big_prompt FAIL "codes $codes, slowest ${worst}s, RSS +${grown} MiB"
  fi
fi

if want slowloris; then
  python3 - "$gw" >"$work/slow.txt" <<'PY'
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
t = time.time()
header = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" + b"x-pad: " + b"a" * 200
answer = b""
s.settimeout(0.05)
for b in header:
    try:
        s.send(bytes([b]))
    except OSError:
        break
    try:
        chunk = s.recv(4096)
        if not chunk:
            break
        answer += chunk
    except socket.timeout:
        pass
    time.sleep(1.0)
    if time.time() - t > 90:
        break
print(round(time.time() - t, 1), answer.split(b"\r\n")[0].decode() or "none")
PY
  read -r secs status <"$work/slow.txt"
  if [[ "$status" == *408* ]] && awk -v s="$secs" 'BEGIN {exit !(s <= 12)}'; then
    record slowloris PASS "1 byte/s header: cut after ${secs}s with '$status' (header deadline 10 s)"
  else
    record slowloris FAIL "after ${secs}s: $status"
  fi
fi

if want fd_exhaustion; then
  # A gateway with a 512-descriptor limit, flooded with 1,500 idle connections.
  # The limit applies to the gateway only (a subshell sets it and execs nothing else).
  port=$(free_port)
  admin=$(free_port)
  printf 'listen = "127.0.0.1:%s"\nadmin_listen = "127.0.0.1:%s"\nreplicas = %s\n[model]\ntokenizer_dir = "%s"\n' \
    "$port" "$admin" "$two" "$tokenizer" >"$work/fd.toml"
  (ulimit -n 512 && exec "$bin" gateway --config "$work/fd.toml") >"$logs/gateway-fd.log" 2>&1 &
  fd_pid=$! fd_port=$port fd_admin=$admin
  pids+=("$fd_pid")
  for _ in $(seq 300); do curl -sf --max-time 1 "http://127.0.0.1:$fd_port/health" >/dev/null 2>&1 && break; sleep 0.1; done
  log_before=$(grep -c "accept failed" "$logs/gateway-fd.log" || true)
  t0=$(cpu_ticks "$fd_pid")
  python3 - "$fd_port" "$fd_admin" >"$work/fd.txt" <<'PY'
import socket, sys, time, urllib.request
port, admin = int(sys.argv[1]), int(sys.argv[2])
socks, failed = [], 0
for i in range(1500):
    try:
        socks.append(socket.create_connection(("127.0.0.1", port), timeout=1))
    except OSError:
        failed += 1
time.sleep(0.5)
refused = failed
for s in socks:
    s.settimeout(0.001)
    try:
        if s.recv(64).startswith(b"HTTP/1.1 503"):
            refused += 1
    except (socket.timeout, OSError):
        pass
def ok(url):
    try:
        return urllib.request.urlopen(url, timeout=3).status == 200
    except Exception:
        return False
admin_ok = ok(f"http://127.0.0.1:{admin}/admin/replicas")
for s in socks[:200]:
    s.close()
time.sleep(1)
api_ok = ok(f"http://127.0.0.1:{port}/health")
print(refused, int(admin_ok), int(api_ok))
PY
  t1=$(cpu_ticks "$fd_pid")
  read -r refused admin_ok api_ok <"$work/fd.txt"
  lines=$(( $(grep -c "accept failed" "$logs/gateway-fd.log" || true) - log_before ))
  cpu=$(( (t1 - t0) ))
  if [ "$admin_ok" = 1 ] && [ "$api_ok" = 1 ] && [ "$lines" -lt 20 ]; then
    record fd_exhaustion PASS "1,500 connections at a 512-fd limit: $refused refused with 503, admin answered, API answered once some closed, $lines 'accept failed' lines, ${cpu} CPU ticks (1/100 s) over the flood"
  else
    record fd_exhaustion FAIL "refused $refused, admin_ok $admin_ok, api_ok $api_ok, log lines $lines, cpu ticks $cpu"
  fi
  kill "$fd_pid" 2>/dev/null || true
fi

sdk_stream() { # BASE MAX_TOKENS → prints "ok N" or "error TYPE: MESSAGE"
  python3 - "$1" "$2" <<'PY'
import sys
from openai import OpenAI
c = OpenAI(base_url=sys.argv[1] + "/v1", api_key="none", max_retries=0)
n = 0
try:
    for ch in c.chat.completions.create(model="Qwen3-8B", stream=True, max_tokens=int(sys.argv[2]),
                                        extra_body={"ignore_eos": True},
                                        messages=[{"role": "user", "content": "Tell me about KV caches."}]):
        n += 1
    print("ok", n)
except Exception as e:
    print("error", type(e).__name__ + ":", str(e)[:120].replace("\n", " "))
PY
}

if want sigkill_replica; then
  start_replica k --time-scale 4; k_pid=$PID k_addr=$ADDR
  start_gateway kill "[\"$k_addr\"]"; kg_pid=$PID kg=$PORT kg_admin=$ADMIN
  ( sleep 2; kill -9 "$k_pid" ) &
  res=$(sdk_stream "http://127.0.0.1:$kg" 2000)
  errs=$(metric "$kg_admin" 'kvgate_gateway_stream_errors_total{reason="upstream_error"}')
  if [[ "$res" == error* ]] && [ "${errs%.*}" -ge 1 ]; then
    record sigkill_replica PASS "replica SIGKILLed mid-stream: the OpenAI SDK raised ($res); counted as a stream error"
  else
    record sigkill_replica FAIL "$res; stream errors $errs"
  fi
  kill "$kg_pid" 2>/dev/null || true
fi

if want sigstop_replica; then
  start_replica s --time-scale 4; s_pid=$PID s_addr=$ADDR
  start_replica t --time-scale 4; t_addr=$ADDR
  printf 'version = "stop"\n[policy]\nkind = "round_robin"\n[[routes]]\nname = "interactive"\nslo = { itl_ms = 50 }\n' >"$work/stop-policy.toml"
  start_gateway stop "[\"$s_addr\", \"$t_addr\"]"; sg_pid=$PID sg=$PORT
  # Two streams, one on each replica (round robin); the first replica stops 2 s in.
  python3 - "http://127.0.0.1:$sg" "$s_pid" >"$work/stop.txt" <<'PY'
import os, signal, sys, threading, time, urllib.request, json
base, pid = sys.argv[1], int(sys.argv[2])
out = {}
def stream(i):
    body = json.dumps({"model": "Qwen3-8B", "stream": True, "max_tokens": 300, "ignore_eos": True,
                       "messages": [{"role": "user", "content": f"stream {i}"}]}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", body, {"content-type": "application/json"})
    t, last = time.time(), b""
    with urllib.request.urlopen(req, timeout=120) as r:
        replica = r.headers.get("x-kvgate-upstream")
        for line in r:
            if line.startswith(b"data: "):
                last = line.strip()
    out[i] = (replica, round(time.time() - t, 1), b"[DONE]" in last, b'"error"' in last)
ts = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
[t.start() for t in ts]
time.sleep(2)
os.kill(pid, signal.SIGSTOP)
[t.join() for t in ts]
for i in range(2):
    print(*out[i])
PY
  t1=$(date +%s.%N)
  news=$(for i in 1 2 3 4; do sdk_stream "http://127.0.0.1:$sg" 5 & done; wait)
  t2=$(date +%s.%N)
  kill -CONT "$s_pid"
  ok_new=$(grep -c '^ok' <<<"$news" || true)
  new_s=$(awk -v a="$t1" -v b="$t2" 'BEGIN {printf "%.1f", b - a}')
  stopped=$(grep "^$s_addr " "$work/stop.txt" || true)
  other=$(grep -v "^$s_addr " "$work/stop.txt" || true)
  read -r _ stop_s stop_done stop_err <<<"$stopped"
  read -r _ other_s other_done _ <<<"$other"
  if [ "$stop_err" = True ] && [ "$other_done" = True ] && [ "$ok_new" = 4 ] && awk -v s="$stop_s" 'BEGIN {exit !(s < 10)}'; then
    record sigstop_replica PASS "replica SIGSTOPped 2 s into a stream: that stream ended with an error event after ${stop_s}s, the other replica's finished ([DONE], ${other_s}s), 4/4 new requests served in ${new_s}s"
  else
    record sigstop_replica FAIL "stopped stream: $stopped; other: $other; new ok $ok_new in ${new_s}s"
  fi
  kill "$sg_pid" 2>/dev/null || true
fi

if want sigterm_drain; then
  # Slow replicas (4x the modelled step time), so 400-token streams last ~20 s.
  start_replica d0 --time-scale 4; d0=$ADDR
  start_replica d1 --time-scale 4; d1=$ADDR
  start_gateway drain "[\"$d0\", \"$d1\"]"; dg_pid=$PID dg=$PORT dg_admin=$ADMIN
  spids=()
  for i in $(seq 20); do sdk_stream "http://127.0.0.1:$dg" 400 >"$work/drain-$i.txt" & spids+=($!); done
  # SIGTERM once all 20 are in flight.
  for _ in $(seq 300); do
    [ "$(metric "$dg_admin" 'kvgate_gateway_route_in_flight{route="interactive"}')" = 20 ] && break
    sleep 0.1
  done
  in_flight=$(metric "$dg_admin" 'kvgate_gateway_route_in_flight{route="interactive"}')
  kill -TERM "$dg_pid"
  code=0
  wait "$dg_pid" || code=$?
  wait "${spids[@]}"
  done_ok=$(cat "$work"/drain-*.txt | grep -c '^ok 4[0-9][0-9]' || true)
  if [ "$done_ok" = 20 ] && [ "$code" = 0 ]; then
    record sigterm_drain PASS "SIGTERM with $in_flight streams in flight: 20/20 finished complete, gateway exited 0"
  else
    record sigterm_drain FAIL "$in_flight in flight at SIGTERM; $done_ok/20 complete, exit $code: $(cat "$work"/drain-*.txt | sort | uniq -c | tr '\n' ';')"
  fi
fi

if want empty_policy; then
  gen=$(metric "$gw_admin" kvgate_gateway_policy_generation)
  : >"$work/main-policy.toml"
  kill -HUP "$gw_pid"
  sleep 1.5
  ok=$(metric "$gw_admin" kvgate_gateway_policy_last_reload_ok)
  version=$(curl -s "http://127.0.0.1:$gw_admin/admin/policy" | python3 -c 'import json,sys; print(json.load(sys.stdin)["version"])')
  head -c 300 "${KVGATE_CHAOS_POLICY:-config/policy.toml}" >"$work/main-policy.toml"
  kill -HUP "$gw_pid"
  sleep 1.5
  ok2=$(metric "$gw_admin" kvgate_gateway_policy_last_reload_ok)
  gen2=$(metric "$gw_admin" kvgate_gateway_policy_generation)
  cp "${KVGATE_CHAOS_POLICY:-config/policy.toml}" "$work/main-policy.toml"
  if [ "${ok%.*}" = 0 ] && [ "${ok2%.*}" = 0 ] && [ "$gen" = "$gen2" ] && [ "$version" = default-1 ]; then
    record empty_policy PASS "empty and truncated policy files rejected on SIGHUP; version default-1 and generation $gen kept"
  else
    record empty_policy FAIL "ok $ok/$ok2, generation $gen -> $gen2, version $version"
  fi
fi

if want priority_forgery; then
  # A replica that runs 4 sequences at once, so requests queue there and its priority order
  # decides who goes first; the gateway in front of it has admission off, so the queue forms
  # at the replica, where a forwarded priority would act.
  start_replica prio --max-num-seqs 4 --time-scale 2; p_addr=$ADDR
  printf 'version = "prio"\n[policy]\nkind = "round_robin"\n[[routes]]\nname = "interactive"\nadmission = false\n' >"$work/prio-policy.toml"
  start_gateway prio "[\"$p_addr\"]"; pg=$PORT
  prio_probe() { # URL → "forged_median honest_median"
    python3 - "$1" <<'PY'
import json, os, statistics, sys, threading, time, urllib.request
url = sys.argv[1]
token = os.environ.get("KVGATE_FLEET_TOKEN", "")
def ttft(prio, i, out):
    body = {"model": "Qwen3-8B", "stream": True, "max_tokens": 30, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"question {i}"}]}
    if prio is not None:
        body["priority"] = prio
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"content-type": "application/json", "authorization": f"Bearer {token}"})
    t = time.time()
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                out.append(time.time() - t)
                break
        for _ in r:
            pass
forged, honest, ts = [], [], []
for i in range(40):
    t = threading.Thread(target=ttft, args=(-1000 if i % 2 else None, i, forged if i % 2 else honest))
    t.start(); ts.append(t); time.sleep(0.01)
[t.join() for t in ts]
print(round(statistics.median(forged), 2), round(statistics.median(honest), 2))
PY
  }
  read -r d_forged d_honest < <(prio_probe "http://$p_addr/v1/chat/completions")
  read -r g_forged g_honest < <(prio_probe "http://127.0.0.1:$pg/v1/chat/completions")
  if awk -v f="$g_forged" -v h="$g_honest" 'BEGIN {exit !(f >= 0.7 * h)}'; then
    record priority_forgery PASS "40 requests queued at a 4-sequence replica, half with priority -1000: median TTFT ${g_forged}s forged vs ${g_honest}s honest through the gateway (sent straight to the replica: ${d_forged}s vs ${d_honest}s)"
  else
    record priority_forgery FAIL "through the gateway ${g_forged}s forged vs ${g_honest}s honest (direct ${d_forged}s vs ${d_honest}s)"
  fi
fi

if want prompt_list; then
  route=$(python3 - "$base" <<'PY'
import json, sys, urllib.request
piece = "alpha beta gamma delta " * 900
body = {"model": "Qwen3-8B", "prompt": ["hi"] + [piece] * 3, "max_tokens": 1}
req = urllib.request.Request(sys.argv[1] + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"})
with urllib.request.urlopen(req, timeout=60) as r:
    print(r.headers.get("x-kvgate-route"))
PY
)
  if [ "$route" = long ]; then
    record prompt_list PASS "a list ['hi', 3 x ~3.6k tokens] took the long route (classified by its ~10.8k total)"
  else
    record prompt_list FAIL "route $route"
  fi
fi

if want kv_events_token; then
  code_of() { curl -s -o /dev/null --max-time 3 -w '%{http_code}' "$@" || true; }
  none=$(code_of "http://$r0/kv_events")
  bogus=$(code_of -H 'authorization: Bearer bogus' "http://$r0/kv_events")
  detok=$(code_of -X POST -d '{"tokens":[1,2]}' "http://$r0/detokenize")
  flush=$(code_of -X POST "http://$r0/flush_cache")
  if [ "$none$bogus$detok$flush" = 401401401401 ]; then
    record kv_events_token PASS "/kv_events, /detokenize, /flush_cache without or with a wrong token: 401"
  else
    record kv_events_token FAIL "kv_events $none/$bogus, detokenize $detok, flush $flush"
  fi
fi

if want admin_token; then
  export KVGATE_ADMIN_TOKEN=chaos-admin-token-0123456789
  start_gateway admintok "$two"; ag_pid=$PID ag_admin=$ADMIN
  unset KVGATE_ADMIN_TOKEN
  a=$(curl -s -o /dev/null --max-time 3 -w '%{http_code}' "http://127.0.0.1:$ag_admin/metrics" || true)
  b=$(curl -s -o /dev/null --max-time 3 -w '%{http_code}' -H 'authorization: Bearer bogus' -X POST "http://127.0.0.1:$ag_admin/admin/policy/reload" || true)
  c=$(curl -s -o /dev/null --max-time 3 -w '%{http_code}' -H 'authorization: Bearer chaos-admin-token-0123456789' "http://127.0.0.1:$ag_admin/admin/policy" || true)
  if [ "$a$b$c" = 401401200 ]; then
    record admin_token PASS "admin port: no token 401, bogus token 401, right token 200"
  else
    record admin_token FAIL "$a $b $c"
  fi
  kill "$ag_pid" 2>/dev/null || true
fi

if want nonstream_cancel; then
  start_replica n; n_addr=$ADDR
  start_gateway cancel "[\"$n_addr\"]"; ng_pid=$PID ng=$PORT
  curl -s --max-time 1 "http://127.0.0.1:$ng/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"Qwen3-8B","messages":[{"role":"user","content":"essay"}],"max_tokens":8000,"ignore_eos":true}' >/dev/null || true
  t0=$(date +%s.%N)
  left=1
  for _ in $(seq 50); do
    left=$(curl -s "http://$n_addr/get_load" | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["num_reqs"])')
    [ "$left" = 0 ] && break
    sleep 0.1
  done
  waited=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
  if [ "$left" = 0 ]; then
    record nonstream_cancel PASS "unstreamed 8k-token request, client gone after 1 s: the replica stopped it within ${waited}s"
  else
    record nonstream_cancel FAIL "still $left requests at the replica ${waited}s later"
  fi
  kill "$ng_pid" 2>/dev/null || true
fi

# start_fake NAME MODE [ARGS...]: a misbehaving replica (tests/python/fake_replica.py); sets
# PID and ADDR.
start_fake() {
  local name=$1 mode=$2 port
  shift 2
  port=$(free_port)
  python3 "$root/tests/python/fake_replica.py" --port "$port" --mode "$mode" "$@" >"$logs/fake-$name.log" 2>&1 &
  PID=$!
  pids+=("$PID")
  for _ in $(seq 100); do grep -q serving "$logs/fake-$name.log" && break; sleep 0.1; done
  ADDR=127.0.0.1:$port
}

if want tenant_timing; then
  # Two tenants; A sends a ~29k-token message, then B sends the same one, then A again.
  start_replica tt --time-scale 0; tt_addr=$ADDR
  export KVGATE_API_KEYS="chaos-key-tenant-a-0123=tenant-a,chaos-key-tenant-b-0123=tenant-b"
  start_gateway tenants "[\"$tt_addr\"]"; tg_pid=$PID tg=$PORT
  unset KVGATE_API_KEYS
  python3 - "http://127.0.0.1:$tg" >"$work/tenants.txt" <<'PY'
import json, random, statistics, sys, time, urllib.request
base = sys.argv[1]
words = "cache prefix block token replica gateway tenant routing latency stream prompt model engine".split()
def send(key, text):
    body = json.dumps({"model": "Qwen3-8B", "max_tokens": 1,
                       "messages": [{"role": "user", "content": text}]}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", body,
                                 {"content-type": "application/json", "authorization": f"Bearer {key}"})
    t = time.perf_counter()
    urllib.request.urlopen(req, timeout=60).read()
    return time.perf_counter() - t
A, B = "chaos-key-tenant-a-0123", "chaos-key-tenant-b-0123"
send(A, "warm up " * 50)
ratios, warm, faster = [], [], 0
for i in range(12):
    rnd = random.Random(i)
    text = " ".join(rnd.choice(words) + str(rnd.randrange(100)) for _ in range(12000))
    a_cold = send(A, text)
    b = send(B, text)
    a_warm = send(A, text)
    ratios.append(b / a_cold)
    warm.append(a_warm / a_cold)
    faster += b < 0.7 * a_cold
print(round(statistics.median(ratios), 2), round(statistics.median(warm), 2), faster, round(a_cold * 1e3))
PY
  read -r b_ratio warm_ratio faster cold_ms <"$work/tenants.txt"
  if awk -v b="$b_ratio" -v w="$warm_ratio" -v f="$faster" 'BEGIN {exit !(b >= 0.8 && w <= 0.6 && f <= 1)}'; then
    record tenant_timing PASS "12 pairs of a ~29k-token message (cold ${cold_ms} ms): tenant B after A takes ${b_ratio}x A's cold time (median; $faster of 12 under 0.7x), while A's own repeat takes ${warm_ratio}x — B cannot see A's cache"
  else
    record tenant_timing FAIL "B after A ${b_ratio}x A cold (median), $faster of 12 under 0.7x; A repeat ${warm_ratio}x"
  fi
  kill "$tg_pid" 2>/dev/null || true
fi

if want garbage_upstream; then
  start_fake junk invalid_json; junk=$ADDR
  start_fake web html; web=$ADDR
  start_fake good ok; good=$ADDR
  printf 'version = "garbage"\n[policy]\nkind = "round_robin"\n[[routes]]\nname = "interactive"\nadmission = false\n' >"$work/garbage-policy.toml"
  start_gateway garbage "[\"$junk\"]" 'outlier_consecutive_errors = 3'; ga_pid=$PID ga=$PORT ga_admin=$ADMIN
  code_json=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$ga/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"Qwen3-8B","messages":[{"role":"user","content":"hi"}],"max_tokens":4}')
  kill "$ga_pid" 2>/dev/null || true
  cp "$work/garbage-policy.toml" "$work/garbage2-policy.toml"
  start_gateway garbage2 "[\"$web\"]"; gb_pid=$PID gb=$PORT
  stream_out=$(curl -s -N "http://127.0.0.1:$gb/v1/chat/completions" -H 'content-type: application/json' -w ' HTTP%{http_code}' \
    -d '{"model":"Qwen3-8B","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"stream":true}')
  kill "$gb_pid" 2>/dev/null || true
  cp "$work/garbage-policy.toml" "$work/garbage3-policy.toml"
  start_gateway garbage3 "[\"$junk\", \"$good\"]" 'outlier_consecutive_errors = 3'; gc_pid=$PID gc=$PORT gc_admin=$ADMIN
  ok=0
  for i in $(seq 20); do
    c=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$gc/v1/chat/completions" -H 'content-type: application/json' \
      -d '{"model":"Qwen3-8B","messages":[{"role":"user","content":"hi"}],"max_tokens":4}')
    [ "$c" = 200 ] && ok=$((ok + 1))
  done
  ejected=$(metric "$gc_admin" kvgate_gateway_outlier_ejections_total)
  errors=$(metric "$gc_admin" kvgate_gateway_upstream_errors_total)
  junk_healthy=$(curl -s "http://127.0.0.1:$gc_admin/admin/replicas" | python3 -c "import json,sys; print([r['healthy'] for r in json.load(sys.stdin) if r['name']=='$junk'][0])")
  if [ "$code_json" = 502 ] && [[ "$stream_out" == *HTTP502 ]] && [ "$ok" = 20 ] && [ "${ejected%.*}" -ge 1 ] && [ "$junk_healthy" = False ]; then
    record garbage_upstream PASS "invalid JSON answer: $code_json; HTML to a stream: 502, no 200; beside a good replica: 20/20 answered, the junk one ejected after ${errors%.*} unusable answers (outlier ejections ${ejected%.*})"
  else
    record garbage_upstream FAIL "invalid JSON $code_json; html stream '${stream_out: -40}'; ok $ok/20; ejections $ejected; junk healthy $junk_healthy"
  fi
  kill "$gc_pid" 2>/dev/null || true
fi

if want upstream_bounds; then
  start_fake endless endless; e_addr=$ADDR
  start_fake ebody endless_body; eb_addr=$ADDR
  start_fake short short_body; sb_addr=$ADDR
  start_fake mstall models_stall; ms_addr=$ADDR
  bounds=$'[upstream]\nbody_idle_timeout_ms = 2000'
  for g in bend bbody bshort bmodels; do
    printf 'version = "b"\n[policy]\nkind = "round_robin"\n[[routes]]\nname = "interactive"\nadmission = false\n' >"$work/$g-policy.toml"
  done
  start_gateway bend "[\"$e_addr\"]"; p1=$PID g1=$PORT
  start_gateway bbody "[\"$eb_addr\"]" "$bounds"; p2=$PID g2=$PORT
  start_gateway bshort "[\"$sb_addr\"]" "$bounds"; p3=$PID g3=$PORT
  start_gateway bmodels "[\"$ms_addr\"]"; p4=$PID g4=$PORT
  python3 - "$g1" >"$work/endless.txt" <<'PY'
import json, sys, time, urllib.request
body = json.dumps({"model": "Qwen3-8B", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 16, "stream": True}).encode()
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions", body, {"content-type": "application/json"})
t, tokens, last = time.time(), 0, ""
with urllib.request.urlopen(req, timeout=60) as r:
    for line in r:
        if line.startswith(b"data: {"):
            last = line.decode().strip()
            tokens += b'"choices"' in line
        if time.time() - t > 20:
            break
print(tokens, round(time.time() - t, 2), "error" in last and "too_many_tokens" in last)
PY
  read -r e_tokens e_secs e_cut <"$work/endless.txt"
  rss0=$(rss_kib "$p2")
  t0=$(date +%s.%N)
  eb_code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 60 "http://127.0.0.1:$g2/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"Qwen3-8B","messages":[{"role":"user","content":"hi"}],"max_tokens":4}')
  eb_secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
  eb_grown=$(( ($(rss_kib "$p2") - rss0) / 1024 ))
  t0=$(date +%s.%N)
  sb_code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 60 "http://127.0.0.1:$g3/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"Qwen3-8B","messages":[{"role":"user","content":"hi"}],"max_tokens":4}')
  sb_secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
  t0=$(date +%s.%N)
  m_code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 30 "http://127.0.0.1:$g4/v1/models")
  m_secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
  if [ "$e_cut" = True ] && [ "$e_tokens" -le 33 ] && [ "$eb_code" = 502 ] && [ "$eb_grown" -lt 200 ] \
    && [ "$sb_code" = 504 ] && [ "$m_code" = 200 ] && awk -v m="$m_secs" -v s="$sb_secs" 'BEGIN {exit !(m < 3 && s < 10)}'; then
    record upstream_bounds PASS "endless stream, max_tokens 16: cut after $e_tokens token events (${e_secs}s) with too_many_tokens; endless body: $eb_code after ${eb_secs}s, RSS +${eb_grown} MiB; short body: $sb_code after ${sb_secs}s (2 s body deadline); stalled /v1/models: $m_code in ${m_secs}s"
  else
    record upstream_bounds FAIL "endless: $e_tokens events, ${e_secs}s, cut $e_cut; body $eb_code ${eb_secs}s +${eb_grown} MiB; short $sb_code ${sb_secs}s; models $m_code ${m_secs}s"
  fi
  kill "$p1" "$p2" "$p3" "$p4" 2>/dev/null || true
fi

if want event_flood; then
  zport=$(free_port)
  start_fake flood ok --flood "tcp://127.0.0.1:$zport"; f_addr=$ADDR
  start_gateway flood "[{ addr = \"$f_addr\", backend = \"vllm\", kv_events = \"tcp://127.0.0.1:$zport\" }]"; fl_pid=$PID fl_admin=$ADMIN
  rss0=$(rss_kib "$fl_pid")
  sleep 30
  blocks=$(metric "$fl_admin" kvgate_gateway_prefix_index_blocks)
  evicted=$(metric "$fl_admin" kvgate_gateway_prefix_index_evicted_total)
  rss1=$(rss_kib "$fl_pid")
  warned=$(grep -c "more KV blocks than its cache holds" "$logs/gateway-flood.log" || true)
  # The fake says its cache holds 4,096 blocks: the cap is 4,096 + 25% + 1,024.
  if [ "${blocks%.*}" -le 6144 ] && [ "${evicted%.*}" -gt 0 ] && [ "$warned" -ge 1 ] && [ $(( (rss1 - rss0) / 1024 )) -lt 64 ]; then
    record event_flood PASS "30 s of BlockStored without removals: ${evicted%.*} blocks evicted, index held at ${blocks%.*} blocks (cap 6,144), gateway RSS $((rss0 / 1024)) -> $((rss1 / 1024)) MiB, $warned log lines"
  else
    record event_flood FAIL "blocks $blocks, evicted $evicted, RSS $((rss0 / 1024)) -> $((rss1 / 1024)) MiB, warned $warned"
  fi
  kill "$fl_pid" 2>/dev/null || true
fi

if want half_close; then
  python3 - "$gw" >"$work/half.txt" <<'PY'
import json, socket, sys
out = []
for stream in (False, True):
    body = json.dumps({"model": "Qwen3-8B", "messages": [{"role": "user", "content": "Hello"}],
                       "max_tokens": 8, "stream": stream}).encode()
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              + f"content-length: {len(body)}\r\n\r\n".encode() + body)
    s.shutdown(socket.SHUT_WR)  # as `nc -N` does
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    final = data[data.rfind(b"HTTP/1.1 "):]
    out.append(final.split(b"\r\n")[0].decode() + (" [DONE]" if b"[DONE]" in final else ""))
print(" | ".join(out))
PY
  half=$(cat "$work/half.txt")
  if [[ "$half" == "HTTP/1.1 200 OK | HTTP/1.1 200 OK [DONE]" ]]; then
    record half_close PASS "request sent whole, then SHUT_WR: unstreamed and streamed both answered ($half)"
  else
    record half_close FAIL "$half"
  fi
fi

if want tools_head; then
  t1=$(curl -s "$base/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"Qwen3-8B","messages":[{"role":"user","content":"hi"}],"tools":[1]}' | python3 -c 'import json,sys; e=json.load(sys.stdin)["error"]; print(e.get("param"))')
  t2=$(curl -s "$base/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"Qwen3-8B","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{}}]}' | python3 -c 'import json,sys; e=json.load(sys.stdin)["error"]; print(e.get("param"))')
  h1=$(curl -s -o /dev/null -I -w '%{http_code}' "http://127.0.0.1:$gw_admin/admin/policy")
  h2=$(curl -s -o /dev/null -I -w '%{http_code}' "$base/health")
  if [ "$t1" = "tools[0]" ] && [ "$t2" = "tools[0].function.name" ] && [ "$h1$h2" = 200200 ]; then
    record tools_head PASS "tools [1]: 400 naming $t1; a function without a name: 400 naming $t2; HEAD /admin/policy and /health: 200"
  else
    record tools_head FAIL "tools [1] param $t1; nameless $t2; HEAD $h1 $h2"
  fi
fi

if [ "$soak" = 1 ]; then
  # The knee of BENCHMARKS' admission sweep: 8 modelled A100s (3,000 KV blocks, 4x step
  # time), the shipped routes with the interactive promise at 1 s / 150 ms, 9 requests/s.
  soak_list=
  for i in $(seq 0 7); do
    start_replica "soak$i" --gpu a100 --num-gpu-blocks 3000 --time-scale 4
    soak_list="$soak_list\"$ADDR\", "
  done
  cp loadtest/policies/shipped_itl150_on.toml "$work/soak-policy.toml"
  start_gateway soak "[${soak_list%, }]" "${KVGATE_SOAK_GATEWAY_TOML:-}"; sk_pid=$PID sk=$PORT
  samples=$out/soak-rss.csv
  echo "seconds,rss_kib,prefix_index_bytes,tokenizer_cache_bytes" >"$samples"
  ( t=0; while kill -0 "$sk_pid" 2>/dev/null; do
      echo "$t,$(rss_kib "$sk_pid"),$(metric "$ADMIN" kvgate_gateway_prefix_index_bytes),$(metric "$ADMIN" kvgate_gateway_tokenizer_cache_bytes)" >>"$samples"
      sleep 10; t=$((t + 10)); done ) &
  sampler=$!
  "$bin" bench --target "http://127.0.0.1:$sk" --workload chat --rate "${KVGATE_SOAK_RATE:-9}" \
    --duration $((soak_min * 60)) --warmup 30 --max-requests 1000000 --no-progress \
    --slo-ttft-ms 1000 --slo-itl-ms 150 --json-out "$out/soak-report.json" >"$logs/soak-bench.log" 2>&1 || true
  kill "$sampler" 2>/dev/null || true
  python3 - "$samples" >>"$results" <<'PY'
import csv, sys
rows = [(int(r["seconds"]), int(r["rss_kib"])) for r in csv.DictReader(open(sys.argv[1])) if int(r["rss_kib"]) > 0]
# Flat: after a warm-up (the first 10 minutes, or the first third of a shorter run), every
# sample within 5% of those samples' mean.
warm = min(600, rows[-1][0] // 3)
after = [r for t, r in rows if t >= warm]
mean = sum(after) / len(after)
lo, hi = min(after), max(after)
verdict = "PASS" if lo >= mean * 0.95 and hi <= mean * 1.05 else "FAIL"
print(f"{'soak':<18} {verdict}  {len(rows)} samples over {rows[-1][0]} s: after {warm} s RSS {lo/1024:.0f}-{hi/1024:.0f} MiB around a mean of {mean/1024:.0f} MiB ({(lo/mean-1)*100:+.1f}% / {(hi/mean-1)*100:+.1f}%)")
PY
  tail -1 "$results"
  printf '%-18s %s\n' soak-load "$(grep -E 'goodput|^target' "$logs/soak-bench.log" | tr -s ' ' | tr '\n' ' ')" | tee -a "$results"
fi

echo
echo "results in $results"
! grep -q ' FAIL ' "$results"

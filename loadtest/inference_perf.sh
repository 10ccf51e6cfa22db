#!/usr/bin/env bash
# kvgate against sglang-router with a load client neither wrote: inference-perf (the harness
# llm-d publishes its routing results with), its `shared_prefix` workload in the shape of
# llm-d's "b2b-saas" benchmark scaled to N sim replicas — 15 system prompts of 3,000 tokens, 5
# users each with 600-token questions, 100 output tokens, streaming /v1/completions, Poisson
# arrivals. For each seed, router and rate: replicas flushed, the router started fresh (nothing
# learnt in one run carries into the next), one inference-perf stage. Per run: the client's TTFT
# (p50/p95/p99), the router's CPU per request (utime + stime from /proc), and for kvgate its
# tokenise time, tokeniser refusals and, from its access log (RUN/access.jsonl), the time
# requests waited in the gateway: p99, and its share of the slowest 5% of requests' TTFT.
#   loadtest/inference_perf.sh [--out DIR]
# Env: KVGATE_BIN (target/release/kvgate), IP_RATES (4,10,16), IP_SEEDS (1,2,3), IP_DURATION
#   (60 s), IP_REPLICAS (8), IP_GROUPS (15), IP_USERS (5; 15 x 5 = 75 prompts do not divide
#   evenly over 8 replicas, so round-robin cannot look cache-aware by accident), IP_VENV
#   (.venv-inference-perf, Python >= 3.12), KVGATE_SGLANG_VENV (.venv-sglang), IP_PER_REQUEST
#   (0; 1: per-request client timings in each run's folder).
# Writes DIR/runs.jsonl (one line per run), DIR/summary.md and DIR/logs/.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=loadtest/out/inference-perf-$(date +%Y%m%d-%H%M%S)
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=${2:?}; shift ;;
    -h | --help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out/logs"
out=$(cd "$out" && pwd)
logs=$out/logs
bin=${KVGATE_BIN:-target/release/kvgate}
[ -x "$bin" ] || cargo build --release --bin kvgate
bin=$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")
tokenizer=$root/models/qwen3
[ -f "$tokenizer/tokenizer.json" ] || ./scripts/fetch-models.sh --tokenizer-only
rates=${IP_RATES:-4,10,16}
seeds=${IP_SEEDS:-1,2,3}
duration=${IP_DURATION:-60}
n=${IP_REPLICAS:-8}

# inference-perf needs Python >= 3.12: the newest python3.1x on PATH that runs (a pyenv shim
# for a version that is installed but not selected is on PATH and fails when run).
ipvenv=${IP_VENV:-.venv-inference-perf}
if [ ! -x "$ipvenv/bin/inference-perf" ]; then
  py=$(for v in 3.13 3.12; do p=$(command -v "python$v") && "$p" -c '' 2>/dev/null && { echo "$p"; break; }; done || true)
  if [ -z "$py" ] && command -v pyenv >/dev/null; then
    # pyenv's installed versions that are not selected: their interpreters directly.
    py=$(for v in $(pyenv versions --bare | sort -V -r); do
      case $v in 3.1[2-9]*) p=$(pyenv root)/versions/$v/bin/python3 && [ -x "$p" ] && { echo "$p"; break; } ;; esac
    done || true)
  fi
  [ -n "$py" ] || { echo "inference_perf.sh: needs python3.12 or newer for inference-perf" >&2; exit 1; }
  "$py" -m venv "$ipvenv"
  "$ipvenv/bin/pip" install --quiet inference-perf==0.7.0 >"$logs/pip-ip.log" 2>&1 ||
    { echo "inference_perf.sh: cannot install inference-perf 0.7.0 (see $logs/pip-ip.log)" >&2; exit 1; }
fi
sgvenv=${KVGATE_SGLANG_VENV:-.venv-sglang}
if ! "$sgvenv/bin/python" -c 'import sglang_router' 2>/dev/null; then
  python3 -m venv "$sgvenv"
  "$sgvenv/bin/pip" install --quiet sglang-router==0.3.2 >"$logs/pip-sglang.log" 2>&1 ||
    { echo "inference_perf.sh: cannot install sglang-router 0.3.2 (see $logs/pip-sglang.log)" >&2; exit 1; }
fi

# IP_PER_REQUEST=1: inference-perf also writes every request's timings (the client's side of
# a per-request comparison between the routers), prompts included.
per_request=
[ "${IP_PER_REQUEST:-0}" = 1 ] && per_request='report:
  request_lifecycle:
    per_request: true
    per_request_fields: {request: true, response: false, info: false, response_chunks: false, computed_metrics: true}'

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
export KVGATE_FLEET_TOKEN=inference-perf-fleet-$(python3 -c 'import secrets; print(secrets.token_hex(8))')

urls=()
for i in $(seq 0 $((n - 1))); do
  port=$(free_port)
  "$bin" replica --port "$port" --replica-id "r$i" --tokenizer "$tokenizer" --gpu a100 \
    --num-gpu-blocks 3000 --time-scale 4 >"$logs/replica-$i.log" 2>&1 &
  pids+=($!)
  urls+=("http://127.0.0.1:$port")
done
for u in "${urls[@]}"; do until curl -sf "$u/health" >/dev/null; do sleep 0.2; done; done
flush() { for u in "${urls[@]}"; do curl -sf -X POST -H "authorization: Bearer $KVGATE_FLEET_TOKEN" "$u/flush_cache" >/dev/null; done; }

# start_router NAME: sets RPID, RURL, RADMIN (kvgate's admin, empty for sglang).
start_router() { # NAME RUN_DIR
  local port admin list=
  port=$(free_port)
  RADMIN=
  if [ "$1" = kvgate ]; then
    admin=$(free_port)
    for u in "${urls[@]}"; do list="$list\"${u#http://}\", "; done
    cat >"$out/gateway.toml" <<TOML
listen = "127.0.0.1:$port"
admin_listen = "127.0.0.1:$admin"
replicas = [${list%, }]
[model]
tokenizer_dir = "$tokenizer"
[policy]
kind = "prefix_aware"
[access_log]
mode = "full"
path = "$2/access.jsonl"
TOML
    "$bin" gateway --config "$out/gateway.toml" >>"$logs/kvgate.log" 2>&1 &
    RPID=$!
    RADMIN=http://127.0.0.1:$admin
    until curl -sf "$RADMIN/admin/replicas" 2>/dev/null | python3 -c 'import json,sys; sys.exit(not all(r["kv_events"] and r["healthy"] for r in json.load(sys.stdin)))' 2>/dev/null; do sleep 0.3; done
  else
    "$sgvenv/bin/python" -m sglang_router.launch_router --worker-urls "${urls[@]}" --policy cache_aware \
      --host 127.0.0.1 --port "$port" --prometheus-host 127.0.0.1 --prometheus-port "$(free_port)" \
      --request-timeout-secs 600 --worker-startup-timeout-secs 30 --log-level warn >>"$logs/sglang.log" 2>&1 &
    RPID=$!
    until curl -sf "http://127.0.0.1:$port/workers" 2>/dev/null | python3 -c "import json,sys; j=json.load(sys.stdin); sys.exit(not (j['total'] == $n and all(w['is_healthy'] for w in j['workers'])))" 2>/dev/null; do sleep 0.3; done
  fi
  RURL=http://127.0.0.1:$port
}

metric() { curl -s "$1/metrics" | awk -v n="$2" 'index($0, n) == 1 {s += $NF} END {print s + 0}'; }

: >"$out/runs.jsonl"
IFS=, read -r -a rate_list <<<"$rates"
IFS=, read -r -a seed_list <<<"$seeds"
for seed in "${seed_list[@]}"; do
  for router in kvgate sglang; do
    for rate in "${rate_list[@]}"; do
      flush
      run=$out/$router-seed$seed-rate$rate
      mkdir -p "$run"
      start_router "$router" "$run"
      cat >"$run/config.yml" <<YAML
load:
  type: poisson
  stages:
    - rate: $rate
      duration: $duration
api:
  type: completion
  streaming: true
server:
  type: vllm
  model_name: Qwen3-8B
  base_url: $RURL
  ignore_eos: true
data:
  type: shared_prefix
  shared_prefix:
    num_groups: ${IP_GROUPS:-15}
    num_prompts_per_group: ${IP_USERS:-5}
    system_prompt_len: 3000
    question_len: 600
    output_len: 100
    seed: $seed
tokenizer:
  pretrained_model_name_or_path: $tokenizer
storage:
  local_storage:
    path: $run
$per_request
YAML
      tok0=0 tokn0=0 busy0=0
      if [ -n "$RADMIN" ]; then
        tok0=$(metric "$RADMIN" kvgate_gateway_tokenize_seconds_sum)
        tokn0=$(metric "$RADMIN" kvgate_gateway_tokenize_seconds_count)
        busy0=$(metric "$RADMIN" kvgate_gateway_tokenizer_refused_total)
      fi
      c0=$(cpu_ticks "$RPID")
      echo "seed $seed, $router, $rate req/s"
      "$ipvenv/bin/inference-perf" -c "$run/config.yml" >"$run/inference-perf.log" 2>&1 || true
      c1=$(cpu_ticks "$RPID")
      tok=0 tokn=0 busy=0
      if [ -n "$RADMIN" ]; then
        tok=$(metric "$RADMIN" kvgate_gateway_tokenize_seconds_sum)
        tokn=$(metric "$RADMIN" kvgate_gateway_tokenize_seconds_count)
        busy=$(metric "$RADMIN" kvgate_gateway_tokenizer_refused_total)
      fi
      kill "$RPID" 2>/dev/null || true
      wait "$RPID" 2>/dev/null || true
      python3 - "$run/summary_lifecycle_metrics.json" "$router" "$seed" "$rate" "$((c1 - c0))" \
        "$tok0" "$tok" "$tokn0" "$tokn" "$busy0" "$busy" "$run/access.jsonl" >>"$out/runs.jsonl" <<'PY'
import json, os, sys
from pathlib import Path
path, router, seed, rate, ticks, tok0, tok, n0, n, b0, b, access = sys.argv[1:]
s = json.load(open(path))
# Where kvgate's tail comes from: time waiting in the gateway (queue_ms, holds included),
# read as the sweep summaries read it.
sys.path.insert(0, os.path.join(os.getcwd(), "loadtest"))
from summarize import access_stats
st = access_stats(Path(access), 0.0) if os.path.exists(access) else None
gw = {"gw_queue_p99_ms": st["queue_p99"], "slow5_queued_share": st["slow_share"]} if st else {}
ok = s.get("successes", {})
ttft = ok.get("latency", {}).get("time_to_first_token", {})
count = ok.get("count", 0)
fail = s.get("failures", {}).get("count", 0)
reqs = float(n) - float(n0)
print(json.dumps({
    "router": router, "seed": int(seed), "rate": float(rate), "ok": count, "failed": fail,
    "ttft_p50": ttft.get("median"), "ttft_p95": ttft.get("p95"), "ttft_p99": ttft.get("p99"),
    "cpu_ms_per_request": int(ticks) * 10 / max(1, count),
    "tokenize_ms_mean": (float(tok) - float(tok0)) * 1e3 / reqs if reqs > 0 else None,
    "tokenizer_refused": float(b) - float(b0),
    **gw,
}))
PY
      tail -1 "$out/runs.jsonl"
    done
  done
done

python3 - "$out/runs.jsonl" >"$out/summary.md" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rates = sorted({r["rate"] for r in runs})
def cell(router, rate, key):
    return {r["seed"]: r[key] for r in runs if r["router"] == router and r["rate"] == rate and r[key] is not None}
def med(xs):
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}–{max(xs):.3f}]" if xs else "—"
print("| rate | metric | kvgate | sglang-router | kvgate ÷ sglang (median [range] over seeds) |")
print("|---:|---|---:|---:|---:|")
for rate in rates:
    for key in ("ttft_p50", "ttft_p95", "ttft_p99", "cpu_ms_per_request"):
        k, s = cell("kvgate", rate, key), cell("sglang", rate, key)
        ratios = [k[x] / s[x] for x in k if x in s and s[x]]
        print(f"| {rate:g} | {key} | {med(list(k.values()))} | {med(list(s.values()))} | {med(ratios)} |")
tok = [r["tokenize_ms_mean"] for r in runs if r["router"] == "kvgate" and r["tokenize_ms_mean"] is not None]
busy = sum(r["tokenizer_refused"] for r in runs if r["router"] == "kvgate")
fails = {rt: sum(r["failed"] for r in runs if r["router"] == rt) for rt in ("kvgate", "sglang")}
q = [r["gw_queue_p99_ms"] for r in runs if r.get("gw_queue_p99_ms") is not None]
sh = [r["slow5_queued_share"] for r in runs if r.get("slow5_queued_share") is not None]
if q:
    print(f"\nkvgate's gateway queue (access log): p99 {med(q)} ms over runs; queued share of the slowest 5% of requests' TTFT {med([100 * x for x in sh])}%")
print(f"\nkvgate tokenise time per request: mean over runs {statistics.mean(tok):.2f} ms (range {min(tok):.2f}–{max(tok):.2f}); tokenizer_busy refusals: {busy:g}; failed requests: kvgate {fails['kvgate']}, sglang {fails['sglang']}")
PY
cat "$out/summary.md"
echo "results in $out"

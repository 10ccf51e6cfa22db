#!/usr/bin/env bash
# Filling the trough: one compressed day of interactive chat traffic on 8 sim replicas (arrivals
# a cosine from --low × --peak req/s at night to --peak at noon over --day seconds, seeded),
# three ways, each on fresh replicas and a fresh gateway:
#   alone:  the interactive day only;
#   api:    the same day, and a --lines batch job submitted through the Batch API (openai SDK)
#           at its start, fed by the gateway into the spare capacity;
#   route:  the same day, and the same lines sent as plain requests on the `batch` priority
#           route by a client holding --concurrency of them in flight (today's way).
# Per run: the interactive TTFT p95/p99 and goodput (kvgate bench, promise 2 s / 150 ms), the
# fleet's busy share over the day (the replicas' own busy_seconds: a duty cycle) and its model
# FLOPs utilisation (their model_flops over their peak_flops), the batch's finish time and
# lines refused. Writes DIR/seed-S-MODE.{json,busy,batch} and DIR/summary.md.
#   loadtest/batch_trough.sh --out DIR [--seeds 4,5,6] [--day 360] [--peak 8] [--low 0.125]
#                            [--lines 20000] [--ticket-words 150] [--answer-tokens 48]
#                            [--window 1h] [--modes alone,api,route]
# The gateway's batch settings come from KVGATE_BATCH_HEADROOM (0.7), KVGATE_BATCH_PER_REPLICA (8)
# and KVGATE_BATCH_IN_FLIGHT (0).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

out=
seeds=4,5,6
day=360
peak=8
low=0.125
lines=20000
answer_tokens=48
ticket_words=150
window=1h
modes=alone,api,route
concurrency=128
gpu=${KVGATE_GPU:-l4}
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=${2:?}; shift ;;
    --seeds) seeds=${2:?}; shift ;;
    --day) day=${2:?}; shift ;;
    --peak) peak=${2:?}; shift ;;
    --low) low=${2:?}; shift ;;
    --lines) lines=${2:?}; shift ;;
    --ticket-words) ticket_words=${2:?}; shift ;;
    --answer-tokens) answer_tokens=${2:?}; shift ;;
    --window) window=${2:?}; shift ;;
    --modes) modes=${2:?}; shift ;;
    --concurrency) concurrency=${2:?}; shift ;;
    -h | --help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "batch_trough.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$out" ] || { echo "batch_trough.sh: --out is required" >&2; exit 2; }
mkdir -p "$out/logs"
out=$(cd "$out" && pwd)
bin=${KVGATE_BIN:-target/release/kvgate}
[ -x "$bin" ] || cargo build --release
./scripts/fetch-models.sh >/dev/null
tok=$root/models/qwen3
export KVGATE_FLEET_TOKEN=${KVGATE_FLEET_TOKEN:-$(python3 -c 'import secrets; print(secrets.token_hex(24))')}
work=$(mktemp -d)
pids=()
stop_all() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
trap 'stop_all; rm -rf "$work"' EXIT

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

wait_for() { # WHAT SECONDS CMD...
  local what=$1 deadline=$((SECONDS + $2))
  shift 2
  until "$@" 2>/dev/null; do
    [ "$SECONDS" -lt "$deadline" ] || { echo "batch_trough.sh: $what not ready; see $out/logs" >&2; exit 1; }
    sleep 0.1
  done
}

start_replicas() { # TAG -> addrs
  addrs=()
  local i log url
  for i in 0 1 2 3 4 5 6 7; do
    log=$out/logs/$1-replica-$i.log
    "$bin" replica --port 0 --replica-id "r$i" --gpu "$gpu" --tokenizer "$tok" >"$log" 2>&1 &
    pids+=("$!")
  done
  for i in 0 1 2 3 4 5 6 7; do
    log=$out/logs/$1-replica-$i.log
    wait_for "replica $i" 60 grep -q 'serving .* at http://' "$log"
    url=$(grep -m1 -o 'at http://[^ ]*' "$log" | cut -c11-)
    wait_for "replica $i" 60 curl -sf --max-time 2 -o /dev/null "http://$url/health"
    addrs+=("$url")
  done
}

start_gateway() { # TAG -> port, admin
  local tag=$1 list
  port=$(free_port)
  admin=$(free_port)
  list=$(printf '"%s", ' "${addrs[@]}")
  cat >"$work/$tag-policy.toml" <<'EOF'
version = "batch-trough"
hit_signals = "exact"
[policy]
kind = "prefix_aware"
[[routes]]
name = "batch"
priority = "batch"
queue_size = 100000
queue_timeout_ms = 120000
engine_priority = 1               # replicas admit interactive requests first
[[routes]]
name = "interactive"
slo = { ttft_ms = 2000, itl_ms = 150 }
EOF
  cat >"$work/$tag.toml" <<EOF
listen = "127.0.0.1:$port"
admin_listen = "127.0.0.1:$admin"
replicas = [${list%, }]
policy_file = "$work/$tag-policy.toml"
[model]
tokenizer_dir = "$tok"
[batch]
path = "$work/$tag-batch.sqlite3"
max_in_flight = ${KVGATE_BATCH_IN_FLIGHT:-0}
headroom = ${KVGATE_BATCH_HEADROOM:-0.7}
max_per_replica = ${KVGATE_BATCH_PER_REPLICA:-8}
[access_log]
mode = "full"
path = "$out/logs/access-$tag.jsonl"
EOF
  "$bin" gateway --config "$work/$tag.toml" >"$out/logs/gateway-$tag.log" 2>&1 &
  pids+=("$!")
  wait_for "gateway $tag" 60 curl -sf --max-time 2 -o /dev/null "http://127.0.0.1:$port/ready"
}

busy_total() { # -> "wall_s busy_s_sum model_flops_sum peak_flops_sum" over the replicas
  local a sum="0 0 0" b
  for a in "${addrs[@]}"; do
    b=$(curl -sf -H "Authorization: Bearer $KVGATE_FLEET_TOKEN" "http://$a/get_load" |
      python3 -c 'import json,sys; v=json.load(sys.stdin); v=v[0] if isinstance(v, list) else v; print(v.get("busy_seconds", 0), v.get("model_flops") or 0, v.get("peak_flops") or 0)')
    sum=$(python3 -c "a='$sum'.split(); b='$b'.split(); print(' '.join(repr(float(x) + float(y)) for x, y in zip(a, b)))")
  done
  echo "$(date +%s.%N) $sum"
}

# The batch job: 4 tasks (a shared system prompt each), a ticket of --ticket-words words a line,
# --answer-tokens out.
python3 - "$work/batch.jsonl" "$lines" "$ticket_words" "$answer_tokens" <<'PY'
import json, random, sys
path, n, words_per_ticket, answer = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(11)
words = ("invoice printer refund login outage latency upgrade contract renewal billing "
         "password export dashboard alert timeout region quota migration backup restore").split()
tasks = [
    f"You are a support analyst. Task {t}: read the ticket and answer with a one-line "
    + ["summary", "priority (P1-P4) and reason", "product area", "customer sentiment"][t]
    + ". " + " ".join(rng.choice(words) for _ in range(220))
    for t in range(4)
]
with open(path, "w") as f:
    for i in range(n):
        t = i % 4
        ticket = " ".join(rng.choice(words) for _ in range(words_per_ticket))
        f.write(json.dumps({
            "custom_id": f"ticket-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "Qwen3-8B", "max_tokens": answer, "ignore_eos": True,
                     "messages": [{"role": "system", "content": tasks[t]},
                                  {"role": "user", "content": f"Ticket {i}: {ticket}"}]},
        }) + "\n")
PY

IFS=, read -r -a seed_list <<<"$seeds"
IFS=, read -r -a mode_list <<<"$modes"
for seed in "${seed_list[@]}"; do
  for mode in "${mode_list[@]}"; do
    tag=seed-$seed-$mode
    if [ -f "$out/$tag.batch" ]; then
      echo "batch_trough: $tag done already"
      continue
    fi
    echo "batch_trough: $tag"
    start_replicas "$tag"
    start_gateway "$tag"
    base=http://127.0.0.1:$port
    t0=$(date +%s.%N)
    busy0=$(busy_total)
    sender=
    case $mode in
      api)
        python3 - "$base/v1" "$work/batch.jsonl" "$window" >"$out/$tag.submit" <<'PY'
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1], api_key="none", max_retries=0, timeout=600)
f = c.files.create(file=open(sys.argv[2], "rb"), purpose="batch")
b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                     completion_window=sys.argv[3])
print(b.id)
PY
        ;;
      route)
        python3 - "$base" "$work/batch.jsonl" "$concurrency" >"$out/$tag.route" 2>"$out/logs/$tag-sender.log" <<'PY' &
import collections, json, sys, threading, time, urllib.error, urllib.request
from concurrent.futures import ThreadPoolExecutor
base, path, conc = sys.argv[1], sys.argv[2], int(sys.argv[3])
lines = [json.loads(l) for l in open(path)]
status = collections.Counter()
lock = threading.Lock()
t0 = time.time()
def one(l):
    req = urllib.request.Request(base + l["url"], data=json.dumps(l["body"]).encode(),
                                 headers={"content-type": "application/json",
                                          "x-kvgate-priority": "batch"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()
            code = r.status
    except urllib.error.HTTPError as e:
        code = e.code
    except Exception as e:
        code = type(e).__name__
    with lock:
        status[code] += 1
with ThreadPoolExecutor(conc) as pool:
    list(pool.map(one, lines))
print(json.dumps({"status": {str(k): v for k, v in status.items()}, "seconds": time.time() - t0}))
PY
        sender=$!
        ;;
    esac
    "$bin" bench --target "$base" --model Qwen3-8B --tokenizer "$tok" --workload chat \
      --daily-low "$low" --rate "$peak" --duration "$day" --warmup 0 --seed "$seed" \
      --slo-ttft-ms 2000 --slo-itl-ms 150 --no-progress --json-out "$out/$tag.json" \
      >"$out/logs/bench-$tag.log" 2>&1 || { echo "batch_trough.sh: bench failed, see $out/logs" >&2; exit 1; }
    busy1=$(busy_total)
    echo "$busy0 $busy1 ${#addrs[@]}" >"$out/$tag.busy"
    case $mode in
      api)
        python3 - "$base/v1" "$(cat "$out/$tag.submit")" "$t0" >"$out/$tag.batch" <<'PY'
import json, sys, time, openai
c = openai.OpenAI(base_url=sys.argv[1], api_key="none", max_retries=2)
bid, t0 = sys.argv[2], float(sys.argv[3])
while True:
    b = c.batches.retrieve(bid)
    if b.status in ("completed", "failed", "expired", "cancelled"):
        break
    time.sleep(2)
print(json.dumps({"status": b.status, "seconds": time.time() - t0,
                  "window_s": b.expires_at - b.created_at,
                  "completed": b.request_counts.completed, "failed": b.request_counts.failed,
                  "total": b.request_counts.total}))
PY
        ;;
      route)
        wait "$sender" || true
        cp "$out/$tag.route" "$out/$tag.batch"
        ;;
      *) echo '{}' >"$out/$tag.batch" ;;
    esac
    cp "$out/logs/gateway-$tag.log" "$out/logs/gateway-$tag.kept.log" 2>/dev/null || true
    stop_all
  done
done

python3 - "$out" "${seed_list[@]}" <<'PY' | tee "$out/summary.md"
import json, os, statistics, sys

out, seeds = sys.argv[1], sys.argv[2:]


def find(v, key):
    if isinstance(v, dict):
        if key in v:
            return v[key]
        for x in v.values():
            r = find(x, key)
            if r is not None:
                return r
    if isinstance(v, list):
        for x in v:
            r = find(x, key)
            if r is not None:
                return r
    return None


def load(seed, mode):
    p = f"{out}/seed-{seed}-{mode}"
    if not os.path.exists(p + ".json"):
        return None
    rep = json.load(open(p + ".json"))
    f = [float(x) for x in open(p + ".busy").read().split()]
    mfu = None
    if len(f) == 9:  # t0 busy0 flops0 peak0 t1 busy1 flops1 peak1 replicas
        wall = f[4] - f[0]
        busy = (f[5] - f[1]) / (wall * f[8])
        mfu = (f[6] - f[2]) / (wall * f[7]) if f[7] > 0 else None
    else:  # t0 busy0 t1 busy1 replicas (before model FLOPs were read)
        wall = f[2] - f[0]
        busy = (f[3] - f[1]) / (wall * f[4])
    ttft = find(rep, "ttft_s")
    return {
        "p95": ttft["p95"], "p99": ttft["p99"],
        "goodput": find(rep, "goodput_requests_per_s"), "busy": busy, "mfu": mfu,
        "batch": json.load(open(p + ".batch")),
    }


def cell(vals, fmt="{:.2f}"):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "–"
    return (fmt + " [" + fmt + "–" + fmt + "]").format(statistics.median(vals), min(vals), max(vals))


runs = {m: [load(s, m) for s in seeds] for m in ("alone", "api", "route")}
print("| run | busy share | × alone | MFU | × alone | TTFT p95 s | × alone | TTFT p99 s | × alone | goodput req/s | × alone | batch |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
for m in ("alone", "api", "route"):
    rs = runs[m]
    if not any(rs):
        continue
    ratio = lambda k: [r[k] / a[k] if r and a and r[k] is not None and a[k] else None for r, a in zip(rs, runs["alone"])]
    val = lambda k: [r[k] if r else None for r in rs]
    batch = []
    for r in rs:
        if not r or not r["batch"]:
            continue
        b = r["batch"]
        if "total" in b:
            batch.append(f"{b['status']} {b['completed']}/{b['total']} in {b['seconds']:.0f} s (window {b['window_s']} s)")
        else:
            batch.append(f"{b['status']} in {b['seconds']:.0f} s")
    print(f"| {m} | {cell(val('busy'))} | {cell(ratio('busy'))} | {cell(val('mfu'), '{:.4f}')} | {cell(ratio('mfu'))} | {cell(val('p95'))} | {cell(ratio('p95'))} "
          f"| {cell(val('p99'))} | {cell(ratio('p99'))} | {cell(val('goodput'))} | {cell(ratio('goodput'), '{:.3f}')} "
          f"| {'; '.join(batch) or '–'} |")
PY

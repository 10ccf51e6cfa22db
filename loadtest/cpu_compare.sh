#!/usr/bin/env bash
# Prefix routing on real compute: 2 `cpu` replicas of the default model (SmolLM2-135M Q4_1,
# one thread each on a 2-core box), one gateway per policy (prefix_aware, round_robin) with the
# model file's own tokenizer and KV events, and `kvgate bench` replaying a seeded multi-turn
# trace sized for CPU replicas (8 tenants with ~350-token system prompts, 4-turn sessions,
# 16-token answers). Every seed starts every process afresh; replicas are flushed before each
# target's run. Then the median and range over seeds (loadtest/summarize.py).
#   loadtest/cpu_compare.sh [--out DIR] [--seeds 1,2,3] [--rate 0.5] [--duration 90]
# Env: KVGATE_BIN (default target/release/kvgate), KVGATE_THREADS (1 per replica).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=loadtest/out/cpu-compare-$(date +%Y%m%d-%H%M%S)
seeds=1,2,3
rate=0.5
duration=90
warmup=15
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=${2:?}; shift ;;
    --seeds) seeds=${2:?}; shift ;;
    --rate) rate=${2:?}; shift ;;
    --duration) duration=${2:?}; shift ;;
    -h | --help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "cpu_compare.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
bin=${KVGATE_BIN:-target/release/kvgate}
[ -x "$bin" ] || cargo build --release
model=$root/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$model" ] || ./scripts/fetch-models.sh
name=SmolLM2-135M-Instruct.Q4_1
threads=${KVGATE_THREADS:-1}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export KVGATE_FLEET_TOKEN=${KVGATE_FLEET_TOKEN:-$(python3 -c 'import secrets; print(secrets.token_hex(24))')}

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
trap cleanup EXIT

wait_url() { # url what
  for _ in $(seq 1 600); do
    curl -sf -o /dev/null "$1/health" && return 0
    sleep 0.2
  done
  echo "cpu_compare.sh: $2 never became healthy" >&2
  exit 1
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

trace() { # seed file
  python3 - "$1" "$2" <<'PY'
import json, random, sys
seed, path = int(sys.argv[1]), sys.argv[2]
rng = random.Random(seed)
words = ("timetable platform ticket refund delay connection luggage bicycle station night "
         "express regional season pass discount student senior family group seat window aisle "
         "quiet coach restaurant wifi power socket accessibility ramp lift staff desk lost "
         "property locker parking taxi bus tram ferry airport transfer weekend holiday "
         "timetable change engineering works replacement service strike compensation").split()
def text(n):
    return " ".join(rng.choice(words) for _ in range(n))
tenants = [f"You are the assistant of railway company {t}. Policies: " + text(300) for t in range(8)]
sessions, lines, clock = [], [], 0.0
for s in range(64):
    sessions.append({"id": s, "system": tenants[s % 8], "history": [], "turns": 4})
live = []
while sessions or live:
    while sessions and len(live) < 6:
        live.append(sessions.pop(0))
    s = rng.choice(live)
    s["history"].append({"role": "user", "content": text(20) + "?"})
    msgs = [{"role": "system", "content": s["system"]}] + s["history"]
    clock += rng.expovariate(1.0)
    lines.append({"timestamp": round(clock, 3), "messages": msgs, "max_tokens": 16,
                  "session": s["id"]})
    s["history"].append({"role": "assistant", "content": text(12) + "."})
    s["turns"] -= 1
    if s["turns"] == 0:
        live.remove(s)
with open(path, "w") as f:
    for l in lines:
        f.write(json.dumps(l) + "\n")
PY
}

IFS=, read -r -a seed_list <<<"$seeds"
for seed in "${seed_list[@]}"; do
  run=$out/seed-$seed-rate-$rate
  mkdir -p "$run/logs"
  trace "$seed" "$run/trace.jsonl"
  reps=()
  for i in 0 1; do
    port=$(free_port)
    "$bin" replica --backend cpu --model "$model" --threads "$threads" --kv-cache-mib 256 \
      --port "$port" --replica-id "cpu-$i" >"$run/logs/replica-$i.log" 2>&1 &
    pids+=($!)
    reps+=("127.0.0.1:$port")
  done
  for r in "${reps[@]}"; do wait_url "http://$r" "replica $r"; done
  targets=()
  for policy in prefix_aware round_robin; do
    port=$(free_port); admin=$(free_port)
    cat >"$run/gateway-$policy.toml" <<TOML
listen = "127.0.0.1:$port"
admin_listen = "127.0.0.1:$admin"
replicas = ["${reps[0]}", "${reps[1]}"]
[model]
name = "$name"
tokenizer_dir = "$model"
[policy]
kind = "$policy"
[index]
kv_events = true
TOML
    "$bin" gateway --config "$run/gateway-$policy.toml" >"$run/logs/gateway-$policy.log" 2>&1 &
    pids+=($!)
    wait_url "http://127.0.0.1:$port" "gateway $policy"
    targets+=(--target "$policy=http://127.0.0.1:$port")
  done
  echo "cpu_compare: seed $seed, rate $rate"
  "$bin" bench "${targets[@]}" --model "$name" --trace "$run/trace.jsonl" --rates "$rate" \
    --duration "$duration" --warmup "$warmup" --seed "$seed" --slo-ttft-ms 3000 \
    --slo-itl-ms 200 --no-progress --flush "http://${reps[0]}" --flush "http://${reps[1]}" \
    --tokenizer "$model" --out "$run" 2>&1 | tee "$run/bench.log" | grep '^\[' || true
  cleanup
done
python3 loadtest/summarize.py "$out" | tee "$out/summary.md"

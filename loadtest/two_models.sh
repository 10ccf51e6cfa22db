#!/usr/bin/env bash
# One gateway in front of two models against one gateway per model, on the same traffic: per
# seed, 8 fresh sim replicas (4 serving Qwen3-8B, 4 serving Llama-3.1-8B-Instruct, each with
# its model's real tokenizer), then two runs with fresh gateways —
#   shared:   one kvgate with both models in [[models]], each model's pool its 4 replicas;
#   separate: two kvgates, one [model] each over its 4 replicas —
# and in both runs two `kvgate bench` clients at once, one per model, with the same seed. The
# summary sets each model's prefix hit ratio (the replicas' cached_tokens over prompt tokens,
# exact hit signals) and TTFT in the shared run beside the separate run's.
#   loadtest/two_models.sh --out DIR [--seeds 4,5,6] [--rate R] [--duration S] [--warmup S] [--workload W]
# Writes DIR/seed-S-{shared,separate}-{qwen,llama}.json, logs, and DIR/summary.md.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

out=
seeds=4,5,6
rate=4
duration=60
warmup=10
workload=chat
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=${2:?}; shift ;;
    --seeds) seeds=${2:?}; shift ;;
    --rate) rate=${2:?}; shift ;;
    --duration) duration=${2:?}; shift ;;
    --warmup) warmup=${2:?}; shift ;;
    --workload) workload=${2:?}; shift ;;
    -h | --help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "two_models.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$out" ] || { echo "two_models.sh: --out is required" >&2; exit 2; }
mkdir -p "$out/logs"
out=$(cd "$out" && pwd)
bin=${KVGATE_BIN:-target/release/kvgate}
[ -x "$bin" ] || cargo build --release
./scripts/fetch-models.sh >/dev/null

qwen_tok=$root/models/qwen3
llama_tok=$root/models/llama3
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
    [ "$SECONDS" -lt "$deadline" ] || { echo "two_models.sh: $what not ready; see $out/logs" >&2; exit 1; }
    sleep 0.1
  done
}

start_replicas() { # LOG_TAG -> fills qwen_addrs, llama_addrs
  qwen_addrs=()
  llama_addrs=()
  local i log
  for i in 0 1 2 3 4 5 6 7; do
    log=$out/logs/$1-replica-$i.log
    if [ "$i" -lt 4 ]; then
      "$bin" replica --port 0 --replica-id "qwen-$i" --tokenizer "$qwen_tok" >"$log" 2>&1 &
    else
      "$bin" replica --port 0 --replica-id "llama-$i" --model llama-3.1-8b \
        --tokenizer "$llama_tok" >"$log" 2>&1 &
    fi
    pids+=("$!")
  done
  for i in 0 1 2 3 4 5 6 7; do
    log=$out/logs/$1-replica-$i.log
    wait_for "replica $i" 60 grep -q 'serving .* at http://' "$log"
    local url
    url=$(grep -m1 -o 'at http://[^ ]*' "$log" | cut -c11-)
    wait_for "replica $i" 60 curl -sf --max-time 2 -o /dev/null "http://$url/health"
    if [ "$i" -lt 4 ]; then qwen_addrs+=("$url"); else llama_addrs+=("$url"); fi
  done
}

list() { # ADDR... -> TOML list
  local s
  s=$(printf '"%s", ' "$@")
  echo "[${s%, }]"
}

start_gateway() { # TAG CONFIG_BODY -> sets gw_port
  local tag=$1 port admin
  port=$(free_port)
  admin=$(free_port)
  printf 'hit_signals = "exact"\n[policy]\nkind = "prefix_aware"\n' >"$work/$tag-policy.toml"
  {
    echo "listen = \"127.0.0.1:$port\""
    echo "admin_listen = \"127.0.0.1:$admin\""
    echo "policy_file = \"$work/$tag-policy.toml\""
    echo "$2"
  } >"$work/$tag.toml"
  "$bin" gateway --config "$work/$tag.toml" >"$out/logs/gateway-$tag.log" 2>&1 &
  pids+=("$!")
  wait_for "gateway $tag" 60 curl -sf --max-time 2 -o /dev/null "http://127.0.0.1:$port/ready"
  gw_port=$port
}

bench() { # PORT MODEL TOKENIZER SEED OUT_JSON
  "$bin" bench --target "http://127.0.0.1:$1" --model "$2" --tokenizer "$3" \
    --workload "$workload" --rate "$rate" --duration "$duration" --warmup "$warmup" \
    --seed "$4" --slo-ttft-ms 1000 --slo-itl-ms 50 --no-progress --json-out "$5"
}

IFS=, read -r -a seed_list <<<"$seeds"
for seed in "${seed_list[@]}"; do
  for mode in shared separate; do
    if [ -f "$out/seed-$seed-$mode-llama.json" ]; then
      echo "two_models: seed $seed $mode done already"
      continue
    fi
    echo "two_models: seed $seed, $mode"
    start_replicas "seed-$seed-$mode"
    all=$(list "${qwen_addrs[@]}" "${llama_addrs[@]}")
    if [ "$mode" = shared ]; then
      start_gateway "seed-$seed-shared" "replicas = $all
[[models]]
name = \"Qwen3-8B\"
tokenizer_dir = \"$qwen_tok\"
replicas = $(list "${qwen_addrs[@]}")
[[models]]
name = \"Llama-3.1-8B-Instruct\"
tokenizer_dir = \"$llama_tok\"
replicas = $(list "${llama_addrs[@]}")"
      qwen_port=$gw_port
      llama_port=$gw_port
    else
      start_gateway "seed-$seed-qwen" "replicas = $(list "${qwen_addrs[@]}")
[model]
name = \"Qwen3-8B\"
tokenizer_dir = \"$qwen_tok\""
      qwen_port=$gw_port
      start_gateway "seed-$seed-llama" "replicas = $(list "${llama_addrs[@]}")
[model]
name = \"Llama-3.1-8B-Instruct\"
tokenizer_dir = \"$llama_tok\""
      llama_port=$gw_port
    fi
    bench "$qwen_port" Qwen3-8B "$qwen_tok" "$seed" "$out/seed-$seed-$mode-qwen.json" \
      >"$out/logs/bench-$seed-$mode-qwen.log" 2>&1 &
    b1=$!
    bench "$llama_port" Llama-3.1-8B-Instruct "$llama_tok" "$seed" "$out/seed-$seed-$mode-llama.json" \
      >"$out/logs/bench-$seed-$mode-llama.log" 2>&1 &
    b2=$!
    wait "$b1" || { echo "two_models.sh: bench failed, see $out/logs" >&2; exit 1; }
    wait "$b2" || { echo "two_models.sh: bench failed, see $out/logs" >&2; exit 1; }
    stop_all
  done
done

python3 - "$out" "${seed_list[@]}" <<'PY' | tee "$out/summary.md"
import json, statistics, sys

out, seeds = sys.argv[1], sys.argv[2:]


def find(v, key):
    """The first value under `key` anywhere in a bench JSON report."""
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


def cell(vals):
    m = statistics.median(vals)
    return f"{m:.4f} [{min(vals):.4f}–{max(vals):.4f}]"


print("| model | metric | one gateway, two models | one gateway per model | shared − separate per seed |")
print("|---|---|---:|---:|---:|")
for tag, name in [("qwen", "Qwen3-8B"), ("llama", "Llama-3.1-8B-Instruct")]:
    for metric, key, sub in [
        ("prefix hit ratio", "prefix_hit_ratio", None),
        ("TTFT p50 s", "ttft_s", "p50"),
        ("TTFT p95 s", "ttft_s", "p95"),
        ("answered requests", "ok", None),
    ]:
        got = {}
        for mode in ["shared", "separate"]:
            vals = []
            for s in seeds:
                r = json.load(open(f"{out}/seed-{s}-{mode}-{tag}.json"))
                v = find(r, key)
                if sub is not None:
                    v = v[sub]
                vals.append(float(v))
            got[mode] = vals
        diffs = [a - b for a, b in zip(got["shared"], got["separate"])]
        print(f"| {name} | {metric} | {cell(got['shared'])} | {cell(got['separate'])} | "
              + ", ".join(f"{d:+.4f}" for d in diffs) + " |")
PY

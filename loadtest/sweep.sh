#!/usr/bin/env bash
# A comparison sweep with fresh processes for every run: for each seed and each rate, one
# `loadtest/compare.sh` invocation (new replicas, new gateways and peers, so no router keeps
# what it learnt from the previous run), then one summary over seeds: median and range per
# rate and target.
#   loadtest/sweep.sh --out DIR --rates 4.5,9,13.5,18 --seeds 1,2,3 [--base TARGET] [compare.sh / bench args]
# --base: the target the summary's per-seed ratios divide by (default: the first).
# Env as for compare.sh (KVGATE_POLICY_FILES, KVGATE_REPLICAS, KVGATE_REPLICA_ARGS, ...), except
# that kvgate gateways write full access logs unless KVGATE_ACCESS_LOG=0: the summary reads them
# for where the tail comes from and how well TTFT was predicted.
# Writes DIR/seed-S-rate-R/ (one compare run each) and DIR/summary.md.
set -euo pipefail
cd "$(dirname "$0")/.."

out=
rates=
seeds=1,2,3
base=()
extra=()
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=${2:?}; shift ;;
    --rates) rates=${2:?}; shift ;;
    --seeds) seeds=${2:?}; shift ;;
    --base) base=(--base "${2:?}"); shift ;;
    -h | --help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) extra+=("$1") ;;
  esac
  shift
done
[ -n "$out" ] && [ -n "$rates" ] || { echo "sweep.sh: --out and --rates are required" >&2; exit 2; }
mkdir -p "$out"
export KVGATE_ACCESS_LOG=${KVGATE_ACCESS_LOG:-1}
IFS=, read -r -a rate_list <<<"$rates"
IFS=, read -r -a seed_list <<<"$seeds"
for seed in "${seed_list[@]}"; do
  for rate in "${rate_list[@]}"; do
    dir=$out/seed-$seed-rate-$rate
    if [ -f "$dir/report.json" ]; then
      echo "sweep: $dir done already"
      continue
    fi
    echo "sweep: seed $seed, rate $rate"
    loadtest/compare.sh --out "$dir" --rates "$rate" --seed "$seed" "${extra[@]}" >"$out/seed-$seed-rate-$rate.log" 2>&1 ||
      { echo "sweep: run failed, see $out/seed-$seed-rate-$rate.log" >&2; exit 1; }
    grep '^\[' "$out/seed-$seed-rate-$rate.log" || true
  done
done
python3 loadtest/summarize.py "$out" "${base[@]}" | tee "$out/summary.md"

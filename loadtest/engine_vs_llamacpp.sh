#!/usr/bin/env bash
# The cpu backend against llama.cpp on the same GGUF file with the same threads, alternating
# (kvgate, llama.cpp) ROUNDS times so both see the same machine state; one JSON line per run.
#   loadtest/engine_vs_llamacpp.sh [ROUNDS] [THREADS]
# Needs the release example (cargo build --release -p replica --examples) and llama-cpp-python
# (scripts/llamacpp-reference.py builds it into .venv-llamacpp once).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
threads=${2:-2}
model=models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
ex=target/release/examples/cpu_throughput
[ -x "$ex" ] || cargo build --release -p replica --examples
[ -x .venv-llamacpp/bin/python ] || python3 scripts/llamacpp-reference.py
for r in $(seq 1 "$rounds"); do
  echo "{\"round\": $r, \"engine\": \"kvgate\", \"result\": $("$ex" "$model" "$threads")}"
  res=$(KVGATE_IN_VENV=1 .venv-llamacpp/bin/python scripts/llamacpp-reference.py --bench-only 2>/dev/null | tail -1)
  echo "{\"round\": $r, \"engine\": \"llama.cpp\", \"result\": $res}"
done

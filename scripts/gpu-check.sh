#!/usr/bin/env bash
# The cuda backend's check on an NVIDIA GPU, in one run:
# (About half a minute on an H200 once built; building here first takes several minutes.)
#   1. every kernel compiles with NVRTC for sm_80, sm_89 and sm_90;
#   2. the GPU tests: logits against the cpu backend for 10 prompts, greedy tokens for 32 steps,
#      prefix reuse on the GPU, a batch of 64 mixed prefill/decode sequences, top-p sampling,
#      and SmolLM2 (models/smollm2, when here) on both backends: logits and 64 greedy tokens;
#   3. the benchmarks (replica/examples/cuda_bench.rs): decode tokens/s at batch 1, 16, 64 and 256,
#      the paged-attention kernel's bandwidth against a device-to-device copy, and the sim
#      roofline's predicted step times against the measured ones. The model is
#      $KVGATE_BENCH_MODEL's shape (default llama-3.1-8b: ~16 GB of f16 weights plus a 40 GB KV
#      cache, so a GPU of 64 GB or more; on a smaller GPU this step is skipped unless
#      $KVGATE_BENCH_MODEL names a smaller model's Hugging Face config.json), compared with the
#      roofline of $KVGATE_GPU_PROFILE (default: h200, h100, a100 or l4 from the device's name);
#   4. `kvgate up --backend cuda` serving a chat completion through the gateway: SmolLM2 when
#      models/smollm2 is here, else a synthetic model with models/qwen3's tokenizer.
# Run scripts/fetch-models.sh first for the SmolLM2 checks (without models/smollm2 they are
# skipped and step 4 serves a synthetic model).
# Missing a GPU, NVRTC or cuBLAS is a failure here (KVGATE_REQUIRE_GPU, KVGATE_REQUIRE_NVRTC).
# NVRTC and cuBLAS are looked for in the CUDA toolkit and in python3's `nvidia-*` wheels.
#
#   scripts/gpu-check.sh                 build with cargo, then check
#   scripts/gpu-check.sh --pack DIR      build here (no GPU needed) and put the binaries in DIR
#   scripts/gpu-check.sh --prebuilt DIR  check with binaries packed earlier (a GPU machine
#                                        without a Rust toolchain; run it from a checkout)
# KVGATE_CUDA_FEATURE=cuda12 builds for CUDA 12 (default: cuda, CUDA 13).
# Results go to $OUT when set (else target/gpu-check/): gpu-bench.md and the full log.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=build
bin=""
feature="${KVGATE_CUDA_FEATURE:-cuda}"
case "${1:-}" in
  --pack) mode=pack; bin="${2:?--pack DIR}" ;;
  --prebuilt) mode=prebuilt; bin="${2:?--prebuilt DIR}" ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  "") ;;
  *) echo "usage: $0 [--pack DIR | --prebuilt DIR] (--help: what it does)" >&2; exit 2 ;;
esac

# The test and example executables cargo just built, by name (newest first).
built() {
  cargo "$@" --message-format=json-render-diagnostics \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])'
}

build_into() {
  local dir=$1
  mkdir -p "$dir"
  cargo build --release --locked --no-default-features --features "$feature" --bin kvgate
  cp target/release/kvgate "$dir/"
  built test --release --locked -p kernels --features "$feature" --test cuda_compile --no-run \
    | awk '$1=="cuda_compile"{print $2}' | head -1 | xargs -I{} cp {} "$dir/cuda_compile"
  built test --release --locked -p replica --features "$feature" --test cuda_backend --no-run \
    | awk '$1=="cuda_backend"{print $2}' | head -1 | xargs -I{} cp {} "$dir/cuda_backend"
  cargo build --release --locked -p replica --features "$feature" --example cuda_bench --example synthetic_model
  cp target/release/examples/cuda_bench target/release/examples/synthetic_model "$dir/"
  for f in kvgate cuda_compile cuda_backend cuda_bench synthetic_model; do
    [ -x "$dir/$f" ] || { echo "gpu-check: the build did not produce $f" >&2; exit 1; }
  done
  strip "$dir"/* 2>/dev/null || true
  cp "$0" "$dir/"
  ls -la "$dir"
}

if [ "$mode" = pack ]; then
  build_into "$bin"
  echo "packed; on the GPU machine: scripts/gpu-check.sh --prebuilt $bin"
  exit 0
fi
if [ "$mode" = build ]; then
  bin=target/gpu-check/bin
  build_into "$bin"
fi

out="${OUT:-target/gpu-check}"
mkdir -p "$out"
log="$out/gpu-check.log"
exec > >(tee "$log") 2>&1

# NVRTC and cuBLAS: the toolkit's, or the pip wheels' (nvidia-cuda-nvrtc, nvidia-cublas).
libs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 - <<'PY' 2>/dev/null
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
for r in roots:
    for d in glob.glob(os.path.join(r, "nvidia", "*", "lib")) + glob.glob(os.path.join(r, "nvidia", "*", "*", "lib")):
        # cu13/lib (CUDA 13 wheels), cublas/lib and cuda_nvrtc/lib (CUDA 12 wheels)
        print(d)
PY
) "$HOME/.cache/kvgate/nvrtc/nvidia/cu13/lib"; do
  [ -d "$d" ] && libs="$libs:$d"
done
export LD_LIBRARY_PATH="${libs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVGATE_REQUIRE_GPU=1 KVGATE_REQUIRE_NVRTC=1 RUST_BACKTRACE=1

echo "== device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
status=0
echo "== 1. kernels compile (NVRTC)"
"$bin/cuda_compile" --nocapture || status=1
echo "== 2. GPU tests against the cpu backend"
"$bin/cuda_backend" --nocapture --test-threads=1 || status=1
echo "== 3. benchmarks"
profile="${KVGATE_GPU_PROFILE:-}"
if [ -z "$profile" ]; then
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
  case "$name" in
    *H200*) profile=h200 ;; *H100*) profile=h100 ;; *A100*) profile=a100 ;; *L4*) profile=l4 ;;
    *) profile=h200; echo "unknown GPU '$name': comparing with the h200 roofline profile" ;;
  esac
fi
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 || true)
if [ -z "${KVGATE_BENCH_MODEL:-}" ] && [ -n "$mem_mib" ] && [ "$mem_mib" -lt 64000 ]; then
  echo "skipped: the benchmark's Llama-3.1-8B shape needs about 64 GB and this GPU has $mem_mib MiB;"
  echo "set KVGATE_BENCH_MODEL to a smaller model's Hugging Face config.json to run it"
else
  KVGATE_BENCH_OUT="$out/gpu-bench.md" "$bin/cuda_bench" "$profile" "${KVGATE_BENCH_MODEL:-llama-3.1-8b}" || status=1
fi
echo "== 4. kvgate up --backend cuda"
# The default real model (SmolLM2, models/smollm2) when it is here, else a synthetic model with
# models/qwen3's tokenizer (then the answer is noise, but it went through the whole path).
smol=models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
tok=models/qwen3
args=()
question="Hello!"
served=synthetic
if [ -f "$smol" ]; then
  served=SmolLM2-135M-Instruct.Q4_1
  question="What is the capital of France? Answer in one sentence."
  args=(--model "$smol")
elif [ -f "$tok/tokenizer.json" ]; then
  model=$(mktemp -d)/synthetic
  vocab=$(python3 -c 'import json,sys; t=json.load(open(sys.argv[1])); print(max(t["model"]["vocab"].values())+1+len(t.get("added_tokens",[])))' "$tok/tokenizer.json")
  "$bin/synthetic_model" "$model" "$((vocab + 256))"
  args=(--model "$model" --tokenizer "$tok")
else
  echo "skipped: neither $smol nor $tok/tokenizer.json is here (carry models/)"
  args=(skip)
fi
if [ "${args[0]:-}" != skip ]; then
  upl=$(mktemp)
  RUST_BACKTRACE=0 "$bin/kvgate" up --backend cuda "${args[@]}" --port 0 --admin-port 0 >"$upl" 2>&1 &
  up=$!
  url=""
  for _ in $(seq 1 240); do
    url=$(grep -o 'gateway ready at http://[0-9.:]*' "$upl" | sed 's/gateway ready at //' || true)
    [ -n "$url" ] && break
    kill -0 $up 2>/dev/null || break
    sleep 0.5
  done
  if [ -n "$url" ]; then
    body="{\"model\":\"$served\",\"messages\":[{\"role\":\"user\",\"content\":\"$question\"}],\"max_tokens\":32,\"temperature\":0}"
    if curl -sf "$url/v1/chat/completions" -H 'content-type: application/json' -d "$body" | tee "$out/chat.json"; then
      echo; echo "served through the gateway by a cuda replica"
    else
      echo "the chat completion failed"; status=1
    fi
    curl -sf "$url/metrics" 2>/dev/null | grep -E '^kvgate_(ttft|requests)' | head -8 || true
  else
    echo "kvgate up --backend cuda did not become ready:"; status=1
  fi
  kill $up 2>/dev/null || true
  wait $up 2>/dev/null || true
  tail -20 "$upl"
fi
echo "== gpu-check: $([ $status = 0 ] && echo passed || echo FAILED)"
exit $status

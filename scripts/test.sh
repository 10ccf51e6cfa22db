#!/usr/bin/env bash
# The project's one test command: fetches the default model files (checksummed, idempotent) and
# runs every test in the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/fetch-models.sh
cargo test --workspace --locked

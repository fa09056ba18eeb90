#!/usr/bin/env bash
# From a fresh clone: fetch the model, build nightshift (release), run the sample job, show a few results.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/fetch-models.sh
cargo build --release --locked
out="out/summarise-$(date -u +%Y%m%dT%H%M%SZ)/"
./target/release/nightshift run jobs/summarise.toml --output "$out" --show 3

#!/usr/bin/env bash
# Where a decode step's GPU time goes: `ncu` (kernel durations only, one pass, clocks left alone) over
# `nightshift bench generate` at a few batch sizes, with a per-kernel summary (launches, total and mean time) per run.
# Run on the GPU host after scripts/gpu-check.sh has made the binary and models, or on its own:
#
#   scripts/gpu-profile.sh OUT_DIR [BATCHES]    # BATCHES default "1 256"; NEW new tokens per row (default 17)
#
# The summary's total over `steps` gives the GPU's busy time per step; set beside the bench's forward_ms_per_step
# (the wall time per step) it says whether the step waits on the GPU's kernels or on the host launching them.
set -uo pipefail
OUT=$(mkdir -p "$1" && cd "$1" && pwd); BATCHES=${2:-1 256}
NEW=${NEW:-17}; PROMPT=${PROMPT:-128}; SHAPE=${SHAPE:-llama-3.2-1b}
WORK=${WORK:-/tmp/gpu-profile}; mkdir -p "$WORK"
BIN=${NIGHTSHIFT_BIN:?set NIGHTSHIFT_BIN}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu" >&2; exit 2; }
[ -d "$WORK/$SHAPE" ] || "$BIN" synth-model "$WORK/$SHAPE" --shape "$SHAPE" --dtype bf16 --seed 1 > /dev/null
for b in $BATCHES; do
  timeout "${LIMIT:-150}" "$NCU" --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
    "$BIN" bench generate --model "$WORK/$SHAPE" --device cuda:0 --workload fixed --rows "$b" --max-seqs "$b" \
    --min-prompt "$PROMPT" --max-prompt "$PROMPT" --min-new "$NEW" --max-new "$NEW" \
    --max-batch-tokens $(( b * (PROMPT + 16) )) --kv-cache-memory 8GiB --warmup-rows 0 --json > "$OUT/ncu-$b.txt" 2>&1
  echo "ncu batch $b rc=$?" >&2
done

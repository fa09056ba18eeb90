#!/usr/bin/env bash
# The standing GPU check: one script, under 9 minutes on an H200 (BUDGET seconds, 510 by default: every step's time
# limit is cut to what is left, and a step with under 15 s left is skipped), that writes its table and logs to OUT_DIR.
#
#   scripts/gpu-check.sh OUT_DIR
#
cp "$WORK/$SHAPE/config.json" "$OUT/model-config.json" 2>/dev/null

# (0) smoke: the tiny model's generation on the device, first; when it fails (the device does not open, a library
#     is missing) the check stops at once with exit 3, leaving time for a fixed binary in the same device session;
# (a) parity: `nightshift bench parity`, the GPU's forward pass (the paged path) against the CPU path in f32 on the
#     same random-weight models, and batched against one sequence at a time, within the tolerances it states;
# (b) `nightshift bench generate`, fixed-length workload (PROMPT prompt tokens, NEW new tokens per row, end of
#     sequence ignored), at batch 1, 16, 64 and 256 on a random-weight model of Llama-3.2-1B's shape, bf16;
# (c) the peer: Hugging Face transformers `generate` on the same safetensors, the same lengths and batches
#     (scripts/gpu-peer.py generate);
# (d) the roofline: weight bytes per decode step over the measured copy bandwidth, and 2 x parameters x tokens
#     over the measured bf16 matmul rate (scripts/gpu-peer.py roofline);
# (e) long prompts: LONG_PROMPT (2,048) prompt + LONG_NEW (128) new tokens at batch LONG_BATCH (64), and
#     XL_PROMPT (8,064) + 32 new at batch XL_BATCH (8): memory bounded by tiles, no out-of-memory;
# (f) when a kernel attends (the reports say `"attention": "paged-decode"`, nightshift's CUDA decode kernel, or
#     `"paged-flash"` with a `--flash-attn` binary), batch 1, the last batch and the long-prompt workload once more on
#     the tiled path (NIGHTSHIFT_ATTENTION=paged-tiled), both attention paths side by side;
# (g) FAMILY_SHAPES (Gemma 3, Gemma 2, Phi-3, Mixtral, Qwen3-MoE; empty: none): parity in f32 and bf16 as in (a),
#     peaked weights; the windowed shapes with a window of FAMILY_WINDOW (40) positions, so that the prompts and
#     decodes cross it, and Gemma 2 and Phi-3 in FAMILY_LAYERS (4) layers (soft-capping, heads of 96);
# and the GGUF path (candle's CUDA quantized kernels): the same weights as GGUF_TYPE GGUF files, parity on the
# small shape and throughput at batch 1 and 64 on the large one.
# Then OUT_DIR/table.md (and the same on stdout, last): the figures side by side, ratios to the peer and to the
# roofline, the targets (batch 1 decode within 2x of the bandwidth roofline; batch 256 output tokens/s at least
# 5x transformers').
#
# The binary: $NIGHTSHIFT_BIN, else target/cuda/nightshift-cuda, else target/cuda/nightshift-cuda.xz unpacked
# (scripts/build-cuda.sh builds both). The CUDA libraries come from the driver's folder and the PyTorch venv's
# CUDA 13 wheels (../shared/reference/cuda-build.md). A dry run without a GPU checks the script itself:
#   DEVICE=cpu SHAPE=tiny BATCHES=1,4 PARITY_SHAPES=tiny LONG_PROMPT=600 LONG_BATCH=4 XL_PROMPT=900 XL_BATCH=2 \
#     NIGHTSHIFT_BIN=target/release/nightshift NIGHTSHIFT_ATTENTION=paged-tiled scripts/gpu-check.sh /tmp/gpu-check
# (the peer and roofline steps are then skipped when python3 has no CUDA).
set -uo pipefail

say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 2; }

[ $# -eq 1 ] || die "usage: scripts/gpu-check.sh OUT_DIR"
OUT=$(mkdir -p "$1" && cd "$1" && pwd) || die "cannot create $1"
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEVICE=${DEVICE:-cuda:0}
SHAPE=${SHAPE:-llama-3.2-1b}
PARITY_SHAPES=${PARITY_SHAPES:-smollm2-135m llama-3.2-1b}
FAMILY_SHAPES=${FAMILY_SHAPES-gemma-3-1b gemma-2-2b phi-3-mini mixtral-reduced qwen3-moe-reduced}
FAMILY_WINDOW=${FAMILY_WINDOW:-40}
FAMILY_LAYERS=${FAMILY_LAYERS:-4}
BATCHES=${BATCHES:-1,16,64,256}
GGUF_TYPE=${GGUF_TYPE:-q4_1}
GGUF_BATCHES=${GGUF_BATCHES:-1,64}
PROMPT=${PROMPT:-128}
NEW=${NEW:-128}
LONG_PROMPT=${LONG_PROMPT:-2048}
LONG_NEW=${LONG_NEW:-128}
LONG_BATCH=${LONG_BATCH:-64}
XL_PROMPT=${XL_PROMPT:-8064}
XL_BATCH=${XL_BATCH:-8}
BUDGET=${BUDGET:-510}
WORK=${WORK:-$(mktemp -d /tmp/gpu-check.XXXXXX)}
mkdir -p "$WORK"
STARTED=$(date +%s)

# The binary.
BIN=${NIGHTSHIFT_BIN:-}
if [ -z "$BIN" ]; then
  if [ -x "$REPO/target/cuda/nightshift-cuda" ]; then BIN="$REPO/target/cuda/nightshift-cuda"
  elif [ -f "$REPO/target/cuda/nightshift-cuda.xz" ]; then
    xz -dc "$REPO/target/cuda/nightshift-cuda.xz" > "$WORK/nightshift" && chmod +x "$WORK/nightshift" && BIN="$WORK/nightshift"
  else die "no binary: build one with scripts/build-cuda.sh, or set NIGHTSHIFT_BIN"; fi
fi
[ -x "$BIN" ] || die "$BIN is not executable"

# The CUDA libraries: the driver's libcuda, and cuBLAS, cuRAND and the runtime from the PyTorch venv's wheels.
if [ "${DEVICE%%:*}" = cuda ]; then
  CUBLAS=$(find /opt/torch/.venv -name libcublas.so.13 2>/dev/null | head -1)
  if [ -z "$CUBLAS" ]; then
    SITE=$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null)
    [ -n "$SITE" ] && CUBLAS=$(find "$SITE" -name libcublas.so.13 2>/dev/null | head -1)
  fi
  [ -n "$CUBLAS" ] || say "libcublas.so.13 not found: the binary will not load"
  export LD_LIBRARY_PATH="/usr/local/nvidia/lib64${CUBLAS:+:$(dirname "$CUBLAS")}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export RUST_LOG=${RUST_LOG:-warn}

{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "binary: $BIN"
  echo "device: $DEVICE; bench shape: $SHAPE; batches: $BATCHES; prompt $PROMPT, new $NEW"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 || echo "nvidia-smi: not available"
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
} > "$OUT/env.txt"
cat "$OUT/env.txt" >&2

# step NAME SECONDS COMMAND...: runs with a time limit (cut to what is left of BUDGET, keeping 10 s for the table),
# its output to OUT/NAME.log; records its exit status (`skipped` with under 15 s left). Returns the command's status.
step() {
  local name=$1 limit=$2; shift 2
  local left=$(( STARTED + BUDGET - 10 - $(date +%s) ))
  if [ "$left" -lt 15 ]; then
    say "$name skipped: ${left}s of the budget left"
    echo "$name rc=skipped seconds=0" >> "$OUT/steps.txt"
    return 1
  fi
  [ "$limit" -le "$left" ] || limit=$left
  say "$name (limit ${limit}s): $*"
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc seconds=$(( $(date +%s) - t0 ))" >> "$OUT/steps.txt"
  [ $rc -eq 0 ] || { say "$name failed (rc $rc); its log:"; tail -20 "$OUT/$name.log" >&2; }
  return $rc
}

# generate NAME ROWS PROMPT NEW [ENV=VALUE...]: `nightshift bench generate`, fixed-length rows, all ready at the start.
generate() {
  local name=$1 b=$2 prompt=$3 new=$4; shift 4
  step "$name" 150 env "$@" "$BIN" bench generate --model "$WORK/$SHAPE" --device "$DEVICE" --workload fixed \
    --rows "$b" --max-seqs "$b" --min-prompt "$prompt" --max-prompt "$prompt" --min-new "$new" --max-new "$new" \
    --max-batch-tokens $(( b * (prompt + 16) > 65536 ? 65536 : b * (prompt + 16) )) --kv-cache-memory 8GiB \
    --warmup-rows 2 --json
}

# (0) smoke: a tiny model on the device. If this fails nothing else can work: stop now, with the reason.
step synth-smoke 60 "$BIN" synth-model "$WORK/smoke" --shape tiny --dtype bf16 --seed 1
if ! step smoke 90 "$BIN" bench generate --model "$WORK/smoke" --device "$DEVICE" --workload fixed --rows 4 --max-seqs 4 \
    --min-prompt 40 --max-prompt 40 --min-new 8 --max-new 8 --json; then
  { echo "## GPU check"; echo; echo "The smoke step failed: the device did not run the tiny model. Its log:"; echo; echo '```';
    tail -40 "$OUT/smoke.log"; echo '```'; } > "$OUT/table.md"
  cat "$OUT/steps.txt" >&2
  cat "$OUT/table.md"
  exit 3
fi

# Models (bf16 safetensors, what the peer loads too), peaked: Hugging Face's initialisation gives near-flat logits whose
# argmax flips with any rounding (bf16 parity on Llama-3.2-1B failed for that alone, BENCHMARKS.md 2026-12-04).
for shape in $SHAPE $PARITY_SHAPES; do
  [ -d "$WORK/$shape" ] || step "synth-$shape" 150 "$BIN" synth-model "$WORK/$shape" --shape "$shape" --dtype bf16 --seed 1 --init peaked --gguf "$GGUF_TYPE"
done

cp "$WORK/$SHAPE/config.json" "$OUT/model-config.json" 2>/dev/null

# (a) parity: f32 on the device (the kernels' own error) and bf16 (what runs by default), on each parity shape.
for shape in $PARITY_SHAPES; do
  lengths=7,23,64,150; steps=16
  [ "$shape" = llama-3.2-1b ] && { lengths=7,23,64; steps=8; }
  for dtype in f32 bf16; do
    step "parity-$shape-$dtype" 150 "$BIN" bench parity --model "$WORK/$shape" --device "$DEVICE" --dtype "$dtype" \
      --prompt-lengths "$lengths" --steps "$steps" --json
  done
done

# (b) nightshift: every row ready at the start, batch = rows = max_seqs, the whole batch prefilled at once.
for b in ${BATCHES//,/ }; do
  generate "bench-$b" "$b" "$PROMPT" "$NEW"
done

# (e) long prompts, and (f) the tiled path beside flash-attention when the binary has it.
generate "long-$LONG_BATCH" "$LONG_BATCH" "$LONG_PROMPT" "$LONG_NEW"
generate "xl-$XL_BATCH" "$XL_BATCH" "$XL_PROMPT" 32
if grep -Eq '"attention": ?"paged-(flash|decode)"' "$OUT/long-$LONG_BATCH.log" 2>/dev/null; then
  first=${BATCHES%%,*}
  last=${BATCHES##*,}
  generate "tiled-$first" "$first" "$PROMPT" "$NEW" NIGHTSHIFT_ATTENTION=paged-tiled
  generate "tiled-$last" "$last" "$PROMPT" "$NEW" NIGHTSHIFT_ATTENTION=paged-tiled
  generate "long-$LONG_BATCH-tiled" "$LONG_BATCH" "$LONG_PROMPT" "$LONG_NEW" NIGHTSHIFT_ATTENTION=paged-tiled
fi

# (c) and (d): PyTorch on the same GPU.
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  step roofline 90 python3 "$REPO/scripts/gpu-peer.py" roofline --out "$OUT/roofline.json"
  step peer 240 python3 "$REPO/scripts/gpu-peer.py" generate --model "$WORK/$SHAPE" --batches "$BATCHES" \
    --prompt-tokens "$PROMPT" --new-tokens "$NEW" --out "$OUT/peer.json"
else
  say "python3 has no CUDA-capable torch: the peer and the roofline are skipped"
  echo "roofline rc=skipped" >> "$OUT/steps.txt"
  echo "peer rc=skipped" >> "$OUT/steps.txt"
fi

# (g) the other families' layer loops (Gemma 3's norms and windows, the mixtures' routing, gather and scatter-add
#     on the device), f32 only: the kernels' own error, where a wrong formula shows at once.
for shape in $FAMILY_SHAPES; do
  extra=()
  case "$shape" in gemma-3-1b|gemma-2-2b|phi-3-mini) extra+=(--window "$FAMILY_WINDOW") ;; esac
  case "$shape" in gemma-2-2b|phi-3-mini) extra+=(--layers "$FAMILY_LAYERS") ;; esac
  [ -d "$WORK/$shape" ] || step "synth-$shape" 120 "$BIN" synth-model "$WORK/$shape" --shape "$shape" --dtype bf16 --seed 1 --init peaked "${extra[@]}"
  for dtype in f32 bf16; do
    step "parity-$shape-$dtype" 120 "$BIN" bench parity --model "$WORK/$shape" --device "$DEVICE" --dtype "$dtype" \
      --prompt-lengths 7,23,64 --steps 8 --json
  done
done

# The GGUF path last: the targets do not depend on it.
first_parity=${PARITY_SHAPES%% *}
step "parity-$first_parity-$GGUF_TYPE" 150 "$BIN" bench parity --model "$WORK/$first_parity/model-$GGUF_TYPE.gguf" \
  --device "$DEVICE" --prompt-lengths 7,23,64,150 --steps 16 --json
for b in ${GGUF_BATCHES//,/ }; do
  step "gguf-bench-$b" 150 "$BIN" bench generate --model "$WORK/$SHAPE/model-$GGUF_TYPE.gguf" --device "$DEVICE" \
    --workload fixed --rows "$b" --max-seqs "$b" --min-prompt "$PROMPT" --max-prompt "$PROMPT" --min-new "$NEW" \
    --max-new "$NEW" --max-batch-tokens $(( b * (PROMPT + 16) > 65536 ? 65536 : b * (PROMPT + 16) )) \
    --kv-cache-memory 8GiB --warmup-rows 2 --json
done

python3 "$REPO/scripts/gpu-table.py" "$OUT" > "$OUT/table.md" 2> "$OUT/table.log" || say "the table failed: $(cat "$OUT/table.log")"
echo "total seconds: $(( $(date +%s) - STARTED ))" >> "$OUT/steps.txt"
cat "$OUT/steps.txt" >&2
cat "$OUT/table.md"

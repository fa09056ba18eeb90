#!/usr/bin/env bash
# Builds a release `nightshift` with the `cuda` feature on a Linux x86_64 machine that has no GPU and no CUDA
# toolkit, for an NVIDIA H100/H200 host (compute capability 9.0) whose driver supports CUDA 13.0 (driver 580+).
#
#   scripts/build-cuda.sh               # from anywhere; 12-25 minutes on 2 cores, about a minute when nothing changed
#   scripts/build-cuda.sh --flash-attn  # also the `flash-attn` feature: candle-flash-attn's kernels for the paged
#                                       # path (see BENCHMARKS.md for the first build's time; cached afterwards)
#
# Needs: cargo (rustup), gcc/g++ (nvcc's host compiler), python3 with pip (the toolkit comes from PyPI wheels),
# readelf, strip, and xz or zstd. Writes target/cuda/nightshift-cuda.xz (or .zst), stripped and compressed.
#
# Knobs (environment):
#   NIGHTSHIFT_CUDA_WORK  toolkit cache, outside the repository, reused by later runs
#                         (default $HOME/.cache/nightshift-cuda; about 1.2 GB)
#   JOBS                  cargo jobs (default 2)
#   CUDAFORGE_THREADS     parallel nvcc processes inside candle-kernels' build script (default: half the cores)
#   COMPRESS              xz or zstd (default: xz when installed; it is on more hosts than zstd)
#   CUTLASS_GIT           with --flash-attn: where to clone CUTLASS from (candle-flash-attn's build pins a commit
#                         and clones it from GitHub; a local mirror or bare repository holding that commit works
#                         when GitHub is out of reach: only include/ and tools/util/include/ are checked out)
#
# With --flash-attn the kernels' build is cached in $NIGHTSHIFT_CUDA_WORK/flash-attn (CANDLE_FLASH_ATTN_BUILD_DIR)
# and CUTLASS in $NIGHTSHIFT_CUDA_WORK/cudaforge (CUDAFORGE_HOME): a rebuild, even after `cargo clean`, reuses both.
#
# On the GPU host: the binary links libcuda.so.1 (from the driver) and the CUDA 13 runtime libraries libcudart.so.13,
# libcublas.so.13 (which loads libcublasLt.so.13) and libcurand.so.10, which the nvidia-*-cu13 wheels of a PyTorch
# venv provide. It has no RPATH, so point LD_LIBRARY_PATH at both:
#
#   xz -dk nightshift-cuda.xz   # or: zstd -d nightshift-cuda.zst
#   mv nightshift-cuda nightshift && chmod +x nightshift
#   export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:$(dirname "$(find /opt/torch/.venv -name libcublas.so.13 | head -1)")
#   ./nightshift run job.toml   # runtime.device = "cuda" (or "auto": cuda:0 when it opens, else the CPU)
#
# (/usr/local/nvidia/lib64 is where that host keeps libcuda.so.1: `find / -name libcuda.so.1` finds it elsewhere.)
# Without those libraries the binary does not start at all: the loader fails before main.
#
# How it works, briefly (details: the team's notes on building candle 0.11.1 with CUDA):
# 1. CUDA 13.0.x tools and libraries from PyPI wheels, pinned exactly: nvcc 13.0 emits PTX ISA 9.0, which a CUDA
#    13.0 driver loads; a newer nvcc emits PTX that driver rejects.
# 2. A CUDA_HOME-like folder over the wheels, adding the unversioned .so names the linker needs (-lcublas).
# 3. A link-time stub libcuda.so (soname libcuda.so.1): the driver library is in no wheel. Every function returns
#    34 (CUDA_ERROR_STUB_LIBRARY). It only satisfies the linker and is never shipped; the host's driver provides the
#    real one.
# 4. cargo build with CUDA_COMPUTE_CAP=90 (candle builds sm_90a kernels: they run on compute capability 9.0 only),
#    cudarc's bindings for CUDA 13.0, and target-cpu=x86-64-v3 for the host code (every GPU host has AVX2; the
#    CPU kernels choose their instructions at run time either way).
set -euo pipefail

say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${NIGHTSHIFT_CUDA_WORK:-$HOME/.cache/nightshift-cuda}
JOBS=${JOBS:-2}
TARGET_DIR="$REPO/target/cuda"
FEATURES=cuda
case "${1:-}" in
  "") ;;
  --flash-attn) FEATURES=flash-attn ;;
  *) die "usage: scripts/build-cuda.sh [--flash-attn]" ;;
esac

case "$WORK/" in
  "$REPO"/*) die "NIGHTSHIFT_CUDA_WORK ($WORK) must be outside the repository" ;;
esac

for tool in cargo python3 gcc g++ readelf strip; do
  command -v "$tool" >/dev/null || die "\`$tool\` is not installed"
done
python3 -m pip --version >/dev/null 2>&1 || die "python3 has no pip (needed to fetch the CUDA toolkit wheels)"
if [ -z "${COMPRESS:-}" ]; then
  if command -v xz >/dev/null; then COMPRESS=xz; elif command -v zstd >/dev/null; then COMPRESS=zstd;
  else die "neither xz nor zstd is installed"; fi
fi
case "$COMPRESS" in
  xz) EXT=xz ;;
  zstd) EXT=zst ;;
  *) die "COMPRESS must be xz or zstd, got \`$COMPRESS\`" ;;
esac
command -v "$COMPRESS" >/dev/null || die "\`$COMPRESS\` is not installed"

# ---- 1. the CUDA 13.0 toolkit, from PyPI wheels ----------------------------------------------------------------
# Reinstalled only when this list changes. All CUDA 13 wheels unpack into one prefix, nvidia/cu13/{bin,include,
# lib,nvvm}, and bin/nvcc.profile finds the rest relative to itself.
PINS="nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96
nvidia-cuda-cccl==13.0.85 nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 nvidia-cuda-nvrtc==13.0.88"
TOOLKIT="$WORK/toolkit"
CU13="$TOOLKIT/nvidia/cu13"
mkdir -p "$WORK"
if [ -x "$CU13/bin/nvcc" ] && [ "$(cat "$TOOLKIT/.pins" 2>/dev/null)" = "$PINS" ]; then
  say "CUDA toolkit: reusing $TOOLKIT"
else
  say "CUDA toolkit: installing the pinned wheels into $TOOLKIT (about 1.2 GB)"
  rm -rf "$TOOLKIT" "$TOOLKIT.partial"
  # shellcheck disable=SC2086 # one argument per pin
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --target "$TOOLKIT.partial" $PINS
  printf '%s' "$PINS" > "$TOOLKIT.partial/.pins"
  mv "$TOOLKIT.partial" "$TOOLKIT"
fi
[ -x "$CU13/bin/nvcc" ] || die "the wheels did not provide $CU13/bin/nvcc"

# ---- 2. a CUDA_HOME over the wheels ----------------------------------------------------------------------------
export CUDA_HOME="$WORK/cuda-home"
rm -rf "$CUDA_HOME/lib64"
mkdir -p "$CUDA_HOME/lib64/stubs"
for dir in bin include nvvm; do ln -sfn "$CU13/$dir" "$CUDA_HOME/$dir"; done
for lib in "$CU13"/lib/*.so.* "$CU13"/lib/*.a; do ln -s "$lib" "$CUDA_HOME/lib64/"; done
for name in cudart cublas cublasLt nvrtc; do ln -s "lib$name.so.13" "$CUDA_HOME/lib64/lib$name.so"; done
ln -s libcurand.so.10 "$CUDA_HOME/lib64/libcurand.so"
for lib in cudart cublas cublasLt nvrtc curand; do
  [ -e "$CUDA_HOME/lib64/lib$lib.so" ] || die "lib$lib.so points at nothing: the wheels' layout changed"
done
export PATH="$CUDA_HOME/bin:$PATH"
export NVCC="$CUDA_HOME/bin/nvcc"
nvcc --version | grep -q 'release 13\.0' || die "nvcc is not 13.0: $(nvcc --version | tail -1)"
say "nvcc: $(nvcc --version | tail -1)"

# ---- 3. the libcuda.so link stub -------------------------------------------------------------------------------
# Generated from the driver functions that the locked cudarc version declares in its `extern "C"` blocks (the
# indented `fn cu...(` lines; the `pub unsafe fn` wrappers around them include helpers that are not driver symbols).
# cudarc's build script already adds $CUDA_HOME/lib64/stubs to the link search path.
cd "$REPO"
say "cargo fetch"
cargo fetch --locked >/dev/null
CUDARC_SRC=$(cargo metadata --locked --format-version 1 --features "$FEATURES" | python3 -c '
import json, os, sys
dirs = [os.path.dirname(p["manifest_path"]) for p in json.load(sys.stdin)["packages"] if p["name"] == "cudarc"]
if len(dirs) != 1: sys.exit(f"expected one cudarc in the dependency graph, found {len(dirs)}")
print(dirs[0])')
DRIVER_SYS="$CUDARC_SRC/src/driver/sys/mod.rs"
[ -f "$DRIVER_SYS" ] || die "$DRIVER_SYS is missing"
STUB_C="$WORK/libcuda-stub.c"
{ grep -oE '^ +fn cu[A-Za-z0-9_]+\(' "$DRIVER_SYS" || true; } | sed -E 's/^ +fn (cu[A-Za-z0-9_]+)\(/\1/' \
  | sort -u | awk 'BEGIN { print "/* Link-time stand-in for the driver library: never ship it. 34 = CUDA_ERROR_STUB_LIBRARY. */" }
                         { print "int " $1 "(void) { return 34; }" }' > "$STUB_C.new"
FUNCTIONS=$(grep -c '^int cu' "$STUB_C.new" || true)
[ "$FUNCTIONS" -gt 100 ] || die "found only $FUNCTIONS cu* functions in $DRIVER_SYS: its layout changed"
mv "$STUB_C.new" "$STUB_C"
gcc -shared -fPIC -O1 -Wl,-soname,libcuda.so.1 -o "$CUDA_HOME/lib64/stubs/libcuda.so" "$STUB_C"
say "libcuda.so stub: $FUNCTIONS functions from $(basename "$CUDARC_SRC")"

# ---- 4. flash-attention's inputs (--flash-attn) -----------------------------------------------------------------
# candle-flash-attn's build script (through cudaforge) compiles 53 kernel files against CUTLASS at a pinned commit,
# which it clones into $CUDAFORGE_HOME/git/checkouts/cutlass-<commit prefix> unless a checkout of exactly that
# commit is there. The pin is read from the locked crate's build.rs.
if [ "$FEATURES" = flash-attn ]; then
  FA_SRC=$(cargo metadata --locked --format-version 1 --features "$FEATURES" | python3 -c '
import json, os, sys
dirs = [os.path.dirname(p["manifest_path"]) for p in json.load(sys.stdin)["packages"] if p["name"] == "candle-flash-attn"]
if len(dirs) != 1: sys.exit(f"expected one candle-flash-attn in the dependency graph, found {len(dirs)}")
print(dirs[0])')
  CUTLASS_COMMIT=$(sed -nE 's/^const CUTLASS_COMMIT: &str = "([0-9a-f]{40})";/\1/p' "$FA_SRC/build.rs")
  [ -n "$CUTLASS_COMMIT" ] || die "no CUTLASS_COMMIT in $FA_SRC/build.rs: its layout changed"
  export CUDAFORGE_HOME="$WORK/cudaforge"
  export CANDLE_FLASH_ATTN_BUILD_DIR="$WORK/flash-attn"
  mkdir -p "$CANDLE_FLASH_ATTN_BUILD_DIR" "$CUDAFORGE_HOME/git/checkouts"
  CHECKOUT="$CUDAFORGE_HOME/git/checkouts/cutlass-${CUTLASS_COMMIT:0:16}"
  if [ "$(git -C "$CHECKOUT" rev-parse HEAD 2>/dev/null)" != "$CUTLASS_COMMIT" ] || [ ! -d "$CHECKOUT/include" ]; then
    say "CUTLASS $CUTLASS_COMMIT from ${CUTLASS_GIT:=https://github.com/NVIDIA/cutlass.git}"
    rm -rf "$CHECKOUT"
    git clone --quiet --no-checkout "$CUTLASS_GIT" "$CHECKOUT"
    # Only the headers the kernels include, as cudaforge's own fetch takes them: a mirror that lacks the large
    # media files (some do) still serves a complete build.
    git -C "$CHECKOUT" sparse-checkout set include tools/util/include
    git -C "$CHECKOUT" -c advice.detachedHead=false checkout --quiet --detach "$CUTLASS_COMMIT"
  fi
  say "CUTLASS: $CHECKOUT; kernels cached in $CANDLE_FLASH_ATTN_BUILD_DIR"
fi

# ---- 5. build ----------------------------------------------------------------------------------------------------
export CUDA_COMPUTE_CAP=90
export CUDARC_CUDA_VERSION=13000
export RUSTFLAGS="-C target-cpu=x86-64-v3"
say "cargo build --release --locked --features $FEATURES --target-dir target/cuda -j$JOBS (RUSTFLAGS=$RUSTFLAGS)"
start=$(date +%s)
# CPU time too: the wall time depends on what else the machine is doing, the CPU seconds much less.
/usr/bin/time -f '%U %S' -o "$TARGET_DIR.cpu" cargo build --release --locked --features "$FEATURES" --target-dir "$TARGET_DIR" -j"$JOBS"
seconds=$(( $(date +%s) - start ))
cpu=$(awk '{ printf "%d", $1 + $2 }' "$TARGET_DIR.cpu")
say "build time: $((seconds / 60)) min $((seconds % 60)) s wall, $((cpu / 60)) min of CPU time (features: $FEATURES)"

# ---- 6. strip, compress, report --------------------------------------------------------------------------------
BIN="$TARGET_DIR/release/nightshift"
STRIPPED="$TARGET_DIR/nightshift-cuda"
OUT="$STRIPPED.$EXT"
strip -o "$STRIPPED" "$BIN"
case "$COMPRESS" in
  xz) xz -9 -T0 -c "$STRIPPED" > "$OUT.partial" ;;
  zstd) zstd -19 -T0 -q -c "$STRIPPED" > "$OUT.partial" ;;
esac
mv "$OUT.partial" "$OUT"

size() { local bytes; bytes=$(stat -c %s "$1"); printf '%d bytes (%s MiB)' "$bytes" "$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')"; }
printf '\nbinary:     %s\nstripped:   %s\ncompressed: %s\n' "$(size "$BIN")" "$(size "$STRIPPED")" "$(size "$OUT")"
[ "$(stat -c %s "$OUT")" -lt $((64 << 20)) ] || die "$OUT is 64 MiB or more"
printf 'NEEDED:     %s\n' "$(readelf -d "$STRIPPED" | sed -nE 's/.*\(NEEDED\).*\[(.*)\]/\1/p' | tr '\n' ' ')"
if readelf -d "$STRIPPED" | grep -qE '\((RPATH|RUNPATH)\)'; then die "the binary has an RPATH/RUNPATH"; fi
printf 'min glibc:  %s\n' "$(readelf -V -W "$STRIPPED" | grep -oE 'GLIBC_[0-9]+(\.[0-9]+)+' | sort -uV | tail -1)"
printf '\n%s is ready for the GPU host: see the top of %s for how to run it.\n' "$OUT" "scripts/build-cuda.sh"

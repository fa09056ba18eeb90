#!/usr/bin/env bash
# Builds the peer the GGUF support is checked against: llama.cpp's library from its sources in models/llama.cpp
# (scripts/fetch-models.sh), and scripts/llama-peer.cpp against it, as target/peer/llama-peer. cmake and ninja come
# from PyPI where the machine has none. About 2 minutes on 2 cores; nothing is done when it is built already.
set -euo pipefail
cd "$(dirname "$0")/.."
src=models/llama.cpp
out=target/peer
PYTHON=${PYTHON:-python3}
[ -f "$src/include/llama.h" ] || { echo "error: no llama.cpp sources in $src: run scripts/fetch-models.sh" >&2; exit 1; }
stamp="$out/.built-$(cat scripts/llama-peer.cpp "$src"/.sdist-* 2>/dev/null | sha256sum | cut -c1-16)"
if [ -x "$out/llama-peer" ] && [ -f "$stamp" ]; then
  echo "ok: $out/llama-peer"
  exit 0
fi
if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
  "$PYTHON" -m pip install --quiet --disable-pip-version-check 'cmake>=3.28' ninja
  # pip puts the commands in its scheme's scripts folder, or in the user's where they were installed with --user
  # before (pip then installs nothing): neither need be on PATH (pyenv's shims see new commands only after a rehash).
  for scheme in "" "$("$PYTHON" -c 'import os; print(os.name + "_user")')"; do
    # shellcheck disable=SC2086 # the empty scheme is no argument: the interpreter's default
    PATH="$PATH:$("$PYTHON" -c 'import sys, sysconfig; print(sysconfig.get_path("scripts", *sys.argv[1:]))' $scheme)"
  done
  command -v cmake >/dev/null && command -v ninja >/dev/null || { echo "error: pip installed cmake and ninja, but neither PATH nor pip's scripts folders hold them" >&2; exit 1; }
fi
# No native instructions: the peer's results must not depend on the CPU (and llama.cpp's AMX code dies without the
# kernel's permission); its speed does not matter here.
mkdir -p "$out"
log="$out/build.log"
if ! { cmake -S "$src" -B "$out/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
         -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
         -DLLAMA_BUILD_SERVER=OFF && cmake --build "$out/build" --target llama -j "$(nproc)"; } >"$log" 2>&1; then
  tail -40 "$log" >&2
  echo "error: building llama.cpp failed (all of it in $log)" >&2
  exit 1
fi
g++ -O2 -std=c++17 scripts/llama-peer.cpp -I"$src/include" -I"$src/ggml/include" -L"$out/build/bin" -lllama \
  -Wl,-rpath,"$PWD/$out/build/bin" -o "$out/llama-peer"
rm -f "$out"/.built-* && touch "$stamp"
echo "ok: $out/llama-peer"

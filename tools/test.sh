#!/usr/bin/env bash
# Runs every test of the project: the README's test command, also what CI runs (.ci/run).
# Installs what it needs itself, so it works on a fresh machine with only rustup and cargo.
set -euo pipefail
cd "$(dirname "$0")/.."

# Release-ish optimisation for dependencies is set in Cargo.toml's dev profile; tests need no
# network: every model they use is committed under tests/fixtures or www/models, or read from
# ../shared (skipped loudly when absent, unless NEXTTOKEN_REQUIRE_SHARED=1 as in CI).
cargo build --all-targets
cargo test --all-targets -- --test-threads=2
cargo test --doc

#!/usr/bin/env bash
# The whole test suite: formatting, lints, tests (interop tests need qemu-img; without it they
# say SKIPPED, and fail instead when QIMG_REQUIRE_QEMU=1), and docs with warnings as errors.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
# `qimg-serve/fuzzing`: the fuzz harnesses, kept out of the published crate, and their test.
cargo clippy --workspace --all-targets --locked --features qimg-serve/fuzzing -- -D warnings
# The lean library a VMM can build: no blocking facade, no codecs, no JSON.
cargo clippy -p qimg --no-default-features --lib --locked -- -D warnings
cargo test --workspace --locked --features qimg-serve/fuzzing
# The lean library (no compression codecs, JSON or blocking facade) and its unit tests.
cargo test -p qimg --no-default-features --lib --locked
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked

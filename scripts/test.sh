#!/usr/bin/env bash
# The whole test suite: formatting, lints, tests (interop tests need qemu-img; without it they
# say SKIPPED, and fail instead when QIMG_REQUIRE_QEMU=1), and docs with warnings as errors.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked

#!/usr/bin/env bash
# The `cuda` feature in CI, on a machine with no GPU and no CUDA toolkit (called by .ci/run).
#
#   1. lint everything with the feature on (clippy -D warnings, all targets)
#   2. build the examples with the feature on
#   3. run the feature's tests: graceful absence (CudaDevice::new is an error with the reason),
#      the GPU tier skipping with a printed reason where no GPU is present
#   4. run both examples: without a GPU each must print why it cannot run and exit 0
#
# Exits non-zero on the first failure. Extra cargo flags (e.g. --offline) via CARGO_FLAGS.
set -euo pipefail
cd "$(dirname "$0")/.."
flags=(${CARGO_FLAGS:-})

echo "== ci-cuda: clippy --all-targets --features cuda"
cargo clippy "${flags[@]}" --all-targets --features cuda -- -D warnings
echo "== ci-cuda: build --examples --features cuda"
cargo build "${flags[@]}" --examples --features cuda
echo "== ci-cuda: tests of the cuda feature"
cargo test "${flags[@]}" --features cuda --lib device::cuda
cargo test "${flags[@]}" --features cuda --test cuda_device -- --nocapture
echo "== ci-cuda: examples exit 0 where they cannot run"
cargo run "${flags[@]}" -q --features cuda --example cudarc_interop
RESULTS_DIR="${RESULTS_DIR:-target/ci-cuda}" cargo run "${flags[@]}" -q --features cuda --example gpu_bench
echo "== ci-cuda: ok"

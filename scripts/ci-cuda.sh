#!/usr/bin/env bash
# The `cuda` feature in CI, on a machine with no GPU and no CUDA toolkit (called by .ci/run).
#
#   1. lint everything with the feature on (clippy -D warnings, all targets)
#   2. build the examples with the feature on
#   3. run the feature's tests: graceful absence (CudaDevice::new is an error with the reason),
#      the GPU tier skipping with a printed reason where no GPU is present, and the doc examples
#      (the CUDA ones compiled, not run)
#   4. run both examples: without a GPU each must print why it cannot run and exit 0
#
# Exits non-zero on the first failure. Extra cargo flags (e.g. --offline) via CARGO_FLAGS.
set -euo pipefail
cd "$(dirname "$0")/.."
flags=(${CARGO_FLAGS:-})

# cudarc needs a CUDA version feature; the application picks it (here 12.8).
core=(-p tidepool --features cuda-12080)
echo "== ci-cuda: clippy --all-targets, core crate with cuda-12080"
cargo clippy "${flags[@]}" "${core[@]}" --all-targets -- -D warnings
echo "== ci-cuda: clippy, eager crate and CLI with their cuda features"
cargo clippy "${flags[@]}" -p tidepool-eager --features cuda-12080 --all-targets -- -D warnings
cargo clippy "${flags[@]}" -p tidepool-cli --features cuda --all-targets -- -D warnings
echo "== ci-cuda: build --examples"
cargo build "${flags[@]}" "${core[@]}" --examples
echo "== ci-cuda: tests of the cuda feature"
cargo test "${flags[@]}" "${core[@]}" --lib device::cuda
cargo test "${flags[@]}" "${core[@]}" --test cuda_device -- --nocapture
# The doc examples with the feature on: CudaDevice's and CudaBuffer's are `no_run` (they need a
# GPU) and are compiled only here; without it an example that stopped compiling went unnoticed.
cargo test "${flags[@]}" "${core[@]}" --doc
echo "== ci-cuda: examples exit 0 where they cannot run"
cargo run "${flags[@]}" -q "${core[@]}" --example cudarc_interop
RESULTS_DIR="${RESULTS_DIR:-target/ci-cuda}" cargo run "${flags[@]}" -q "${core[@]}" --example gpu_bench
echo "== ci-cuda: ok"

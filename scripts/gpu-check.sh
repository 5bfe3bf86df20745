#!/usr/bin/env bash
# GPU check of the `cuda` feature, for a machine with one NVIDIA GPU and its driver.
#
#   build  cargo: the GPU test binary and the two examples, release, --features cuda
#          (skipped with SKIP_BUILD=1: then the binaries already in target/release are run,
#          so the GPU machine needs no cargo and no crates: build here, carry `target/release`)
#   tests  tests/cuda_device.rs, one at a time (expandable segments included: virtual memory
#          management through cuMemCreate/cuMemMap, where the device supports it; and
#          from_buffer_gives_a_refused_buffer_back_whole, CudaBuffer::from_buffer's refusal)
#   graphs the private-pool and CUDA-graph tests of tests/cuda_device.rs: a guard routing a
#          stream to a MemPool, then a capture (cuStreamBeginCapture/cuStreamEndCapture/
#          cuGraphInstantiate) from the graph's private pool replayed 100 times (cuGraphLaunch),
#          a capture that forks a side stream into the graph and joins it back (events), and
#          graph_capture_record_stream_reuse: a side stream's block reused after the join
#   interop examples/cudarc_interop (NVRTC + cuBLAS through tidepool buffers, checked numerically)
#   eager, eager_pinned  (before bench) the eager layer's CUDA back end (crates/eager, NVRTC kernels + cuBLAS):
#          the CUDA tests of crates/eager/tests/eager_edges.rs and pinned_upload.rs (their
#          SimDevice tests run too, in seconds)
#   bench  examples/gpu_bench: alloc+free latency (tidepool hit / cuMemAlloc / cuMemAllocAsync)
#          and the gpt2 trace replayed on device memory, with ordinary and expandable segments
#          → $RESULTS_DIR/gpu_bench.json
#
# The six run steps share a budget of RUN_BUDGET_S seconds (default 300). Every step's output
# is in $RESULTS_DIR/<step>.log (default target/gpu-check/), the verdicts in summary.txt.
# A step that could not run for want of a GPU/driver/library is SKIP (exit 0 unless
# REQUIRE_GPU=1); any FAIL makes the script exit 1. A step that ran but some of whose tests
# skipped for want of something else (a second GPU, virtual memory management) is PASS, with
# those reasons in its verdict.
#
# For a GPU machine without cargo or network: build here with small binaries,
#   CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols bash scripts/gpu-check.sh
# (the run steps SKIP here), bring the paths it prints after
# "binaries:" along, and run `SKIP_BUILD=1 bash scripts/gpu-check.sh` there.
set -uo pipefail
cd "$(dirname "$0")/.."
export RESULTS_DIR="${RESULTS_DIR:-target/gpu-check}"
mkdir -p "$RESULTS_DIR"
summary="$RESULTS_DIR/summary.txt"
: > "$summary"
flags=(${CARGO_FLAGS:-})
failed=0
skipped=0

verdict() { # step status detail
    echo "$1: $2${3:+ ($3)}" | tee -a "$summary"
    case "$2" in FAIL) failed=1 ;; SKIP) skipped=1 ;; esac
}

if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
    echo "== build"
    if timeout "${BUILD_BUDGET_S:-900}" cargo build "${flags[@]}" --release --features cuda \
        --example cudarc_interop --example gpu_bench >"$RESULTS_DIR/build.log" 2>&1 &&
        timeout "${BUILD_BUDGET_S:-900}" cargo test "${flags[@]}" --release --features cuda \
            --test cuda_device --no-run >>"$RESULTS_DIR/build.log" 2>&1 &&
        timeout "${BUILD_BUDGET_S:-900}" cargo test "${flags[@]}" --release -p tidepool-eager \
            --features cuda-12080 --test eager_edges --test pinned_upload --no-run \
            >>"$RESULTS_DIR/build.log" 2>&1; then
        verdict build PASS
    else
        tail -30 "$RESULTS_DIR/build.log"
        verdict build FAIL "see build.log"
        exit 1
    fi
fi

newest() { ls -t target/release/deps/"$1"-* 2>/dev/null | grep -v '\.d$' | head -1; }
test_bin=$(newest cuda_device)
eager_bins=($(newest eager_edges) $(newest pinned_upload))
echo "binaries: $test_bin ${eager_bins[*]} target/release/examples/cudarc_interop" \
    "target/release/examples/gpu_bench"
deadline=$((SECONDS + ${RUN_BUDGET_S:-300}))

run_step() { # name skip-pattern command...
    local name=$1 skip_pattern=$2 left=$((deadline - SECONDS)) rc
    shift 2
    if ((left <= 0)); then
        verdict "$name" FAIL "no time left in the run budget"
        return
    fi
    echo "== $name (at most ${left}s)"
    timeout "$left" "$@" >"$RESULTS_DIR/$name.log" 2>&1
    rc=$?
    tail -15 "$RESULTS_DIR/$name.log"
    if ((rc == 124)); then
        verdict "$name" FAIL "timed out"
    elif ((rc != 0)); then
        verdict "$name" FAIL "exit $rc, see $name.log"
    elif grep -q -- "$skip_pattern" "$RESULTS_DIR/$name.log"; then
        verdict "$name" SKIP "$(grep -m1 -o -- "$skip_pattern.*" "$RESULTS_DIR/$name.log")"
    else
        # Tests that skipped for want of something other than a GPU (a second GPU, virtual
        # memory management) while the rest ran: a pass, saying what did not run.
        local partial
        partial=$(grep -o -- "skipping[^:]*: .*" "$RESULTS_DIR/$name.log" | sort -u | paste -sd ';' -)
        verdict "$name" PASS "${partial:+not run: $partial}"
    fi
}

run_tests() { # name binary args...: the tests of a binary; SKIP only where there is no GPU
    local name=$1
    shift
    # The GPU tier prints `skipping: <CudaDevice::unavailable_reason>` (no driver, no usable
    # device, no device) in each test; other skips ("skipping: fewer than two GPUs") are partial.
    run_step "$name" "skipping[^:]*: no " "$@"
}

if [[ -z "$test_bin" ]]; then
    verdict tests FAIL "no test binary target/release/deps/cuda_device-*"
else
    run_tests tests "$test_bin" --test-threads=1 --nocapture \
        --skip private_pool_ --skip graph_capture_
    run_tests graphs "$test_bin" --test-threads=1 --nocapture private_pool_ graph_capture_
fi
run_step interop "cannot run here" target/release/examples/cudarc_interop
if ((${#eager_bins[@]} != 2)); then
    verdict eager FAIL "no test binaries target/release/deps/{eager_edges,pinned_upload}-*"
else
    run_tests eager "${eager_bins[0]}" --test-threads=1 --nocapture
    run_tests eager_pinned "${eager_bins[1]}" --test-threads=1 --nocapture
fi
run_step bench "cannot run here" target/release/examples/gpu_bench

echo "== summary ($summary)"
cat "$summary"
if ((failed)); then exit 1; fi
if ((skipped)) && [[ "${REQUIRE_GPU:-0}" == 1 ]]; then
    echo "REQUIRE_GPU=1 and a step was skipped"
    exit 1
fi
exit 0

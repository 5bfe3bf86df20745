#!/usr/bin/env bash
# Runs every cargo-fuzz target of tidepool for N seconds each (default 60), one after another,
# and fails on the first crash, leak, timeout or memory blow-up.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]      e.g.  scripts/fuzz.sh 60
#                                                    nice -n 10 scripts/fuzz.sh 1200 allocator_ops
#
# - installs cargo-fuzz (`cargo install cargo-fuzz --locked`) unless `cargo fuzz --version` works;
# - `-s none`: no sanitizer, which the stable toolchain needs (the harnesses check the
#   allocator's invariants and the SimDevice's stream-order sanitizer instead);
# - each target reads the committed seeds in fuzz/corpus/<target>/ and writes what it finds to a
#   scratch corpus, fuzz/target/corpus/<target>/ (git-ignored), so a run leaves the committed
#   corpus unchanged; crashes go to fuzz/artifacts/<target>/: commit them, the `fuzz_corpus`
#   test replays every file there under `cargo test`;
# - memory is bounded: -rss_limit_mb=2048 for the process and -malloc_limit_mb for any single
#   allocation, so a reader that allocates what an input *claims* is reported as a crash;
# - fuzz/dicts/<target>.dict, where present, is passed as a libFuzzer dictionary;
# - the figures of each run (executions, executions per second) are printed at its end and the
#   whole libFuzzer output is kept in fuzz/target/fuzz-<target>.log.
#
# Refreshing a committed corpus after long runs: copy fuzz/corpus/<target>/ and the scratch
# corpus into one folder, `cargo fuzz cmin -s none <target> FOLDER` (allocator_ops: add
# `--no-trace-compares --target-dir fuzz/target/no-cmp`), then put the result back next to the
# named seeds (`cargo run -p tidepool-fuzzing --example fuzz_seeds -- fuzz/corpus` rewrites
# those). Keep the whole
# committed corpus small (trace_parse: inputs of at most 2 KB).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-60}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(allocator_ops config_parse trace_parse)
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi
cargo fuzz --version

# Per-target libFuzzer options: the largest input tried (allocator_ops: 256 bytes ≈ 50 steps)
# and the single-allocation limit (MiB).
declare -A max_len=([allocator_ops]=256 [config_parse]=512 [trace_parse]=65536)
declare -A malloc_mb=([allocator_ops]=256 [config_parse]=64 [trace_parse]=512)
# allocator_ops decodes its operands modulo small tables, so comparison tracing buys it little
# and costs a quarter of its speed: it is built without, in a target directory of its own (the
# flags differ, and sharing one directory would rebuild everything between targets).
declare -A build_opts=([allocator_ops]="--no-trace-compares --target-dir fuzz/target/no-cmp")

for t in "${targets[@]}"; do
  if [ -z "${max_len[$t]:-}" ]; then
    echo "unknown fuzz target $t (known: ${!max_len[*]})" >&2
    exit 2
  fi
  scratch="fuzz/target/corpus/$t"
  log="fuzz/target/fuzz-$t.log"
  mkdir -p "$scratch" "fuzz/artifacts/$t"
  echo "=== fuzzing $t for ${seconds}s"
  set +e
  dict=()
  if [ -f "fuzz/dicts/$t.dict" ]; then
    dict=(-dict="fuzz/dicts/$t.dict")
  fi
  # shellcheck disable=SC2086 # build_opts holds several words
  cargo fuzz run -s none ${build_opts[$t]:-} "$t" "$scratch" "fuzz/corpus/$t" -- \
    -max_total_time="$seconds" -max_len="${max_len[$t]}" \
    -rss_limit_mb=2048 -malloc_limit_mb="${malloc_mb[$t]}" -timeout=10 \
    -print_final_stats=1 "${dict[@]}" >"$log" 2>&1
  rc=$?
  set -e
  grep -E '^(stat::number_of_executed_units|stat::average_exec_per_sec|stat::peak_rss_mb|Done [0-9]+ runs)' "$log" || true
  if [ "$rc" -ne 0 ]; then
    tail -n 60 "$log"
    echo "!!! $t failed (exit $rc): input in fuzz/artifacts/$t/, log in $log" >&2
    exit 1
  fi
done
echo "=== no failure in ${targets[*]}"

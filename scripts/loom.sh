#!/usr/bin/env bash
# Loom models of tidepool's lock-free protocols (loom-tests/tests/models.rs).
#
#   scripts/loom.sh            run every model against the real code (must pass; < 5 min)
#   scripts/loom.sh --broken   for each deliberately broken protocol, rebuild with
#                              --cfg tidepool_broken="<variant>" and check that its model FAILS
#
# Each model caps its own preemption bound at 2 or 3 (LOOM_MAX_PREEMPTIONS can lower it).
set -euo pipefail
cd "$(dirname "$0")/.."

export LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-3}"

if [ "${1:-}" != "--broken" ]; then
  RUSTFLAGS="--cfg loom" cargo test -p tidepool-loom-tests --release --target-dir target/loom
  exit 0
fi

# variant -> the model that must catch it
variants=(
  "fast_cache:fast_cache_push_pop_against_flush"
  "coalesce:fast_pop_against_coalesce_of_neighbour"
  "events:event_completion_against_same_stream_alloc"
  "stats:stats_current_never_exceeds_peak"
  "stats_reader:stats_snapshot_is_never_torn"
  "stats_open:stats_published_on_read_are_never_stale"
  "config:config_swap_during_allocation"
  "scope_batch:batch_return_against_fast_free"
  "adopt:escape_free_against_scope_exit"
  "unbound_free:unbound_free_against_next_planned_handout"
  "large_drain:large_free_against_flush_of_the_large_block"
  "lane_lock:fast_cache_push_pop_against_flush"
  "owner_stash:owner_hold_kept_in_a_lane_against_the_last_handle"
  "fast_cache:large_hit_against_a_pool_change_and_drain"
  "credit_mark:stats_revocation_sees_credit_granted_before_it"
  "top_up_past_headroom:stats_top_up_against_a_slow_path_increase"
  "region_idle:idle_region_release_against_a_run_of_its_scope"
  "cap_check:a_pool_and_the_general_allocator_reserving_at_once_under_a_cap"
  "moved_hold:a_block_moved_to_another_lane_against_the_last_handle"
  "retag_free:a_lane_retagged_for_a_new_stream_against_a_stale_free_and_hits"
  "retag_hit:a_lane_retagged_for_a_new_stream_against_a_stale_free_and_hits"
  "lane_bias:a_biased_lane_against_another_threads_take"
  "token_ends_early:a_lane_whose_owner_ended_against_the_next_users_claim"
)
status=0
for v in "${variants[@]}"; do
  variant="${v%%:*}"
  test="${v#*:}"
  printf '\n=== broken "%s": %s must fail\n' "$variant" "$test"
  if RUST_BACKTRACE=0 RUSTFLAGS="--cfg loom --cfg tidepool_broken=\"$variant\"" \
    cargo test -q -p tidepool-loom-tests --release --target-dir target/loom-broken \
    -- --exact "$test" 2>&1 | tail -n 25 | grep -E "panicked|test result|assert|left|right|violation"; then :; fi
  if RUST_BACKTRACE=0 RUSTFLAGS="--cfg loom --cfg tidepool_broken=\"$variant\"" \
    cargo test -q -p tidepool-loom-tests --release --target-dir target/loom-broken \
    -- --exact "$test" >/dev/null 2>&1; then
    echo "NOT CAUGHT: $variant"
    status=1
  else
    echo "caught: $variant"
  fi
done
exit $status

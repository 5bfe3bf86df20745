//! Batch return: many blocks of one stream given back under one acquisition of the global lock,
//! straight into the pool so they coalesce at once (what a scope's exit does), followed by a
//! flush of that stream's cache so its blocks coalesce with them.
//!
//! ```text
//!   free_batch([a, c, …]) ── global lock ──▶ pool.free(a), pool.free(c), …   (coalesce)
//!                                          └─▶ flush the stream cache (its own lock, inside)
//!   concurrently, another thread:  drop(b) ── b's stream-cache lock only ──▶ cache.push(b)
//! ```
//!
//! `b` is allocated in the pool while cached, so coalescing `a` and `c` never absorbs it; the
//! flush drains the cache under its lock, so `b` is either flushed or stays cached, never lost.

use super::counters::BaseStats;
use super::fast_cache::{StreamCache, flush_into};
use crate::pool::{BlockId, Pool};

/// One block of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchBlock {
    /// The pool's block (allocated).
    pub block: BlockId,
    /// Its statistics quadrant.
    pub quadrant: usize,
    /// Its size.
    pub size: u64,
    /// The request it served.
    pub requested: u64,
}

/// Returns `blocks` to `pool` and flushes `cache` into it. The caller holds the global lock.
pub fn return_batch(
    pool: &mut Pool,
    base: &mut BaseStats,
    cache: Option<&StreamCache>,
    blocks: &[BatchBlock],
) {
    for b in blocks {
        pool.free(b.block);
        base.live_down(b.quadrant, b.size, b.requested);
    }
    let Some(cache) = cache else { return };
    #[cfg(tidepool_broken = "scope_batch")]
    {
        // BROKEN: frees a snapshot of the cache, then clears it: a block cached in between is
        // dropped from the cache without reaching the pool (leaked).
        let snapshot = cache.peek();
        for (_, b) in &snapshot {
            pool.free(b.block);
        }
        cache.clear();
    }
    #[cfg(not(tidepool_broken = "scope_batch"))]
    flush_into(cache, pool);
}

//! A lane's administration, off the hot path: drained, cleared or given selected blocks back,
//! configured with new limits, closed, re-tagged to another stream, and its statistics
//! published or closed; and the deliberate bugs' switches (feature `test-hooks`).

use super::{CachedBlock, ClassKey, Limits, StreamCache};
use crate::allocator::stats_layout::CACHED_BYTES;
#[cfg(any(tidepool_broken = "coalesce", tidepool_broken = "scope_batch"))]
use crate::allocator::stats_layout::is_small;
use crate::device::StreamId;
use crate::pool::Sizing;
use crate::sync::atomic::Ordering;

impl StreamCache {
    /// Empties the cache (a flush); the caller holds the global lock and frees every returned
    /// block into the pool. The statistics do not change: cached blocks already count as freed.
    pub fn drain(&self) -> Vec<CachedBlock> {
        let mut g = self.lock_inner();
        // (No block is empty: no bytes, no blocks.)
        if g.words[CACHED_BYTES] == 0 {
            return Vec::new();
        }
        let inner = &mut *g;
        let mut out = Vec::new();
        inner.classes.take_all(&mut out);
        inner.verdict = None;
        self.set_large(inner, None);
        inner.words[CACHED_BYTES] = 0;
        self.publish(inner);
        out
    }

    /// The blocks cached now, in no particular order (for the broken variants' snapshots and
    /// for tests).
    #[cfg_attr(not(any(test, feature = "test-hooks")), allow(dead_code))]
    pub fn peek(&self) -> Vec<(ClassKey, CachedBlock)> {
        self.lock_inner().entries()
    }

    /// Removes exactly these blocks, if still cached (used by the broken variants only).
    #[cfg(any(tidepool_broken = "coalesce", tidepool_broken = "scope_batch"))]
    pub fn remove(&self, which: &[CachedBlock]) {
        let mut g = self.lock_inner();
        let inner = &mut *g;
        for list in inner.classes.lists_mut() {
            list.retain(|b| {
                let gone = which.contains(b);
                if gone {
                    if !is_small(b.quadrant) {
                        inner.room = inner.room.saturating_sub(inner.large);
                        inner.large = 0;
                    }
                    inner.words[CACHED_BYTES] -= b.size;
                }
                !gone
            });
        }
        if inner.large == 0 {
            self.large.store(0, Ordering::Relaxed);
        }
        self.publish(inner);
    }

    /// Clears the cache without returning anything (used by the broken variants only).
    #[cfg(tidepool_broken = "scope_batch")]
    pub fn clear(&self) {
        let mut g = self.lock_inner();
        let inner = &mut *g;
        inner.classes.clear();
        self.set_large(inner, None);
        inner.words[CACHED_BYTES] = 0;
        self.publish(inner);
    }

    /// Changes what the stream may cache and the size rules its hits round with (blocks already
    /// cached stay until the next flush).
    pub fn configure(&self, limits: Limits, sizing: Sizing) {
        // (Outside the lock: turning the bias off revokes it, which takes the lock.)
        self.inner.set_biasing(limits.biased);
        let mut g = self.lock_inner();
        g.limits = limits;
        g.room = match Self::room_of(limits, g.closed || g.stash_closed) {
            0 => 0,
            // (The bound holds for the small blocks: a cached large block's bytes on top.)
            room if cfg!(tidepool_broken = "lane_room_shared") => room,
            room => room + g.large,
        };
        g.sizing = sizing;
        g.small_max = Self::small_max_of(limits, &sizing);
        g.round_mask = Self::round_mask_of(&sizing);
        g.verdict = None;
        self.fast_max.store(Self::fast_max_of(limits, &sizing), Ordering::Relaxed);
    }

    /// The bytes a lane may hold under `limits` (`CacheInner::room`): 0 when caching is off,
    /// when no block is allowed per class, or once `closed`.
    pub(super) fn room_of(limits: Limits, closed: bool) -> u64 {
        if limits.enabled && limits.entries > 0 && !closed { limits.bytes } else { 0 }
    }

    /// The largest request a hit may serve under `limits` and `sizing`.
    pub(crate) fn fast_max_of(limits: Limits, sizing: &Sizing) -> u64 {
        if limits.enabled { sizing.small_size } else { 0 }
    }

    /// The largest rounded request a hit may serve (see `CacheInner::small_max`).
    pub(super) fn small_max_of(limits: Limits, sizing: &Sizing) -> u64 {
        Self::fast_max_of(limits, sizing)
    }

    /// See `CacheInner::round_mask`: the mask where `Sizing::round` of every request up to the
    /// small bound is a round-up to the granule.
    pub(super) fn round_mask_of(sizing: &Sizing) -> u64 {
        let m = sizing.min_block_size;
        let d = &sizing.roundup_power2_divisions;
        // Every size interval up to the small bound (`small_size_mb` above 1 spans several).
        // BROKEN (`mask_one_interval`): the bound's own interval alone.
        let no_divisions = match cfg!(tidepool_broken = "mask_one_interval") {
            true => {
                let div = d.for_size(sizing.small_size);
                div <= 1 || m.saturating_mul(div) >= sizing.small_size
            }
            false => !d.divides_up_to(m, sizing.small_size),
        };
        if m.is_power_of_two() && no_divisions { m - 1 } else { u64::MAX }
    }

    /// Turns the deliberate bug `Broken::UnmarkedCredit` on or off for this lane.
    #[cfg(feature = "test-hooks")]
    pub fn set_unmarked(&self, on: bool) {
        self.lock_inner().unmarked = on;
    }

    /// Turns the deliberate tag-check bugs `bits` (`TAG_FREES`, `TAG_HITS`) on or off for
    /// this lane.
    #[cfg(feature = "test-hooks")]
    pub fn set_broken_tags(&self, bits: u8, on: bool) {
        let mut g = self.lock_inner();
        g.broken_tags = if on { g.broken_tags | bits } else { g.broken_tags & !bits };
    }

    /// Turns the deliberate bug `Broken::HotCreditKept` on or off for this lane.
    #[cfg(feature = "test-hooks")]
    pub fn set_keep_hot(&self, on: bool) {
        self.lock_inner().keep_hot = on;
    }

    /// Refuses every later push (the stream was destroyed); the caller drains it.
    pub fn close(&self) {
        let mut g = self.lock_inner();
        g.closed = true;
        g.room = 0;
    }

    /// Serves `stream` from now on (a *re-tag*, see `CacheTable`(crate::allocator::lane_table::CacheTable)): the lane of a destroyed
    /// stream, closed then, opens again for a new one under `limits` and `sizing`. Returns
    /// what it still cached, for the caller to free into the pool (nothing, after the flush
    /// that closed it: a closed lane takes no block). The caller holds the global lock, has
    /// made statistics readers retry, and then re-sorts the table (the lock order).
    pub fn retag(&self, stream: StreamId, limits: Limits, sizing: Sizing) -> Vec<CachedBlock> {
        let left = self.drain();
        let mut g = self.lock_inner();
        g.stream = stream;
        g.closed = false;
        self.tag.store(u64::from(stream.0), Ordering::Relaxed);
        drop(g);
        self.configure(limits, sizing);
        left
    }

    /// Whether [`StreamCache::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.lock_inner().closed
    }

    /// Blocks cached now (read under the lane's lock: the hit path keeps no copy outside it).
    /// Tests only: the allocator's flush no longer asks first (see `Shared::flush_all`).
    #[cfg(feature = "test-hooks")]
    pub fn cached_blocks(&self) -> u64 {
        self.lock_inner().classes.blocks() as u64
    }

    /// Bytes cached now (read under the lane's lock).
    #[cfg(feature = "test-hooks")]
    pub fn cached_bytes_now(&self) -> u64 {
        self.lock_inner().words[CACHED_BYTES]
    }

    /// For a statistics reader: publishes the lane's words if changes left them stale, unless
    /// the lane is held right now (a reader never waits for a lane: its collect then sees the
    /// write open and tries again, and after enough tries reads under the locks).
    pub fn close_stats(&self) {
        if self.fast.is_open()
            && let Some(mut g) = self.inner.try_lock()
            && self.fast.is_open()
        {
            // The words that changed since the last publish (a hit keeps no change marks: they
            // are found by comparing with a copy, on the reader's side).
            self.publish(&mut g);
        }
    }
}

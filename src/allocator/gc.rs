//! PyTorch's `garbage_collection_threshold` (`garbage_collect_cached_blocks`): when a request
//! finds no free block and a new segment is about to be reserved, and reserved memory — the
//! general allocator's and its private pools', as the cap counts it — is already past
//! `threshold × cap` ([`Config::gc_limit`]), cached large-pool transient segments that hold no
//! block (whole and free) are returned to the device, those idle at least as long as the
//! average first, pass after pass, until what was released covers the excess. Small-pool
//! segments, persistent segments, the initial pool and private pools' segments are never
//! collected. (A request routed to a private pool collects nothing: PyTorch's would collect
//! the general pool's idle large blocks, which a pool's lock section cannot reach here.)
//!
//! ```text
//!  reserved > threshold × cap ?               (before the new segment: PyTorch's test)
//!     target = reserved − threshold × cap
//!     idle   = free whole large transient segments, age = pool clock − last use
//!     while released < target and a pass released something:
//!        average = Σ age / count;  release every idle segment with age ≥ average
//! ```
//!
//! A pass does not stop at the target ("we don't want this GC to be triggered frequently",
//! as PyTorch's comment says). PyTorch's age is the count of searches of the large pool since
//! the block was last taken; tidepool's pool clock ticks at every allocation, free and new
//! segment of the large pool, so the order of ages is the same but the average may split a set
//! of segments elsewhere. Both count only while a threshold is in force (`Pool::run_clock`): a
//! `set_config` that sets one finds every segment cached before it equally idle.
//!
//! A segment's idle age is the pool's clock at its last allocation or free *in the pool*. A
//! block freed into a stream cache would keep its segment busy until the cache is flushed, and
//! count as used at the flush, not at its free as PyTorch's: so while a threshold is set, freed
//! large blocks go to the pool at once (`Shared::large_cacheable`; small-pool segments are not
//! collected).
//!
//! Expandable ranges are left to their own control, `release_threshold_mb` (PyTorch's
//! collection skips `expandable_segment_` blocks too): the collection releases ordinary
//! segments only.

use super::*;

impl<D: Device> Shared<D> {
    /// Releases idle cached large segments, PyTorch's way, when reserved memory is past the
    /// garbage-collection threshold as a new segment of `seg_size` bytes is about to be
    /// reserved. Nothing without a threshold.
    pub(super) fn collect_garbage(
        &self,
        st: &mut State,
        config: &Config,
        seg_size: u64,
    ) -> Result<(), AllocError> {
        let Some(limit) = config.gc_limit(self.device_total) else { return Ok(()) };
        // PyTorch's collection walks the general pool's `large_blocks`: a private pool's cached
        // memory (a `MemPool`'s, a graph's) is never collected.
        #[cfg(not(tidepool_broken = "gc_before_threshold"))]
        if self.role.id != 0 {
            return Ok(());
        }
        if self.device.capture_underway() {
            return Ok(()); // cuMemFree is illegal during a stream capture: later
        }
        // The family's reserved bytes, as the cap counts them (PyTorch's threshold is against
        // the device's `total_allocated_memory`, every pool included); only this allocator's
        // own idle segments are collected.
        let reserved = match self.broken(Broken::GcPerPool) {
            true => st.pool.reserved_bytes(), // BROKEN: the private pools' memory not counted
            false => self.family_reserved(st),
        };
        #[cfg(tidepool_broken = "gc_before_threshold")]
        {
            // BROKEN: the collection of before: it ran once reserved + the new segment would
            // pass the threshold, released small segments too, the longest idle first, and
            // stopped as soon as the new segment fitted under the threshold.
            return self.collect_until_fits(st, reserved, limit, seg_size);
        }
        #[cfg(not(tidepool_broken = "gc_before_threshold"))]
        {
            let _ = seg_size; // PyTorch tests the memory reserved already
            if reserved <= limit {
                return Ok(());
            }
            self.collect_above_average_age(st, reserved - limit)
        }
    }

    /// `garbage_collect_cached_blocks`' passes: release every idle large segment at least as
    /// old as the average of those left, until `target` bytes are released or a pass
    /// releases nothing.
    #[cfg(not(tidepool_broken = "gc_before_threshold"))]
    fn collect_above_average_age(&self, st: &mut State, target: u64) -> Result<(), AllocError> {
        let now = st.pool.clock();
        let mut idle: Vec<(u64, SegmentId)> = self
            .idle_segments(st, true)
            .into_iter()
            .map(|id| (now - st.pool.segment(id).last_use, id))
            .collect();
        if self.broken(Broken::GcYoungestFirst) {
            // The youngest count as the oldest: the pass releases the most recently used.
            let oldest = idle.iter().map(|&(age, _)| age).max().unwrap_or(0);
            idle.iter_mut().for_each(|(age, _)| *age = oldest - *age);
        }
        let mut released = 0u64;
        while released < target && !idle.is_empty() {
            let total: u128 = idle.iter().map(|&(age, _)| age as u128).sum();
            let count = idle.len() as u128;
            // age ≥ total / count, in integers: age × count ≥ total.
            let (old, young): (Vec<_>, Vec<_>) =
                idle.into_iter().partition(|&(age, _)| age as u128 * count >= total);
            if old.is_empty() {
                break; // cannot happen (the oldest is at least the average), but stay finite
            }
            for (_, seg) in old {
                released += st.pool.segment(seg).size;
                self.release_segment(st, seg)?;
            }
            idle = young;
        }
        Ok(())
    }

    /// The segments the collection may release: cached transient segments with no busy block,
    /// neither in an expandable range nor the initial pool; of the large pool only when
    /// `large_only` (PyTorch's collection walks `large_blocks`).
    fn idle_segments(&self, st: &State, large_only: bool) -> Vec<SegmentId> {
        let persistent_too = self.broken(Broken::GcPersistent);
        let (vm, initial) = (&st.vm, st.initial);
        let mut idle = st.pool.releasable_segments(|s| {
            !vm.contains(s.base)
                && Some(s.base) != initial
                && (s.key.residency == Residency::Transient || persistent_too)
                && (!large_only || s.key.kind == crate::stats::PoolKind::Large)
        });
        idle.sort_by_key(|&id| {
            let s = st.pool.segment(id);
            (s.last_use, s.base)
        });
        idle
    }

    /// The collection before PyTorch's was followed (`tidepool_broken = "gc_before_threshold"`).
    #[cfg(tidepool_broken = "gc_before_threshold")]
    fn collect_until_fits(
        &self,
        st: &mut State,
        mut reserved: u64,
        limit: u64,
        seg_size: u64,
    ) -> Result<(), AllocError> {
        if reserved + seg_size <= limit {
            return Ok(());
        }
        let mut idle = self.idle_segments(st, false);
        if self.broken(Broken::GcYoungestFirst) {
            idle.reverse();
        }
        for seg in idle {
            if reserved + seg_size <= limit {
                break;
            }
            let size = st.pool.segment(seg).size;
            self.release_segment(st, seg)?;
            reserved -= size;
        }
        Ok(())
    }
}

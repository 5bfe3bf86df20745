//! PyTorch's `garbage_collection_threshold`: before a new segment would take reserved memory
//! past `threshold × cap` ([`Config::gc_limit`]) — reserved by the general allocator and its
//! private pools together, as the cap counts it — cached transient segments that hold no block
//! (whole and free) are returned to the device, the longest idle first, until the new segment
//! fits under the threshold or none is left. Persistent segments and the initial pool are never
//! collected.
//!
//! ```text
//!  reserved + new segment > threshold × cap ?
//!     idle = free whole transient segments, by last use (pool clock), oldest first
//!     release idle[0], idle[1], … while reserved + new segment > threshold × cap
//! ```
//!
//! A segment's idle age is the pool's clock at its last allocation or free *in the pool*: a
//! block freed into a stream cache keeps its segment busy until the cache is flushed (which
//! the slow path does before it reserves, hence before the collection runs), so a segment
//! whose last block waited in a cache counts as used at the flush.
//!
//! Expandable ranges are left to their own control, `release_threshold_mb` (their free pages
//! have no idle age; what a range keeps mapped is bounded there): the collection releases
//! ordinary segments only.

use super::*;

impl<D: Device> Shared<D> {
    /// Releases idle cached segments, oldest first, until a new segment of `seg_size` bytes
    /// keeps reserved memory within the garbage-collection threshold. Nothing without one.
    pub(super) fn collect_garbage(
        &self,
        st: &mut State,
        config: &Config,
        seg_size: u64,
    ) -> Result<(), AllocError> {
        let Some(limit) = config.gc_limit(self.device_total) else { return Ok(()) };
        if self.device.capture_underway() {
            return Ok(()); // cuMemFree is illegal during a stream capture: later
        }
        // The family's reserved bytes, as the cap counts them (PyTorch's threshold is against
        // the device's `total_allocated_memory`, every pool included); only this allocator's
        // own idle segments are collected.
        let mut reserved = match self.broken(Broken::GcPerPool) {
            true => st.pool.reserved_bytes(), // BROKEN: the private pools' memory not counted
            false => self.family_reserved(st),
        };
        if reserved + seg_size <= limit {
            return Ok(());
        }
        let persistent_too = self.broken(Broken::GcPersistent);
        let (vm, initial) = (&st.vm, st.initial);
        let mut idle = st.pool.releasable_segments(|s| {
            !vm.contains(s.base)
                && Some(s.base) != initial
                && (s.key.residency == Residency::Transient || persistent_too)
        });
        idle.sort_by_key(|&id| {
            let s = st.pool.segment(id);
            (s.last_use, s.base)
        });
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

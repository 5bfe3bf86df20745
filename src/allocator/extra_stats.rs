//! PyTorch's remaining statistics: `oversize_allocations` and `oversize_segments` (blocks and
//! ordinary segments of at least `max_split_size`), `num_sync_all_streams`,
//! `num_oom_rejections`, and
//! `reset_accumulated_stats` (`torch.cuda.reset_accumulated_memory_stats`).
//!
//! ```text
//!  State (global lock): pool.oversize, oversize_segments, counters.sync_all, .oom_rejections
//!      └─ plain counters of the base (publish.rs `plain_counters`): published with the block
//!         figures, so a read takes them in the same copy (counters.rs)
//!  stats(): base + caches ─▶ minus the accumulated figures saved by
//!           reset_accumulated_stats (ArcCell<MemoryStats>, swapped whole)
//! ```
//!
//! None of it is on the hit path: oversize blocks never enter a stream cache, and the other
//! figures change only under the global lock.

use super::*;
use crate::types::{BlockStats, Stat};

/// Words of the extra figures: two `Stat`s (current, peak, allocated, freed), the sync-all
/// count and the rejection count.
pub(super) const EXTRA_WORDS: usize = 10;

/// The extra figures as the state holds them (the caller holds the global lock).
pub(super) fn words(st: &State) -> [u64; EXTRA_WORDS] {
    let (a, s) = (st.pool.oversize_allocations(), &st.oversize_segments);
    [
        a.current,
        a.peak,
        a.allocated,
        a.freed,
        s.current,
        s.peak,
        s.allocated,
        s.freed,
        st.counters.sync_all,
        st.counters.oom_rejections,
    ]
}

fn stat(w: &[u64]) -> Stat {
    Stat { current: w[0], peak: w[1], allocated: w[2], freed: w[3] }
}

/// `m` with the extra figures of `w` (as [`words`] lays them out).
pub(super) fn with_extra_words(mut m: MemoryStats, w: &[u64]) -> MemoryStats {
    m.oversize_allocations = stat(&w[0..4]);
    m.oversize_segments = stat(&w[4..8]);
    m.num_sync_all_streams = w[8];
    m.num_oom_rejections = w[9];
    m
}

impl<D: Device> Shared<D> {
    /// Counts the ordinary segment at `base` of `size` bytes in `oversize_segments` if it is
    /// oversize (at least `max_split_size`) as it is reserved (`up`), and out again as it is
    /// released if it was counted in (whatever `max_split_size` is by then).
    pub(super) fn count_oversize_segment(&self, st: &mut State, base: u64, size: u64, up: bool) {
        if up && size >= self.oversize_at.load(Ordering::Relaxed) {
            st.oversize_bases.insert(base);
            st.oversize_segments.increase(1);
        } else if !up && st.oversize_bases.remove(&base) {
            st.oversize_segments.decrease(1);
        }
    }
}

/// Every `Stat` of the block figures, paired with the same one of `base`.
fn stat_pairs<'a>(
    m: &'a mut BlockStats,
    base: &'a BlockStats,
) -> impl Iterator<Item = (&'a mut Stat, &'a Stat)> {
    let groups = [
        (&mut m.allocated_bytes, &base.allocated_bytes),
        (&mut m.reserved_bytes, &base.reserved_bytes),
        (&mut m.active_bytes, &base.active_bytes),
        (&mut m.inactive_split_bytes, &base.inactive_split_bytes),
        (&mut m.requested_bytes, &base.requested_bytes),
        (&mut m.allocation, &base.allocation),
        (&mut m.segment, &base.segment),
        (&mut m.active, &base.active),
        (&mut m.inactive_split, &base.inactive_split),
    ];
    groups.into_iter().flat_map(|(g, b)| {
        [
            (&mut g.all, &b.all),
            (&mut g.small_pool, &b.small_pool),
            (&mut g.large_pool, &b.large_pool),
            (&mut g.persistent, &b.persistent),
            (&mut g.transient, &b.transient),
        ]
    })
}

/// `m` with the accumulated figures of `base` subtracted: every `Stat`'s allocated and freed,
/// the counters PyTorch's `reset_accumulated_memory_stats` resets (and `locked_allocations`,
/// which must restart with the count of allocations), and the expandable-segment
/// counters (maps and unmaps count in PyTorch's `num_device_alloc` and `num_device_free`) unless
/// `keep_maps` (`Broken::ResetKeepsMaps`). (Saturating: a reader racing a reset may combine a
/// snapshot from before it with the figures saved by it.)
pub(super) fn since(mut m: MemoryStats, base: &MemoryStats, keep_maps: bool) -> MemoryStats {
    let sub = |s: &mut Stat, b: &Stat| {
        s.allocated = s.allocated.saturating_sub(b.allocated);
        s.freed = s.freed.saturating_sub(b.freed);
    };
    for (s, b) in stat_pairs(&mut m.blocks, &base.blocks) {
        sub(s, b);
    }
    sub(&mut m.oversize_allocations, &base.oversize_allocations);
    sub(&mut m.oversize_segments, &base.oversize_segments);
    for (v, b) in [
        (&mut m.num_alloc_retries, base.num_alloc_retries),
        (&mut m.num_ooms, base.num_ooms),
        (&mut m.num_device_alloc, base.num_device_alloc),
        (&mut m.num_device_free, base.num_device_free),
        (&mut m.num_host_syncs, base.num_host_syncs),
        (&mut m.num_sync_all_streams, base.num_sync_all_streams),
        (&mut m.num_oom_rejections, base.num_oom_rejections),
        // Restarts with `allocation`'s total, which counts the same allocations.
        (&mut m.locked_allocations, base.locked_allocations),
    ] {
        *v = v.saturating_sub(b);
    }
    if !keep_maps {
        for (v, b) in [
            (&mut m.num_device_map, base.num_device_map),
            (&mut m.num_device_unmap, base.num_device_unmap),
            (&mut m.num_physical_create, base.num_physical_create),
            (&mut m.num_physical_release, base.num_physical_release),
            (&mut m.num_pages_moved, base.num_pages_moved),
        ] {
            *v = v.saturating_sub(b);
        }
    }
    m
}

impl<D: Device> Allocator<D> {
    /// `torch.cuda.memory_stats()`: [`Allocator::stats`] as PyTorch's flat, sorted dictionary
    /// (see [`MemoryStats::to_pytorch`]), so code and tests written against PyTorch's keys read
    /// the same figures.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::{Allocator, Config, SimDevice, StreamId};
    /// let alloc = Allocator::new(Arc::new(SimDevice::new(1 << 30)), Config::default()).unwrap();
    /// let b = alloc.alloc(1000, StreamId::DEFAULT).unwrap();
    /// let m = alloc.memory_stats();
    /// assert_eq!(m["allocated_bytes.all.current"], 1024);
    /// assert_eq!(m["requested_bytes.small_pool.current"], 1000);
    /// assert_eq!(m["reserved_bytes.all.current"], 2 << 20);
    /// assert_eq!((m["num_device_alloc"], m["max_split_size"]), (1, -1));
    /// drop(b);
    /// ```
    pub fn memory_stats(&self) -> std::collections::BTreeMap<String, i64> {
        self.stats().to_pytorch(self.config().sizing.max_split_size)
    }

    /// Resets the accumulated statistics, PyTorch's `reset_accumulated_memory_stats`: the
    /// `allocated` and `freed` totals of every [`Stat`] (block figures and oversize
    /// figures), and `num_alloc_retries`, `num_ooms`, `num_device_alloc`, `num_device_free`,
    /// `num_host_syncs`, `num_sync_all_streams`, `num_oom_rejections` and the
    /// expandable-segment counters (maps,
    /// unmaps, physical creates and releases, page moves) start again from zero. Current values and
    /// peaks are kept ([`Allocator::reset_peak_stats`] resets those). Called on the general
    /// allocator, it resets its private pools' figures too ([`crate::MemPool`]s, CUDA graphs'
    /// pools), as PyTorch's covers every pool of the device
    /// ([`crate::MemPool::reset_accumulated_stats`] resets one pool's alone).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::{Allocator, Config, SimDevice, StreamId};
    /// let alloc = Allocator::new(Arc::new(SimDevice::new(1 << 30)), Config::default()).unwrap();
    /// let keep = alloc.alloc(4096, StreamId::DEFAULT).unwrap();
    /// drop(alloc.alloc(512, StreamId::DEFAULT).unwrap());
    /// alloc.reset_accumulated_stats();
    /// let s = alloc.stats();
    /// assert_eq!(s.blocks.allocated_bytes.all.current, 4096);
    /// assert_eq!((s.blocks.allocated_bytes.all.allocated, s.num_device_alloc), (0, 0));
    /// drop(keep);
    /// ```
    pub fn reset_accumulated_stats(&self) {
        self.shared.reset_accumulated();
        for pool in self.shared.family_pools() {
            pool.reset_accumulated();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_subtracts_totals_and_counters_only() {
        let mut m = MemoryStats::default();
        m.blocks.allocated_bytes.large_pool =
            Stat { current: 5, peak: 9, allocated: 20, freed: 15 };
        m.oversize_segments = Stat { current: 1, peak: 2, allocated: 3, freed: 2 };
        m.num_ooms = 4;
        m.num_sync_all_streams = 3;
        m.locked_allocations = 6;
        m.num_device_alloc = 7;
        m.num_device_map = 5;
        m.virtual_reserved_bytes = 8;
        let mut base = m.clone();
        base.blocks.allocated_bytes.large_pool.allocated = 18;
        base.blocks.allocated_bytes.large_pool.freed = 15;
        base.num_device_alloc = 6;
        base.num_device_map = 2;
        assert_eq!(since(m.clone(), &base, true).num_device_map, 5);
        let r = since(m, &base, false);
        assert_eq!(
            r.blocks.allocated_bytes.large_pool,
            Stat { current: 5, peak: 9, allocated: 2, freed: 0 }
        );
        assert_eq!(r.oversize_segments, Stat { current: 1, peak: 2, allocated: 0, freed: 0 });
        assert_eq!((r.num_ooms, r.num_sync_all_streams, r.num_device_alloc), (0, 0, 1));
        assert_eq!(r.locked_allocations, 0);
        assert_eq!((r.num_device_map, r.virtual_reserved_bytes), (3, 8));
    }
}

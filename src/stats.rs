//! Memory statistics with PyTorch's names, so `torch.cuda.memory_stats()` readers feel at home.
//!
//! Every byte or count figure is a [`Stat`] (current, peak, cumulative allocated and freed), kept
//! per [`StatGroup`]: the whole allocator, the small and the large pool, and persistent and
//! transient residency. One change updates three cells: `all`, its pool and its residency.

pub use crate::types::{BlockStats, Bytes, PoolKind, Residency, Stat, StatGroup};
use std::collections::BTreeMap;

/// Everything [`crate::Allocator::stats`] reports.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct MemoryStats {
    /// Block-level figures (allocated, reserved, active, inactive split, requested, counts).
    pub blocks: BlockStats,
    /// Allocations that had to free cached memory and retry.
    pub num_alloc_retries: u64,
    /// Allocations that failed with out-of-memory: counted once the out-of-memory ladder gave
    /// up (a request a rung rescued — the caller's idle memory, a dropped graph's pool, the
    /// `use_on_oom` pools, the other allocators' caches — is not), once per round of the
    /// observers' retries.
    pub num_ooms: u64,
    /// Segments reserved from the device (`cuMemAlloc` calls that succeeded).
    pub num_device_alloc: u64,
    /// Segments released to the device (`cuMemFree` calls).
    pub num_device_free: u64,
    /// Host synchronisations the allocator caused (releases, event waits). A wait the device
    /// refused (one a capture underway forbids, a failing device) kept the host waiting for
    /// nothing and is not counted.
    pub num_host_syncs: u64,
    /// Best-fit searches of the pool (allocations not served by a scope's cache or plan).
    pub best_fit_searches: u64,
    /// Allocation attempts that took the allocator's global lock (its whole path): every
    /// non-empty request that no stream cache served lock-free, refused ones included, and
    /// each retry after an out-of-memory (a failure callback's, or one after private pools gave
    /// memory back) counted again. [`MemoryStats::lock_free_allocations`] is what it leaves:
    /// the share that sets the allocator's speed on a workload (`tidepool replay` prints it).
    pub locked_allocations: u64,
    /// Allocations of named scopes served from their learned plan.
    pub plan_hits: u64,
    /// Planned allocations served from the pool instead, because an escaped buffer of an
    /// earlier run still held their slice (or the region could not be reserved).
    pub plan_misses: u64,
    /// Runs of named scopes that diverged from their plan (or ended early); each relearns.
    pub plan_fallbacks: u64,
    /// Bytes of the regions that learned plans live in.
    pub plan_region_bytes: u64,
    /// Scope allocations still live when their scope ended.
    pub scope_escapes: u64,
    /// Bytes of free blocks cached per stream (stream id, bytes), streams with none omitted:
    /// the pool's free blocks of the stream plus its fast-path cache.
    pub cached_free_bytes_per_stream: Vec<(u32, u64)>,
    /// Bytes of freed blocks held in the per-stream fast-path caches (counted as freed in
    /// `blocks`, not yet returned to the pool's free lists).
    pub cached_fast_bytes: u64,
    /// Expandable segments: whether they are in use (asked for, and the device has virtual
    /// memory). Their mapped pages count in `blocks.reserved_bytes`.
    pub expandable_segments: bool,
    /// Expandable segments: bytes of virtual addresses reserved (free, but finite).
    pub virtual_reserved_bytes: u64,
    /// Expandable segments: pages mapped (`cuMemMap` calls), moved pages included.
    pub num_device_map: u64,
    /// Expandable segments: pages unmapped (`cuMemUnmap` calls), moved pages included.
    pub num_device_unmap: u64,
    /// Expandable segments: physical pages created (`cuMemCreate` calls).
    pub num_physical_create: u64,
    /// Expandable segments: physical pages released (`cuMemRelease` calls).
    pub num_physical_release: u64,
    /// Expandable segments: free pages another stream had cached, moved to a stream that ran out
    /// (unmapped there, mapped here: no new physical memory). Pages a growth took and then gave
    /// back, to their stream or to the device, because the growth failed are not counted.
    pub num_pages_moved: u64,
    /// Waits for every pending event, all streams' (PyTorch's `num_sync_all_streams`): the
    /// out-of-memory ladder's, [`crate::Allocator::empty_cache`]'s,
    /// [`crate::Allocator::synchronize`]'s and `destroy_stream`'s.
    pub num_sync_all_streams: u64,
    /// Reservations refused before the device was asked, with no cache released and no retry
    /// (`throw_on_cudamalloc_oom`, PyTorch's `num_oom_rejections`); not in `num_ooms`.
    pub num_oom_rejections: u64,
    /// Live allocations of blocks of at least `max_split_size` (PyTorch's
    /// `oversize_allocations`; none while `max_split_size_mb` is unset).
    pub oversize_allocations: Stat,
    /// Ordinary segments of at least `max_split_size` (PyTorch's `oversize_segments`).
    pub oversize_segments: Stat,
}

impl MemoryStats {
    /// Allocations the stream caches served with no lock: `blocks.allocation.all.allocated`
    /// less [`MemoryStats::locked_allocations`] (0 where refused attempts outnumber them).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::{Allocator, Config, SimDevice, StreamId};
    /// let alloc = Allocator::new(Arc::new(SimDevice::new(1 << 30)), Config::default()).unwrap();
    /// for _ in 0..3 {
    ///     drop(alloc.alloc(4096, StreamId::DEFAULT).unwrap());
    /// }
    /// let s = alloc.stats();
    /// // The first took the lock; the other two were hits of the stream's cache.
    /// assert_eq!((s.locked_allocations, s.lock_free_allocations()), (1, 2));
    /// ```
    pub fn lock_free_allocations(&self) -> u64 {
        self.blocks.allocation.all.allocated.saturating_sub(self.locked_allocations)
    }

    /// Adds another allocator's statistics (several devices' totals, say): block figures as in
    /// [`crate::Stat::accumulate`] (peaks are the sum of the peaks), counters summed, per-stream
    /// cached bytes listed one after the other.
    pub fn accumulate(&mut self, other: &MemoryStats) {
        self.blocks.accumulate(&other.blocks);
        self.num_alloc_retries += other.num_alloc_retries;
        self.num_ooms += other.num_ooms;
        self.num_device_alloc += other.num_device_alloc;
        self.num_device_free += other.num_device_free;
        self.num_host_syncs += other.num_host_syncs;
        self.best_fit_searches += other.best_fit_searches;
        self.locked_allocations += other.locked_allocations;
        self.plan_hits += other.plan_hits;
        self.plan_misses += other.plan_misses;
        self.plan_fallbacks += other.plan_fallbacks;
        self.plan_region_bytes += other.plan_region_bytes;
        self.scope_escapes += other.scope_escapes;
        self.cached_free_bytes_per_stream.extend_from_slice(&other.cached_free_bytes_per_stream);
        self.cached_fast_bytes += other.cached_fast_bytes;
        self.expandable_segments |= other.expandable_segments;
        self.virtual_reserved_bytes += other.virtual_reserved_bytes;
        self.num_device_map += other.num_device_map;
        self.num_device_unmap += other.num_device_unmap;
        self.num_physical_create += other.num_physical_create;
        self.num_physical_release += other.num_physical_release;
        self.num_pages_moved += other.num_pages_moved;
        self.num_sync_all_streams += other.num_sync_all_streams;
        self.num_oom_rejections += other.num_oom_rejections;
        self.oversize_allocations.accumulate(&other.oversize_allocations);
        self.oversize_segments.accumulate(&other.oversize_segments);
    }

    /// 1 − peak requested / peak reserved: the share of the reserved peak that no request needed.
    /// Zero before anything was reserved.
    pub fn fragmentation(&self) -> f64 {
        let reserved = self.blocks.reserved_bytes.all.peak;
        if reserved == 0 {
            return 0.0;
        }
        1.0 - self.blocks.requested_bytes.all.peak as f64 / reserved as f64
    }

    /// The flat dictionary `torch.cuda.memory_stats()` returns, key for key, sorted:
    /// `"{stat}.{all|small_pool|large_pool}.{current|peak|allocated|freed}"` for PyTorch's nine
    /// block figures, `oversize_allocations.*` and `oversize_segments.*`, `num_alloc_retries`,
    /// `num_ooms`, `num_oom_rejections`, `num_sync_all_streams`, `num_device_alloc` and
    /// `num_device_free` (as in
    /// PyTorch, device calls of both kinds: segment allocations and page maps, segment frees
    /// and page unmaps), and `max_split_size` (`-1`: unlimited). tidepool's residency groups
    /// follow PyTorch's pattern as `"{stat}.{persistent|transient}.*"`.
    pub fn to_pytorch(&self, max_split_size: u64) -> BTreeMap<String, i64> {
        let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let mut out = BTreeMap::new();
        let mut stat = |name: &str, s: &Stat| {
            for (field, v) in s.fields() {
                out.insert(format!("{name}.{field}"), n(v));
            }
        };
        let b = &self.blocks;
        for (name, g) in [
            ("allocation", &b.allocation),
            ("segment", &b.segment),
            ("active", &b.active),
            ("inactive_split", &b.inactive_split),
            ("allocated_bytes", &b.allocated_bytes),
            ("reserved_bytes", &b.reserved_bytes),
            ("active_bytes", &b.active_bytes),
            ("inactive_split_bytes", &b.inactive_split_bytes),
            ("requested_bytes", &b.requested_bytes),
        ] {
            for (group, s) in [
                ("all", &g.all),
                ("small_pool", &g.small_pool),
                ("large_pool", &g.large_pool),
                ("persistent", &g.persistent),
                ("transient", &g.transient),
            ] {
                stat(&format!("{name}.{group}"), s);
            }
        }
        stat("oversize_allocations", &self.oversize_allocations);
        stat("oversize_segments", &self.oversize_segments);
        let device_alloc = self.num_device_alloc.saturating_add(self.num_device_map);
        let device_free = self.num_device_free.saturating_add(self.num_device_unmap);
        for (key, v) in [
            ("num_alloc_retries", n(self.num_alloc_retries)),
            ("num_ooms", n(self.num_ooms)),
            ("num_sync_all_streams", n(self.num_sync_all_streams)),
            ("num_oom_rejections", n(self.num_oom_rejections)),
            ("num_device_alloc", n(device_alloc)),
            ("num_device_free", n(device_free)),
            ("max_split_size", if max_split_size == u64::MAX { -1 } else { n(max_split_size) }),
        ] {
            out.insert(key.to_string(), v);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_tracks_peak_and_totals() {
        let mut s = Stat::default();
        s.increase(10);
        s.increase(5);
        s.decrease(12);
        s.increase(4);
        assert_eq!(s, Stat { current: 7, peak: 15, allocated: 19, freed: 12 });
        s.reset_peak();
        assert_eq!(s.peak, 7);
    }

    #[test]
    fn group_updates_three_cells() {
        let mut g = StatGroup::default();
        g.increase(PoolKind::Small, Residency::Persistent, 512);
        g.increase(PoolKind::Large, Residency::Transient, 2048);
        g.decrease(PoolKind::Small, Residency::Persistent, 512);
        assert_eq!(g.all.current, 2048);
        assert_eq!(g.all.peak, 2560);
        assert_eq!(g.small_pool, Stat { current: 0, peak: 512, allocated: 512, freed: 512 });
        assert_eq!(g.large_pool.current, 2048);
        assert_eq!(g.persistent.current, 0);
        assert_eq!(g.transient.current, 2048);
    }

    #[test]
    fn bytes_format() {
        assert_eq!(Bytes(0).to_string(), "0 B");
        assert_eq!(Bytes(1023).to_string(), "1023 B");
        assert_eq!(Bytes(1536).to_string(), "1.50 KiB");
        assert_eq!(Bytes(20 << 20).to_string(), "20.00 MiB");
        assert_eq!(Bytes(3 << 30).to_string(), "3.00 GiB");
        assert_eq!(format!("{:>10}", Bytes(512)), "     512 B");
    }
}

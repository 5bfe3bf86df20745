//! [`HostStats`]: the pinned allocator's statistics, with the device allocator's names and
//! PyTorch's `host_memory_stats()` keys.

use crate::types::{DurationStat, Stat};
use std::collections::BTreeMap;

/// What [`HostAllocator::stats`] reports, with the device allocator's names. Bytes are block
/// bytes (the size class, or the request where [`HostConfig`] leaves it unrounded) except
/// `requested_bytes`.
///
/// [`HostAllocator::stats`]: crate::HostAllocator::stats
/// [`HostConfig`]: crate::HostConfig
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HostStats {
    /// Bytes of blocks handed to live [`PinnedBuffer`](crate::PinnedBuffer)s.
    pub allocated_bytes: Stat,
    /// Bytes of pinned memory held from the device (live, pending and free blocks).
    pub reserved_bytes: Stat,
    /// Bytes of blocks live or freed but still waiting on their copies' events.
    pub active_bytes: Stat,
    /// Bytes asked for by live buffers (before rounding).
    pub requested_bytes: Stat,
    /// Number of live buffers.
    pub allocation: Stat,
    /// Number of pinned allocations held (`cuMemHostAlloc` not yet freed).
    pub segment: Stat,
    /// Number of blocks live or waiting on events.
    pub active: Stat,
    /// `cuMemHostAlloc` calls that succeeded.
    pub num_host_alloc: u64,
    /// `cuMemFreeHost` calls that succeeded.
    pub num_host_free: u64,
    /// Allocations that freed the cache and retried.
    pub num_alloc_retries: u64,
    /// Allocations that failed for want of pinned memory (after the other pinned allocators'
    /// caches were freed: one they rescued is not counted).
    pub num_ooms: u64,
    /// Host synchronisations: accessors waiting on copies, device synchronisations.
    pub num_host_syncs: u64,
    /// Bytes of free blocks ready for reuse (now).
    pub cached_bytes: u64,
    /// Bytes of freed blocks still waiting on their copies' events (now).
    pub pending_bytes: u64,
    /// Bytes of freed blocks that work captured into a CUDA graph copies to or from: never
    /// reused nor freed (a replay may run at any time), counted as active (now).
    pub captured_bytes: u64,
    /// Time in successful `cuMemHostAlloc` calls (one per `num_host_alloc`).
    pub host_alloc_time: DurationStat,
    /// Time in successful `cuMemFreeHost` calls (one per `num_host_free`).
    pub host_free_time: DurationStat,
}

impl HostStats {
    /// Every [`Stat`] of the struct.
    fn stats_mut(&mut self) -> [&mut Stat; 7] {
        [
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.requested_bytes,
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
        ]
    }

    /// Sets every peak to its current value.
    pub fn reset_peak(&mut self) {
        self.stats_mut().into_iter().for_each(Stat::reset_peak);
        self.host_alloc_time.reset_peak();
        self.host_free_time.reset_peak();
    }

    /// Zeroes every cumulative figure (PyTorch's `reset_accumulated_host_memory_stats`): each
    /// [`Stat`]'s `allocated` and `freed`, the call counters and the timings' totals and counts.
    /// Current values, peaks, `cached_bytes` and `pending_bytes` stay.
    pub fn reset_accumulated(&mut self) {
        self.stats_mut().into_iter().for_each(Stat::reset_accumulated);
        self.num_host_alloc = 0;
        self.num_host_free = 0;
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_host_syncs = 0;
        self.host_alloc_time.reset_accumulated();
        self.host_free_time.reset_accumulated();
    }

    /// The flat dictionary `torch.cuda.host_memory_stats()` returns, with the keys of
    /// PyTorch's current `test_host_memory_stats`, sorted.
    /// PyTorch's names count differently from this struct's, so the mapping is:
    ///
    /// | PyTorch key              | from                        | what it counts                       |
    /// |--------------------------|-----------------------------|--------------------------------------|
    /// | `allocations.*`          | [`Self::segment`]           | pinned blocks held (live, waiting, free) |
    /// | `allocated_bytes.*`      | [`Self::reserved_bytes`]    | their bytes (size classes)           |
    /// | `active_requests.*`      | [`Self::active`]            | blocks live or waiting on their copies |
    /// | `active_bytes.*`         | [`Self::active_bytes`]      | their bytes                          |
    /// | `num_host_alloc`, `num_host_free` | the same fields    | successful device calls              |
    /// | `host_alloc_time.*`, `host_free_time.*` | the same fields | `total`, `max`, `min`, `count`, `avg` in µs |
    ///
    /// Each `*` above is `current`, `peak`, `allocated` and `freed`. PyTorch sums per-size-class
    /// peaks (its docs call them "a best-effort approximation of the true peak"); these peaks
    /// are exact. (Earlier PyTorch named them `allocation`, `segment`, `allocated_bytes` and
    /// `reserved_bytes`, with `allocated_bytes` then meaning the bytes handed out.)
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::{HostAllocator, SimDevice};
    ///
    /// let pinned = HostAllocator::new(Arc::new(SimDevice::new(1 << 20)));
    /// let buf = pinned.alloc(40 << 10).unwrap(); // 40 KiB: a 64 KiB block
    /// let stats = pinned.stats().to_pytorch();
    /// assert_eq!(stats["allocations.current"], 1);
    /// assert_eq!(stats["allocated_bytes.current"], 64 << 10);
    /// assert_eq!(stats["active_requests.current"], 1);
    /// assert_eq!(stats["num_host_alloc"], 1);
    /// assert_eq!(stats["host_alloc_time.count"], 1);
    /// drop(buf); // no copy used it: free at once, still held
    /// let stats = pinned.stats().to_pytorch();
    /// assert_eq!((stats["allocations.current"], stats["active_requests.current"]), (1, 0));
    /// ```
    pub fn to_pytorch(&self) -> BTreeMap<String, i64> {
        let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let mut out = BTreeMap::new();
        for (name, s) in [
            ("allocations", &self.segment),
            ("allocated_bytes", &self.reserved_bytes),
            ("active_requests", &self.active),
            ("active_bytes", &self.active_bytes),
        ] {
            for (field, v) in s.fields() {
                out.insert(format!("{name}.{field}"), n(v));
            }
        }
        for (name, t) in
            [("host_alloc_time", &self.host_alloc_time), ("host_free_time", &self.host_free_time)]
        {
            for (field, v) in [
                ("total", t.total_us),
                ("max", t.max_us),
                ("min", t.min_us),
                ("count", t.count),
                ("avg", t.avg_us()),
            ] {
                out.insert(format!("{name}.{field}"), n(v));
            }
        }
        out.insert("num_host_alloc".to_string(), n(self.num_host_alloc));
        out.insert("num_host_free".to_string(), n(self.num_host_free));
        out
    }
}

//! Figures with PyTorch's names: a [`Stat`] (current, peak, cumulative allocated and freed) per
//! [`StatGroup`] (the whole allocator, the small and the large pool, persistent and transient
//! residency), and the block-level set the pool keeps exact ([`BlockStats`]). One change updates
//! three cells: `all`, its pool and its residency.

use super::{PoolKind, Residency};

/// One figure: current value, peak since the last reset, and cumulative increases / decreases.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    /// The value now.
    pub current: u64,
    /// The highest `current` since creation or [`Stat::reset_peak`].
    pub peak: u64,
    /// Sum of every increase.
    pub allocated: u64,
    /// Sum of every decrease.
    pub freed: u64,
}

impl Stat {
    /// Adds `n` to the current value.
    pub(crate) fn increase(&mut self, n: u64) {
        self.current += n;
        self.allocated += n;
        self.peak = self.peak.max(self.current);
    }

    /// Subtracts `n` from the current value.
    pub(crate) fn decrease(&mut self, n: u64) {
        debug_assert!(self.current >= n, "stat underflow: {} - {n}", self.current);
        self.current -= n;
        self.freed += n;
    }

    /// Sets the peak to the current value.
    pub fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    /// The four figures under PyTorch's names: `current`, `peak`, `allocated`, `freed`.
    pub fn fields(&self) -> [(&'static str, u64); 4] {
        [
            ("current", self.current),
            ("peak", self.peak),
            ("allocated", self.allocated),
            ("freed", self.freed),
        ]
    }

    /// Zeroes the cumulative increases and decreases (PyTorch's `reset_accumulated`); the
    /// current value and the peak stay.
    pub fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }

    /// Adds another allocator's figure: currents and totals add; the peak becomes the sum of
    /// the peaks (an upper bound of the peak of the sum: the two peaks may not coincide).
    pub fn accumulate(&mut self, other: &Stat) {
        self.current += other.current;
        self.peak += other.peak;
        self.allocated += other.allocated;
        self.freed += other.freed;
    }
}

/// Time spent in one kind of device call, in whole microseconds (PyTorch's `DurationStat`, as
/// `torch.cuda.host_memory_stats()` reports `host_alloc_time` and `host_free_time`).
///
/// ```
/// use tidepool::DurationStat;
///
/// let mut t = DurationStat::default();
/// t.record(30);
/// t.record(10);
/// assert_eq!((t.total_us, t.max_us, t.min_us, t.count, t.avg_us()), (40, 30, 10, 2, 20));
/// t.reset_peak(); // max and min start again with the next call; total and count stay
/// assert_eq!((t.max_us, t.min_us, t.count), (0, 0, 2));
/// t.record(20);
/// assert_eq!((t.max_us, t.min_us), (20, 20));
/// t.reset_accumulated(); // total and count start again
/// assert_eq!((t.total_us, t.count, t.avg_us()), (0, 0, 0));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DurationStat {
    /// Microseconds of every call since creation or [`DurationStat::reset_accumulated`].
    pub total_us: u64,
    /// The longest call since creation or [`DurationStat::reset_peak`] (0: none since).
    pub max_us: u64,
    /// The shortest call since creation or [`DurationStat::reset_peak`] (0: none since).
    pub min_us: u64,
    /// Calls since creation or [`DurationStat::reset_accumulated`].
    pub count: u64,
    /// Calls since creation or the last [`DurationStat::reset_peak`] (so a call of 0 µs is a
    /// minimum, not "none").
    calls_since_peak: u64,
}

impl DurationStat {
    /// Counts one call that took `us` microseconds.
    pub fn record(&mut self, us: u64) {
        self.total_us = self.total_us.saturating_add(us);
        self.count += 1;
        self.max_us = self.max_us.max(us);
        self.min_us = if self.calls_since_peak == 0 { us } else { self.min_us.min(us) };
        self.calls_since_peak += 1;
    }

    /// The mean call, in whole microseconds (0 before any call).
    pub fn avg_us(&self) -> u64 {
        self.total_us.checked_div(self.count).unwrap_or(0)
    }

    /// Forgets the longest and the shortest call (PyTorch's `reset_peak`).
    pub fn reset_peak(&mut self) {
        self.max_us = 0;
        self.min_us = 0;
        self.calls_since_peak = 0;
    }

    /// Zeroes the total and the count (PyTorch's `reset_accumulated`).
    pub fn reset_accumulated(&mut self) {
        self.total_us = 0;
        self.count = 0;
    }
}

/// A [`Stat`] for the whole allocator and per pool and residency.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatGroup {
    /// Everything.
    pub all: Stat,
    /// Blocks of the small pool.
    pub small_pool: Stat,
    /// Blocks of the large pool.
    pub large_pool: Stat,
    /// Persistent blocks.
    pub persistent: Stat,
    /// Transient blocks.
    pub transient: Stat,
}

impl StatGroup {
    /// Adds another allocator's group, cell by cell (see [`Stat::accumulate`]).
    pub fn accumulate(&mut self, other: &StatGroup) {
        self.all.accumulate(&other.all);
        self.small_pool.accumulate(&other.small_pool);
        self.large_pool.accumulate(&other.large_pool);
        self.persistent.accumulate(&other.persistent);
        self.transient.accumulate(&other.transient);
    }

    /// Adds `n` to `all` and to the cells of `kind` and `residency`.
    pub(crate) fn increase(&mut self, kind: PoolKind, residency: Residency, n: u64) {
        self.all.increase(n);
        self.pool_mut(kind).increase(n);
        self.residency_mut(residency).increase(n);
    }

    /// Subtracts `n` from `all` and from the cells of `kind` and `residency`.
    pub(crate) fn decrease(&mut self, kind: PoolKind, residency: Residency, n: u64) {
        self.all.decrease(n);
        self.pool_mut(kind).decrease(n);
        self.residency_mut(residency).decrease(n);
    }

    /// The cell of one pool.
    pub fn pool(&self, kind: PoolKind) -> &Stat {
        match kind {
            PoolKind::Small => &self.small_pool,
            PoolKind::Large => &self.large_pool,
        }
    }

    fn pool_mut(&mut self, kind: PoolKind) -> &mut Stat {
        match kind {
            PoolKind::Small => &mut self.small_pool,
            PoolKind::Large => &mut self.large_pool,
        }
    }

    fn residency_mut(&mut self, residency: Residency) -> &mut Stat {
        match residency {
            Residency::Persistent => &mut self.persistent,
            Residency::Transient => &mut self.transient,
        }
    }

    /// Resets every peak to its current value.
    pub fn reset_peak(&mut self) {
        for s in [
            &mut self.all,
            &mut self.small_pool,
            &mut self.large_pool,
            &mut self.persistent,
            &mut self.transient,
        ] {
            s.reset_peak();
        }
    }
}

/// The block-level figures the pool keeps exact after every operation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockStats {
    /// Bytes in blocks handed to users (rounded sizes).
    pub allocated_bytes: StatGroup,
    /// Bytes in segments reserved from the device.
    pub reserved_bytes: StatGroup,
    /// Bytes in blocks allocated or freed but still waiting on events.
    pub active_bytes: StatGroup,
    /// Bytes in free blocks of segments that are split (not releasable).
    pub inactive_split_bytes: StatGroup,
    /// Bytes users asked for, in active blocks (before rounding).
    pub requested_bytes: StatGroup,
    /// Number of blocks handed to users.
    pub allocation: StatGroup,
    /// Number of segments.
    pub segment: StatGroup,
    /// Number of active blocks.
    pub active: StatGroup,
    /// Number of free blocks in split segments.
    pub inactive_split: StatGroup,
}

impl BlockStats {
    /// Adds another allocator's figures, group by group (see [`Stat::accumulate`]).
    pub fn accumulate(&mut self, other: &BlockStats) {
        self.allocated_bytes.accumulate(&other.allocated_bytes);
        self.reserved_bytes.accumulate(&other.reserved_bytes);
        self.active_bytes.accumulate(&other.active_bytes);
        self.inactive_split_bytes.accumulate(&other.inactive_split_bytes);
        self.requested_bytes.accumulate(&other.requested_bytes);
        self.allocation.accumulate(&other.allocation);
        self.segment.accumulate(&other.segment);
        self.active.accumulate(&other.active);
        self.inactive_split.accumulate(&other.inactive_split);
    }

    /// Resets every peak to its current value.
    pub fn reset_peak(&mut self) {
        for g in [
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
        ] {
            g.reset_peak();
        }
    }
}

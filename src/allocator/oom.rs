//! The out-of-memory report: the breakdown an [`AllocError::OutOfMemory`] carries.

use super::*;

/// Whether this thread is retrying a request after an inner rung of the out-of-memory ladder
/// released something (a peer's cache, a pool's, what dropped graphs held): the first attempt
/// counted the request's `num_ooms` and noted its history `oom` entry, so a retry that fails
/// again counts and notes nothing. (It used to count a second time and take the count back in
/// a later lock section: a read in between saw two failures, and a reset of the accumulated
/// figures in between lost the request's; and the history had an `oom` entry per attempt,
/// where PyTorch notes one per failed `malloc`.)
mod retry {
    use std::cell::Cell;

    #[cfg(not(loom))]
    std::thread_local! {
        static RETRYING: Cell<bool> = const { Cell::new(false) };
    }
    #[cfg(loom)]
    loom::thread_local! {
        static RETRYING: Cell<bool> = Cell::new(false);
    }

    /// Whether this thread's current attempt is such a retry.
    pub(in crate::allocator) fn retrying() -> bool {
        !cfg!(tidepool_broken = "oom_counted_twice") && RETRYING.with(Cell::get)
    }

    /// Runs `f` as a retry (see [`retrying`]); the flag is restored however `f` ends.
    pub(in crate::allocator) fn as_retry<T>(f: impl FnOnce() -> T) -> T {
        struct Restore(bool);
        impl Drop for Restore {
            fn drop(&mut self) {
                RETRYING.with(|r| r.set(self.0));
            }
        }
        let _restore = Restore(RETRYING.with(|r| r.replace(true)));
        f()
    }
}
pub(super) use retry::{as_retry, retrying};

impl<D: Device> Shared<D> {
    /// Takes back one count of `num_ooms` (broken build `oom_counted_twice` only: the retry
    /// of an inner rung counted a second failure, taken back here in a lock section of its
    /// own).
    #[cfg(tidepool_broken = "oom_counted_twice")]
    #[cold]
    pub(super) fn uncount_oom(&self) {
        let mut st = self.lock_state();
        st.counters.ooms = st.counters.ooms.saturating_sub(1);
    }

    pub(super) fn oom_report(
        &self,
        st: &State,
        config: &Config,
        key: PoolKey,
        bytes: u64,
        rounded: u64,
        seg_size: u64,
    ) -> OomReport {
        let info = self
            .device
            .mem_info()
            .unwrap_or(crate::device::MemInfo { free: 0, total: self.device_total });
        let s = st.pool.stats();
        let ranges = self.range_infos(st);
        let mapped_free = ranges.iter().map(|r| r.free_bytes).sum();
        let in_used_pages = ranges.iter().map(|r| r.free_bytes - r.free_page_bytes).sum();
        let persistent = ranges
            .iter()
            .filter(|r| r.residency == Residency::Persistent)
            .map(|r| r.free_page_bytes)
            .sum();
        // Under the cap with this allocator: every allocator and private pool of its family,
        // this one counted at its reserved bytes now (its share of the total may still hold a
        // charge a failed reservation made).
        let reserved = s.reserved_bytes.all.current;
        let others = self.family.reserved.load(Ordering::Acquire).saturating_sub(st.family_share);
        OomReport {
            requested: bytes,
            rounded,
            segment: seg_size,
            stream: key.stream,
            device_free: info.free,
            device_total: info.total,
            limit: config.limit(self.device_total),
            reserved,
            // BROKEN (`oom_family_unreported`): this allocator's alone; the cap seemed far.
            family_reserved: match cfg!(tidepool_broken = "oom_family_unreported") {
                true => reserved,
                false => reserved + others,
            },
            allocated: s.allocated_bytes.all.current,
            largest_free_block: st.pool.largest_free_block(),
            inactive_split: s.inactive_split_bytes.all.current,
            free_on_other_streams: st.pool.free_bytes_where(|k| k.stream != key.stream),
            waiting_on_events: s.active_bytes.all.current - s.allocated_bytes.all.current,
            persistent_reserved: s.reserved_bytes.persistent.current,
            transient_reserved: s.reserved_bytes.transient.current,
            mapped_free,
            mapped_free_in_used_pages: in_used_pages,
            mapped_free_persistent: persistent,
            rejected: false,
        }
    }

    /// `throw_on_cudamalloc_oom`: whether reserving `add` more bytes would take the family's
    /// reserved memory past the cap (the device's total where none is set). Such a
    /// reservation is refused before the device is asked, and the ladder is not climbed.
    pub(super) fn rejects(&self, st: &mut State, config: &Config, add: u64) -> bool {
        config.throw_on_oom
            && !cfg!(tidepool_broken = "rejection_ignored")
            && self.family_reserved(st).saturating_add(add)
                > config.limit(self.device_total).unwrap_or(self.device_total)
    }

    /// The error of a rejected reservation (see [`Shared::rejects`]), counted in
    /// `num_oom_rejections`; as in PyTorch, not in `num_ooms` and with no `oom` history entry.
    #[cold]
    pub(super) fn rejection(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        (bytes, rounded, seg_size): (u64, u64, u64),
    ) -> AllocError {
        st.counters.oom_rejections += 1;
        let mut report = self.oom_report(st, config, key, bytes, rounded, seg_size);
        report.rejected = true;
        AllocError::OutOfMemory(Box::new(report))
    }
}

/// What a reservation refused by [`Shared::rejects`] returns to the ladder that asked for it
/// (which then returns [`Shared::rejection`] instead of climbing).
pub(super) fn rejected() -> AllocError {
    AllocError::OutOfMemory(Box::new(OomReport { rejected: true, ..OomReport::default() }))
}

/// Whether `r` is the refusal [`rejected`] makes.
pub(super) fn is_rejected<T>(r: &Result<T, AllocError>) -> bool {
    matches!(r, Err(AllocError::OutOfMemory(report)) if report.rejected)
}

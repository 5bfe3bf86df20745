//! The out-of-memory report: the breakdown an [`AllocError::OutOfMemory`] carries.

use super::*;

/// A request's failure is counted (`num_ooms`) and noted (its history `oom` entry) once the
/// ladder gives up on it (`Allocator::alloc_after_oom`), in the pool whose attempt failed, as
/// PyTorch counts and notes a failed `malloc` only after `release_cached_blocks` and the
/// `use_on_oom` pools: a request a rung rescued counts nothing. (The first failed attempt
/// counted and noted it, before any rung, so a request a peer's cache rescued read as a
/// failure; and a plan region's silently denied reservation counted one too.)
impl<D: Device> Shared<D> {
    pub(super) fn count_oom(&self, report: &OomReport) {
        let mut st = self.lock_state();
        st.counters.ooms += 1;
        let size = super::slow_path::oom_size(report.requested, report.rounded);
        // PyTorch's `oom` entry: the device's free bytes in place of an address.
        st.note(Action::Oom, DeviceAddr(report.device_free), size, report.stream);
    }
}

impl<D: Device> Shared<D> {
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
            failed_in: Default::default(),
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

//! The out-of-memory report: the breakdown an [`AllocError::OutOfMemory`] carries.

use super::*;

impl<D: Device> Shared<D> {
    /// Takes back one count of `num_ooms`: a request retried inside one allocation (after the
    /// device's other allocators released their caches) failed again, and is still one
    /// allocation that failed with out-of-memory.
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
        OomReport {
            requested: bytes,
            rounded,
            segment: seg_size,
            stream: key.stream,
            device_free: info.free,
            device_total: info.total,
            limit: config.limit(self.device_total),
            reserved: s.reserved_bytes.all.current,
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
        }
    }
}

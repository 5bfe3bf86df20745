//! What the expandable ranges report: their counters, published for lock-free readers
//! (`publish_vm`; `stats()` takes them in the base statistics' copy, `plain_counters`), one
//! [`RangeInfo`] per range (`expandable_ranges`), and `check_vm`, the invariants
//! `check_invariants` adds for them.
//!
//! ```text
//!  Vm::counts (under the lock) ──publish_vm──▶ VmPublished (atomics) ──base──▶ stats()
//!  Vm::ranges + pool          ──range_infos─▶ Vec<RangeInfo>          ──▶ expandable_ranges(),
//!                                                                          memory_summary()
//! ```

use super::expandable::*;
use super::*;
use crate::pool::Segment;
use page_table::PageTable;

impl<D: Device> Shared<D> {
    /// Publishes the counters if a path that changed them did not (a failed growth's creates
    /// and releases, a retired page's unmap): `publish` calls it as every global-lock section
    /// ends (`Broken::VmCountsUnpublished` skips it). Ranges come and go only where the
    /// counters are published.
    #[inline]
    pub(super) fn publish_vm_changes(&self, vm: &mut Vm) {
        if vm.counts.unpublished && !self.broken(Broken::VmCountsUnpublished) {
            self.publish_vm(vm);
        }
    }

    /// Copies the counters for lock-free readers.
    pub(super) fn publish_vm(&self, vm: &mut Vm) {
        vm.counts.unpublished = false;
        let p = &self.vm_published;
        let c = vm.counts;
        p.active.store(!vm.ranges.is_empty(), Ordering::Relaxed);
        p.virtual_bytes.store(vm.virtual_bytes, Ordering::Relaxed);
        p.maps.store(c.maps, Ordering::Relaxed);
        p.unmaps.store(c.unmaps, Ordering::Relaxed);
        p.creates.store(c.creates, Ordering::Relaxed);
        p.releases.store(c.releases, Ordering::Relaxed);
        p.moves.store(c.moves, Ordering::Relaxed);
    }

    /// Adds the expandable-segment figures to statistics read elsewhere: the broken build
    /// `vm_stats_apart` (they are in the base's counters, [`Shared::plain_counters`]).
    #[cfg(tidepool_broken = "vm_stats_apart")]
    pub(super) fn with_vm_stats(&self, mut m: MemoryStats) -> MemoryStats {
        let p = &self.vm_published;
        m.expandable_segments = p.active.load(Ordering::Relaxed);
        m.virtual_reserved_bytes = p.virtual_bytes.load(Ordering::Relaxed);
        m.num_device_map = p.maps.load(Ordering::Relaxed);
        m.num_device_unmap = p.unmaps.load(Ordering::Relaxed);
        m.num_physical_create = p.creates.load(Ordering::Relaxed);
        m.num_physical_release = p.releases.load(Ordering::Relaxed);
        m.num_pages_moved = p.moves.load(Ordering::Relaxed);
        m
    }

    /// Every range, as [`RangeInfo`], in address order.
    pub(super) fn range_infos(&self, st: &State) -> Vec<RangeInfo> {
        let page = st.vm.page;
        st.vm
            .ranges
            .values()
            .map(|r| {
                let (mut free, mut free_pages) = (0, 0);
                let mut runs = Vec::new();
                for &s in r.segs.values() {
                    let seg = st.pool.segment(s);
                    runs.push((DeviceAddr(seg.base), seg.size));
                    let blocks = st.pool.segment_blocks(s);
                    for (_, b) in blocks.filter(|(_, b)| b.state == BlockState::Free) {
                        free += b.size;
                        free_pages += whole_pages(r.base, page, b.addr, b.addr + b.size)
                            .map_or(0, |(a, z)| whole_chunk_bytes(&r.pages, page, a, z));
                    }
                }
                RangeInfo {
                    base: DeviceAddr(r.base),
                    virtual_size: r.size,
                    stream: r.key.stream,
                    pool: r.key.kind,
                    residency: r.key.residency,
                    mapped_bytes: r.pages.len() as u64 * page,
                    free_bytes: free,
                    free_page_bytes: free_pages,
                    runs,
                    retiring_pages: r.retiring.len(),
                    lent_bytes: r.lent.iter().map(|(&a, &e)| e - a).sum(),
                    stitches: st.vm.stitches.iter().filter(|s| s.home == r.base).count(),
                }
            })
            .collect()
    }

    /// The ranges' invariants: each pool segment of a range is a run of its mapped pages (page
    /// aligned, its key, no two runs touching), every mapped page is in a run, the segment table
    /// lists exactly the pool segments inside the range, retiring pages are in none.
    pub(super) fn check_vm(&self, st: &State) -> Result<(), String> {
        let page = st.vm.page;
        let mut in_ranges = 0usize;
        let live: HashMap<SegmentId, &Segment> = st.pool.segments().collect();
        let mut spans = st.vm.spans.clone();
        spans.sort_unstable();
        let expect: Vec<(u64, u64)> =
            st.vm.ranges.values().map(|r| (r.base, r.base + r.size)).collect();
        if spans != expect {
            return Err(format!("range spans {spans:x?} drifted from the ranges {expect:x?}"));
        }
        for r in st.vm.ranges.values() {
            if st.vm.by_key.get(&r.key) != Some(&r.base) {
                return Err(format!("range at {:#x} is not its key's", r.base));
            }
            let mut prev_end: Option<u64> = None;
            let mut pages = 0u64;
            for (&b, &s) in r.segs.iter() {
                let Some(seg) = live.get(&s) else {
                    return Err(format!("range at {:#x} lists a dead segment", r.base));
                };
                if seg.base != b || seg.key != r.key {
                    return Err(format!("range at {:#x}: segment at {b:#x} drifted", r.base));
                }
                if (seg.base - r.base) % page != 0 || seg.size % page != 0 {
                    return Err(format!("segment at {b:#x} is not page aligned"));
                }
                if seg.base + seg.size > r.base + r.size || prev_end.is_some_and(|e| e >= seg.base)
                {
                    return Err(format!(
                        "segment at {b:#x} touches another run or leaves its range"
                    ));
                }
                for va in (seg.base..seg.base + seg.size).step_by(page as usize) {
                    let Some(c) = r.pages.get(va) else {
                        return Err(format!("page at {va:#x} of a segment is not mapped"));
                    };
                    if c.lo < seg.base || c.lo + c.pages * page > seg.base + seg.size {
                        return Err(format!("the chunk at {:#x} crosses a run's edge", c.lo));
                    }
                }
                pages += seg.size / page;
                prev_end = Some(seg.base + seg.size);
            }
            for (&a, &e) in r.lent.iter() {
                pages += (e - a) / page;
                for va in (a..e).step_by(page as usize) {
                    if !r.pages.contains(va) {
                        return Err(format!("lent page at {va:#x} is not mapped"));
                    }
                }
            }
            if pages != r.pages.len() as u64 {
                return Err(format!(
                    "range at {:#x}: {} pages mapped, {pages} in its runs",
                    r.base,
                    r.pages.len()
                ));
            }
            for &va in &r.retiring {
                if r.pages.contains(va) {
                    return Err(format!("retiring page at {va:#x} is also in use"));
                }
            }
            in_ranges += r.segs.len();
        }
        self.check_stitches(st)?;
        in_ranges += st.vm.live_stitches;
        let inside = st.pool.segments().filter(|(_, s)| st.vm.contains(s.base)).count();
        if inside != in_ranges {
            return Err(format!("{inside} pool segments in ranges, {in_ranges} listed"));
        }
        let queued: u64 = st.vm.retiring.iter().flat_map(|r| &r.pages).map(|p| p.2).sum();
        let marked: u64 = st.vm.ranges.values().map(|r| r.retiring.len() as u64).sum();
        if queued != marked {
            return Err(format!("{queued} retiring pages queued, {marked} marked"));
        }
        Ok(())
    }
}

impl<D: Device> Allocator<D> {
    /// The expandable ranges (`expandable_segments:true`), in address order: what each maps and
    /// how much of it is free. The stream caches are flushed first.
    pub fn expandable_ranges(&self) -> Vec<RangeInfo> {
        self.shared.expandable_ranges()
    }
}

impl<D: Device> Shared<D> {
    /// [`Allocator::expandable_ranges`].
    pub(super) fn expandable_ranges(&self) -> Vec<RangeInfo> {
        let mut st = self.lock_state();
        self.flush_for_view(&mut st);
        self.range_infos(&st)
    }
}

/// Bytes of the chunks lying wholly inside the mapped pages `[a, z)`.
fn whole_chunk_bytes(pages: &PageTable, page: u64, a: u64, z: u64) -> u64 {
    pages.whole_chunks(a, z).map(|c| c.pages * page).sum()
}

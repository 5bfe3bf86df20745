//! Expandable segments (`expandable_segments:true`): one virtual address range per (stream, pool
//! kind, residency), sized to the device, whose pages are mapped to physical memory on demand.
//!
//! ```text
//!  range (vm_reserve, device-sized)   base                                          base + size
//!  pages  [p][p][p]  ·  ·  [p][p]  ·  ·  ·  ·  ·  ·  ·  ·  ·  ·  ·  ·  ·  ·  ·  ·  ·  ·  ·
//!  chunks [ h1 ][h2]       [ h3 ]                    (one physical allocation per growth, ≤ 32 pages)
//!  pool   [= segment A =]  [seg B]                   (one pool segment per mapped run;
//!          blocks split and coalesce within a run     free pages stay mapped: cached)
//! ```
//!
//! - **Grow.** When no mapped free block fits, `grow` places the request where it needs the
//!   fewest new pages: after the free block at the end of a run (PyTorch's "the free block at the
//!   end is extended"), before the free block at the start of the next, or across a whole gap
//!   (joining two runs). The pages come from free chunks another stream has cached (moved: strict
//!   or wait_event as for segments) or are created as chunks of up to [`MAX_CHUNK_PAGES`] pages
//!   (one `cuMemCreate` and one `cuMemMap` each), and are mapped; then the pool's segment is
//!   extended (`Pool::extend`). A failure midway unmaps and releases what this growth made: the
//!   pool never sees it.
//! - **The end is used last.** When best fit picks the free block at the end of a range's top
//!   run, a larger free block, if there is one, serves instead: the end is where the range grows,
//!   and spending it on requests that fit elsewhere spreads a step's blocks over more pages
//!   (measured: `mlp_train` reserves 1.069 × its peak live bytes with plain best fit, 1.032 ×
//!   with the end last).
//! - **Release.** Wholly free chunks (of the runs, from the top down; CUDA unmaps only whole
//!   mappings) are unmapped and their physical memory released, only once the range's stream has
//!   finished the work enqueued so far (an event: queried, and waited for, a host sync counted,
//!   where it has not completed); the pool's segment is cut around them (`Pool::carve`). Done by
//!   `empty_cache` and the out-of-memory ladder (transient ranges), `release_persistent`
//!   (persistent ones), and after frees when a transient range's free mapped bytes exceed
//!   `release_threshold` (down to it or below: a chunk goes whole).
//! - **Move.** A chunk taken by another stream is mapped at its new place first (all of it: a
//!   taker's gap must have room for it, and pages beyond its need join its free block); under
//!   `wait_event` the old mapping stays until the donor's event completes (the new stream waits
//!   for that event on the device, no host sync), so the donor's unfinished work never loses its
//!   memory.
//!
//! `reserved_bytes` is the mapped physical bytes (the pool segments and the reserves); the
//! virtual bytes, map/unmap and create/release calls and moved pages are counted apart.
//!
//! This file holds the ranges' types, the search of their mapped free blocks and placement; the
//! growth is in `page_growth.rs`, the release of pages in `page_release.rs`, page moves in
//! `page_moves.rs`, counters, range reports and invariants in `vm_report.rs`, the chunk table in
//! `page_table.rs` and stitched blocks in `stitch.rs`.

use super::*;
use crate::device::PhysHandle;
use crate::pool::Sizing;
use crate::types::SortedMap;
use page_table::PageTable;
use std::collections::BTreeSet;

/// One virtual range of one pool key.
pub(super) struct Range {
    pub(super) key: PoolKey,
    pub(super) base: u64,
    pub(super) size: u64,
    /// Mapped pages: address → physical allocation.
    pub(super) pages: PageTable,
    /// The pool's segments in this range (one per run of mapped pages), by base address.
    pub(super) segs: SortedMap<u64, SegmentId>,
    /// Old addresses of pages moved to another place, still mapped until the donor stream's
    /// work is done: neither usable nor mappable meanwhile.
    pub(super) retiring: BTreeSet<u64>,
    /// Growths made while no block was freed yet (see [`Shared::with_headroom`]).
    pub(super) build_up: u64,
    /// Pages lent to a live stitched block (`stitch.rs`): mapped, in no run of the pool's,
    /// neither usable nor mappable here until the stitched block is free again.
    /// As chunks: first page → end.
    pub(super) lent: SortedMap<u64, u64>,
    /// Chunks (by first page) that stitched blocks also map, and how many of them: a page move
    /// to another stream passes them over, a release first unmaps the stitches over them.
    pub(super) aliased: HashMap<u64, u32>,
}

/// Most pages one physical allocation (one `cuMemCreate` + `cuMemMap`) holds: a growth of more
/// pages is made of several chunks. Bounds how much a single live byte can keep mapped once
/// the rest of its chunk is free (a chunk is unmapped and released only as a whole, as CUDA's
/// `cuMemUnmap` requires).
pub(super) const MAX_CHUNK_PAGES: u64 = 32;

/// [`MAX_CHUNK_PAGES`] with stitching on (`expandable_stitching:true`): the granule of
/// stitching (`stitch.rs`: CUDA maps a physical allocation only whole). Measured with
/// `scripts/expandable_model.py '{"stitch_chunks": 1, "chunk_pages": N}'`: 4 pages (8 MiB)
/// stitch as well as single pages (`mlp_train` 1.0013 × live), 32 pages only reach 1.0258;
/// each chunk costs a create and a map.
pub(super) const STITCH_CHUNK_PAGES: u64 = 4;

/// Mappings that wait for `event` before they are unmapped: the old places of chunks moved
/// away under `wait_event` (mapped at their new place too), and chunks a trim let go of while
/// their stream's work was unfinished (`release_threshold`: the trim does not wait on the host;
/// the chunk is released after its unmapping, and counted reserved until then).
pub(super) struct Retiring {
    pub(super) event: EventId,
    /// (range base, address, pages, what they map).
    pub(super) pages: Vec<(u64, u64, u64, Then)>,
}

/// What a retiring mapping maps, and what goes once it is unmapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Then {
    /// The old place of a chunk a page move took: the chunk lives on in its new range, and is
    /// *in transit* until this mapping goes (the device frees memory at its last unmapping, so
    /// a release there would leave its memory held and counted nowhere): no release takes it
    /// ([`Shared::free_page_runs`]).
    Moved(PhysHandle),
    /// A trim's chunk: released once unmapped, and counted in `key`'s reserved bytes until
    /// then ([`Pool::hold`]).
    Release(PhysHandle, PoolKey),
}

impl Vm {
    /// The chunks in transit: a page move took them and their old mapping still retires.
    pub(super) fn in_transit(&self) -> Vec<PhysHandle> {
        let moved = |&(_, _, _, then): &(u64, u64, u64, Then)| match then {
            Then::Moved(h) => Some(h),
            Then::Release(..) => None,
        };
        self.retiring.iter().flat_map(|r| r.pages.iter().filter_map(moved)).collect()
    }
}

/// Counters of virtual-memory calls, changed only through the `add_` methods, which mark them
/// changed since they were last published.
#[derive(Default, Clone, Copy)]
pub(super) struct VmCounts {
    pub(super) maps: u64,
    pub(super) unmaps: u64,
    pub(super) creates: u64,
    pub(super) releases: u64,
    pub(super) moves: u64,
    /// Changed since [`Shared::publish_vm`] last ran.
    pub(super) unpublished: bool,
}

impl VmCounts {
    pub(super) fn add_maps(&mut self, n: u64) {
        self.maps += n;
        self.unpublished = true;
    }

    pub(super) fn add_unmaps(&mut self, n: u64) {
        self.unmaps += n;
        self.unpublished = true;
    }

    pub(super) fn add_creates(&mut self, n: u64) {
        self.creates += n;
        self.unpublished = true;
    }

    pub(super) fn add_releases(&mut self, n: u64) {
        self.releases += n;
        self.unpublished = true;
    }

    pub(super) fn add_moves(&mut self, n: u64) {
        self.moves += n;
        self.unpublished = true;
    }

    /// Pages a failed growth took and gave back (`give_back_taken`): not moved after all.
    pub(super) fn sub_moves(&mut self, n: u64) {
        self.moves -= n;
        self.unpublished = true;
    }
}

/// The allocator's virtual memory, under the global lock (in [`State`]).
#[derive(Default)]
pub(super) struct Vm {
    pub(super) ranges: SortedMap<u64, Range>,
    /// (base, end) of every range, for the address test each slow-path allocation makes (a
    /// few entries: a scan beats the map's search).
    pub(super) spans: Vec<(u64, u64)>,
    pub(super) by_key: SortedMap<PoolKey, u64>,
    pub(super) retiring: Vec<Retiring>,
    /// Whether the device has virtual memory management, once asked.
    supported: Option<bool>,
    /// The chunk list of a growth, kept between growths (empty).
    pub(super) scratch: Vec<(PhysHandle, u64)>,
    /// Page size (the device's granularity), known once a range exists.
    pub(super) page: u64,
    /// `release_threshold` of the configuration last seen by the slow path.
    pub(super) threshold: u64,
    /// Why expandable segments asked for are not (all) in use.
    note: Option<String>,
    /// Keys whose range could not be reserved: not asked again (a device call at every
    /// large-pool slow-path allocation) until the configuration changes or `empty_cache`.
    pub(super) refused: Vec<PoolKey>,
    /// Stitched blocks, live and cached (`stitch.rs`).
    pub(super) stitches: Vec<super::stitch::Stitch>,
    /// How many of them are live (hold a pool segment).
    pub(super) live_stitches: usize,
    /// The pool's count of frees when live stitches were last looked at.
    pub(super) frees_seen: u64,
    /// Free bytes of a stream after a trim last checked it, lowered as they fall since.
    pub(super) checked: HashMap<StreamId, u64>,
    /// Streams with a named scope's learning run open (how many): their transient ranges keep
    /// no free pages meanwhile (see [`Shared::set_learning`]).
    pub(super) learning: HashMap<StreamId, usize>,
    pub(super) counts: VmCounts,
    pub(super) virtual_bytes: u64,
    /// Physical allocations the device refused to release (unmapped, owned by no range): tried
    /// again at every page release and when ranges are freed, so their memory is not lost.
    pub(super) unreleased: Vec<PhysHandle>,
}

/// What the lock-free statistics read of expandable segments.
#[derive(Default)]
pub(super) struct VmPublished {
    pub(super) active: AtomicBool,
    pub(super) virtual_bytes: AtomicU64,
    pub(super) maps: AtomicU64,
    pub(super) unmaps: AtomicU64,
    pub(super) creates: AtomicU64,
    pub(super) releases: AtomicU64,
    pub(super) moves: AtomicU64,
}

/// One expandable range, as [`Allocator::expandable_ranges`] lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RangeInfo {
    /// First virtual address.
    pub base: DeviceAddr,
    /// Virtual bytes reserved.
    pub virtual_size: u64,
    /// The stream it serves.
    pub stream: StreamId,
    /// Small or large pool.
    pub pool: crate::stats::PoolKind,
    /// Persistent or transient.
    pub residency: Residency,
    /// Bytes of mapped pages.
    pub mapped_bytes: u64,
    /// Of those, bytes in free blocks.
    pub free_bytes: u64,
    /// Of those, bytes in wholly free chunks (what a release would unmap).
    pub free_page_bytes: u64,
    /// Its mapped runs (pool segments) as (address, bytes), in address order.
    pub runs: Vec<(DeviceAddr, u64)>,
    /// Pages moved away whose old mapping waits for the stream's work.
    pub retiring_pages: usize,
    /// Bytes of its pages lent to live stitched blocks (mapped, in none of `runs`).
    pub lent_bytes: u64,
    /// Stitched blocks over its pages, live and cached.
    pub stitches: usize,
}

impl Range {
    /// Whether a page of `[lo, hi)` retires or is lent to a stitched block: not mappable.
    #[inline]
    pub(super) fn blocked(&self, lo: u64, hi: u64) -> bool {
        !self.retiring.is_empty() && self.retiring.range(lo..hi).next().is_some()
            || !self.lent.is_empty() && self.lent.floor(&(hi - 1)).is_some_and(|(_, &e)| e > lo)
    }

    /// The first page above every run, retiring and lent page: where the range grows at its top.
    pub(super) fn top_end(&self, pool: &Pool, page: u64) -> u64 {
        let runs = self.segs.iter().next_back().map(|(&b, &s)| b + pool.segment(s).size);
        let retiring = self.retiring.last().map(|&p| p + page);
        let lent = self.lent.last().map(|(_, &e)| e);
        runs.max(retiring).max(lent).unwrap_or(self.base)
    }
}

impl Vm {
    /// Whether every change of the counters is published (`check_invariants`, between lock
    /// sections).
    pub(super) fn counts_published(&self) -> bool {
        !self.counts.unpublished
    }

    /// No range exists.
    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Whether blocks may be freed into a range under `config`: expandable segments are on, or
    /// ranges are left from when they were (a `set_config` that switches them off keeps the
    /// ranges, their blocks and their trims: `release_threshold` and learning runs still give
    /// their free pages back).
    /// BROKEN (`switched_off_ranges_cached`): the configuration alone, so the stream caches
    /// opened to the ranges' frees and kept their pages mapped where `global_lock:true`
    /// released them.
    #[inline]
    pub(super) fn in_play(&self, config: &Config) -> bool {
        config.expandable_segments
            || !cfg!(tidepool_broken = "switched_off_ranges_cached") && !self.is_empty()
    }

    /// Whether the end of a lock section has anything to settle here ([`Shared::settle`]): a
    /// live stitch that a free may have released, pages retiring behind an event, a trim to
    /// weigh (`release_threshold`, or a learning run's threshold of 0), or counters to publish.
    /// Under the default configuration none is, and the section ends with these few loads
    /// instead of a call (mlp_train: 316 lock sections, ~25 instructions each).
    #[inline]
    pub(super) fn settle_due(&self) -> bool {
        !self.ranges.is_empty()
            && (self.live_stitches != 0 || self.counts.unpublished || !self.retiring.is_empty())
            || self.trim_due()
    }

    /// Whether a trim may release anything ([`Shared::trim`]): a range exists, and a
    /// `release_threshold` or a learning run's threshold of 0 applies.
    #[inline]
    pub(super) fn trim_due(&self) -> bool {
        !self.ranges.is_empty() && (self.threshold != u64::MAX || !self.learning.is_empty())
    }

    /// The base of the range holding `addr`.
    #[inline]
    fn range_of(&self, addr: u64) -> Option<u64> {
        self.spans.iter().find(|&&(b, e)| b <= addr && addr < e).map(|&(b, _)| b)
    }

    /// Is `seg`, a segment holding `addr`, the top run of a range (the one it grows from)?
    #[inline]
    fn is_top(&self, addr: u64, seg: SegmentId) -> bool {
        let top = self.range_of(addr).and_then(|base| self.ranges[&base].segs.last());
        top.is_some_and(|(_, &s)| s == seg)
    }

    /// Does `addr` lie in one of the ranges, or in a stitched block's own range?
    #[inline]
    pub(super) fn contains(&self, addr: u64) -> bool {
        !self.ranges.is_empty()
            && (self.range_of(addr).is_some()
                || self.stitches.iter().any(|s| s.base <= addr && addr < s.base + s.bytes))
    }

    /// Why expandable segments asked for are not in use, if so.
    pub(super) fn note(&self) -> Option<&str> {
        self.note.as_deref()
    }
}

/// Whole pages of `[lo, hi)` relative to a range at `base`: the page-aligned part inside it.
pub(super) fn whole_pages(base: u64, page: u64, lo: u64, hi: u64) -> Option<(u64, u64)> {
    let a = base + (lo - base).div_ceil(page) * page;
    let b = base + (hi - base) / page * page;
    (b > a).then_some((a, b))
}

/// A refusal of memory (the device's or the limit's): the out-of-memory ladder takes over.
pub(super) fn oom() -> AllocError {
    AllocError::OutOfMemory(Box::default())
}

pub(super) fn device_err(e: DeviceError) -> AllocError {
    match e {
        DeviceError::OutOfMemory { .. }
        | DeviceError::Driver { code: DeviceError::CUDA_ERROR_OUT_OF_MEMORY, .. } => oom(),
        e => AllocError::Device(e),
    }
}

/// Where a growth goes: the pages `[lo, lo + pages × page)` are mapped and join the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Place {
    pub(super) lo: u64,
    pub(super) pages: u64,
}

/// The placement of a block of `rounded` bytes needing the fewest new pages (then the lowest
/// address). See the module docs.
pub(super) fn place(pool: &Pool, r: &Range, rounded: u64, page: u64) -> Option<Place> {
    let mut best: Option<Place> = None;
    // The walls: the runs, the pages lent to stitched blocks (mapped, in no run) and the
    // retiring pages (mapped until their event completes, in no run).
    let runs = r.segs.iter().map(|(&b, &s)| (b, b + pool.segment(s).size, Some(s)));
    // BROKEN (`retiring_not_walls`): retiring pages only refuse the windows over them, so a
    // range whose lowest pages retire has no place for a growth (an ordinary segment instead).
    let unwalled = r.retiring.is_empty() || cfg!(tidepool_broken = "retiring_not_walls");
    if r.lent.is_empty() && unwalled {
        gaps(pool, r, rounded, page, runs, &mut best);
    } else {
        let mut walls: Vec<(u64, u64, Option<SegmentId>)> = runs.collect();
        walls.extend(r.lent.iter().map(|(&a, &b)| (a, b, None)));
        for &p in r.retiring.iter().filter(|_| !unwalled) {
            match walls.last_mut() {
                Some(w) if w.2.is_none() && w.1 == p => w.1 = p + page,
                _ => walls.push((p, p + page, None)),
            }
        }
        walls.sort_unstable_by_key(|w| w.0);
        gaps(pool, r, rounded, page, walls.into_iter(), &mut best);
    }
    best
}

/// The lowest free block of `r` that ends a run of mapped pages and holds `need` bytes. Only a
/// block the free-block search refused can be one (`max_split_size`'s rules), since the search
/// runs first: PyTorch serves it from the expandable segment all the same.
#[cfg(not(tidepool_broken = "expandable_tail_refused"))]
pub(super) fn free_run_end_holding(pool: &Pool, r: &Range, need: u64) -> Option<BlockId> {
    r.segs.iter().map(|(_, &s)| pool.last_block(s)).find(|&b| {
        let blk = pool.block(b);
        blk.state == BlockState::Free && blk.size >= need
    })
}

/// [`place`] over the gaps between `walls` (address order; a run carries its segment).
fn gaps(
    pool: &Pool,
    r: &Range,
    rounded: u64,
    page: u64,
    mut walls: impl Iterator<Item = (u64, u64, Option<SegmentId>)>,
    best: &mut Option<Place>,
) {
    let free_size = |id: BlockId| {
        let b = pool.block(id);
        if b.state == BlockState::Free { b.size } else { 0 }
    };
    let (mut gap_lo, mut prev) = (r.base, None::<SegmentId>);
    // The gaps: below each wall, then above the last one (to the range's end).
    loop {
        let wall = walls.next();
        let (gap_hi, next) = match wall {
            Some((b, _, s)) => (b, s),
            None => (r.base + r.size, None),
        };
        if gap_hi > gap_lo {
            let tail = prev.map_or(0, |p| free_size(pool.last_block(p)));
            let head = next.map_or(0, |n| free_size(pool.segment(n).first));
            let (span_lo, span_hi) = (gap_lo - tail, gap_hi + head);
            let gap = (gap_lo, gap_hi);
            // From the span's start (not where the free tail alone holds the request) ...
            if span_lo + rounded <= span_hi && tail < rounded {
                window(r, page, rounded, span_lo, gap, best);
            }
            // ... and, below a wall, ending at the span's end.
            if wall.is_some() && span_hi - span_lo >= rounded {
                let w = span_hi - rounded;
                if tail < rounded || w != span_lo {
                    window(r, page, rounded, w, gap, best);
                }
            }
        }
        match wall {
            Some((_, end, s)) => {
                gap_lo = end;
                prev = s;
            }
            None => break,
        }
    }
}

/// The window of `rounded` bytes at `w` in the gap `[gap_lo, gap_hi)` of range `r`: the gap's
/// pages under it, kept in `best` where they are fewer (then lower) and none retires.
#[inline(always)]
fn window(
    r: &Range,
    page: u64,
    rounded: u64,
    w: u64,
    (gap_lo, gap_hi): (u64, u64),
    best: &mut Option<Place>,
) {
    let lo = r.base + (w.max(gap_lo) - r.base) / page * page;
    let hi = r.base + ((w + rounded).min(gap_hi) - r.base).div_ceil(page) * page;
    if hi <= lo || r.blocked(lo, hi) {
        return;
    }
    let p = Place { lo, pages: (hi - lo) / page };
    if best.is_none_or(|b| (p.pages, p.lo) < (b.pages, b.lo)) {
        *best = Some(p);
    }
}

impl<D: Device> Shared<D> {
    /// Whether `key` is served by an expandable range under `config`; makes its range on first
    /// use. `false` (ordinary segments, with a note) where the device has no virtual memory or
    /// the range cannot be reserved.
    pub(super) fn expandable(&self, st: &mut State, config: &Config, key: PoolKey) -> bool {
        if !config.expandable_segments {
            return false;
        }
        st.vm.threshold = config.release_threshold;
        if st.vm.by_key.contains_key(&key) {
            return true;
        }
        // BROKEN (`refused_ranges_retried`): asked again at every allocation.
        if st.vm.refused.contains(&key) && !cfg!(tidepool_broken = "refused_ranges_retried") {
            return false;
        }
        match self.make_range(st, config, key) {
            Ok(()) => true,
            Err(why) => {
                st.vm.note = Some(why);
                st.vm.refused.push(key);
                false
            }
        }
    }

    /// Whether the device has virtual memory management: asked once, then remembered (a
    /// device's answer is fixed for its life; the slow path asks on every large-pool search).
    pub(super) fn vm_supported(&self, st: &mut State) -> bool {
        *st.vm.supported.get_or_insert_with(|| self.device.supports_virtual_memory())
    }

    fn make_range(&self, st: &mut State, config: &Config, key: PoolKey) -> Result<(), String> {
        if !self.vm_supported(st) {
            let name = self.device.name();
            return Err(format!(
                "expandable_segments:true, but {name} has no virtual memory management: ordinary segments"
            ));
        }
        if st.vm.page == 0 {
            let g = self.device.vm_granularity().map_err(|e| {
                format!("expandable_segments:true, but the granularity query failed ({e}): ordinary segments")
            })?;
            st.vm.page = g;
            // A free leaving a page's worth of free bytes together is a trim's cue.
            st.pool.set_whole_page(g);
        }
        let page = st.vm.page;
        // Twice the device by default: pages released in the middle of a range leave it split,
        // and any request the device can hold must still find room on one side. Or what
        // `expandable_segments_reserve` asks (a request with no room goes to an ordinary
        // segment).
        let want = match config.expandable_reserve {
            Some(r) => r.bytes(self.device_total),
            // At most the largest request, as an explicit reserve is: twice a device of more
            // than 2^63 bytes rounded up to a page overflowed.
            // BROKEN (`reserve_overflows`): uncapped.
            None if cfg!(tidepool_broken = "reserve_overflows") => {
                self.device_total.saturating_mul(2)
            }
            None => self.device_total.saturating_mul(2).min(crate::types::MAX_REQUEST),
        };
        let size = want.div_ceil(page).max(1) * page;
        let base = self.device.vm_reserve(size).map_err(|e| {
            format!(
                "reserving {} of virtual addresses for {} failed ({e}): ordinary segments for it",
                crate::types::Bytes(size),
                key.stream
            )
        })?;
        let range = Range {
            key,
            base: base.0,
            size,
            pages: PageTable::new(base.0, page),
            segs: SortedMap::default(),
            retiring: BTreeSet::new(),
            build_up: 0,
            lent: SortedMap::default(),
            aliased: HashMap::new(),
        };
        st.vm.ranges.insert(base.0, range);
        st.vm.spans.push((base.0, base.0 + size));
        st.vm.by_key.insert(key, base.0);
        st.vm.virtual_bytes += size;
        self.publish_vm(&mut st.vm);
        Ok(())
    }

    /// Best fit in `key`'s free blocks, the end of an expandable range last: when best fit picks
    /// the free block at the end of a range's top run, the next larger free block serves instead,
    /// if there is one. (Best fit found no smaller block; an equal one would sit lower and have
    /// won: so the smallest block above the end block's size is the best fit without it.)
    #[inline]
    pub(super) fn find_free(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        rounded: u64,
    ) -> Option<BlockId> {
        match st.vm.is_empty() {
            // No range: the block's record is not looked at.
            true => st.pool.find_free(key, rounded, &config.sizing),
            false => self.find_free_over_ranges(st, config, key, rounded),
        }
    }

    /// [`Shared::find_free`] where ranges exist.
    #[inline(never)]
    fn find_free_over_ranges(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        rounded: u64,
    ) -> Option<BlockId> {
        // The end block is most often the largest free block (a range growing block by block):
        // then no search can find a larger one (the best fit says so from its bitmaps).
        let (b, larger) = st.pool.find_free_and_larger(key, rounded, &config.sizing)?;
        let blk = st.pool.block(b);
        if !larger || blk.next.is_some() || !st.vm.is_top(blk.addr, blk.segment) {
            return Some(b);
        }
        st.pool.find_free(key, blk.size + 1, &config.sizing).or(Some(b))
    }

    /// Whether handing the allocated block `block` out again, unchanged, for a request rounded
    /// to `rounded` is exactly what freeing it and allocating would do ([`Pool::reuse_is_best_fit`]
    /// with the block's own split rule, [`Shared::alloc_sizing`]), the end of a range's top run
    /// used last as [`Shared::find_free`] does: where the block, merged with a free right
    /// neighbour, would end the top run, no other free block of its key may serve the request.
    ///
    /// ```text
    ///  top run  [busy][ block ][free R]|unmapped   freed: [busy][ block + R ]  the growth end:
    ///                                              a larger free block elsewhere serves first
    /// ```
    ///
    /// `other`: the size of the other residency's block the search would weigh against the
    /// block's ([`Shared::other_placed`]), which wins where it is smaller than the merged block.
    #[inline]
    pub(super) fn reuse_fits(
        &self,
        st: &State,
        block: BlockId,
        rounded: u64,
        sizing: &Sizing,
        other: Option<u64>,
    ) -> bool {
        let mut own = None;
        let own = self.alloc_sizing(st, block, sizing, &mut own);
        let Some(merged) = st.pool.reuse_is_best_fit(block, rounded, own) else {
            return false;
        };
        if other.is_some_and(|o| o < merged) {
            return false;
        }
        // The search serves by the configured rules whatever the block's own split rule
        // (`find_free`: `Sizing::may_serve`): in a range that rule lifts `max_split_size`, so
        // the merged block is checked against the configured one too — one oversize for this
        // request is passed over by the search (which grows the range instead), never reused.
        // BROKEN (`reuse_oversize_in_range`): the block's own rule decided alone.
        if !st.vm.is_empty()
            && !cfg!(tidepool_broken = "reuse_oversize_in_range")
            && !sizing.may_serve(merged, rounded)
        {
            return false;
        }
        if self.broken(Broken::ReuseGrowthEnd) {
            return true;
        }
        if st.vm.is_empty() {
            return true;
        }
        let b = st.pool.block(block);
        let (mut last, mut merged) = (block, b.size);
        if let Some(r) = b.next {
            let rb = st.pool.block(r);
            if rb.state != BlockState::Free {
                return true; // a busy neighbour: not the end of its run
            }
            (last, merged) = (r, merged + rb.size);
        }
        if st.pool.block(last).next.is_some() {
            return true;
        }
        let seg = b.segment;
        if !st.vm.is_top(b.addr, seg) {
            return true;
        }
        let key = st.pool.segment(seg).key;
        !st.pool.has_free_above(key, merged) || st.pool.find_free(key, merged + 1, sizing).is_none()
    }

    /// Whether freed large-pool blocks may wait in their stream's cache under `config` over
    /// these ranges: only where a free releases no pages at once (no `release_threshold`, no
    /// learning run open), since a cached block is not free in the pool; and never under a
    /// garbage-collection threshold, whose idle age starts at the free (`gc.rs`).
    pub(super) fn large_cacheable(st: &State, config: &Config) -> bool {
        Self::large_cacheable_by(config)
            && (!st.vm.in_play(config)
                || config.release_threshold == u64::MAX && st.vm.learning.is_empty())
    }

    /// [`Shared::large_cacheable`]'s rules that hold whatever the ranges: a cached block keeps
    /// its segment from the collection's idle age until the cache is flushed, so where a
    /// collection may run a freed large block goes to the pool at once (as PyTorch's, whose age
    /// is counted from the free).
    /// BROKEN (`gc_lane_age`): cached, it counted as used at its flush.
    pub(super) fn large_cacheable_by(config: &Config) -> bool {
        config.garbage_collection_threshold.is_none() || cfg!(tidepool_broken = "gc_lane_age")
    }

    /// The block size an allocation from `block` takes: in an expandable range a large block is
    /// split whenever anything is left (an unsplit tail would only pin pages), `max_split_size`
    /// or not (PyTorch's `should_split` with expandable segments: what remains is at least
    /// `kMinBlockSize`); a stitched block is taken whole (a block in its tail would keep every
    /// chunk lent: `stitch.rs`); elsewhere the configured rules.
    ///
    /// Borrowed: `sizing` itself with no range (inline: no copy of the rules), else the rules
    /// made for the block, stored in `own`.
    #[inline(always)]
    pub(super) fn alloc_sizing<'s>(
        &self,
        st: &State,
        block: BlockId,
        sizing: &'s Sizing,
        own: &'s mut Option<Sizing>,
    ) -> &'s Sizing {
        if st.vm.is_empty() {
            return sizing;
        }
        own.insert(self.alloc_sizing_vm(st, block, sizing))
    }

    /// [`Shared::alloc_sizing`] where ranges exist.
    #[inline(never)]
    fn alloc_sizing_vm(&self, st: &State, block: BlockId, sizing: &Sizing) -> Sizing {
        let b = st.pool.block(block);
        if Self::stitched(&st.vm, b.segment) {
            Sizing { max_split_size: 0, ..*sizing }
        } else if st.vm.contains(b.addr) {
            #[cfg(not(tidepool_broken = "expandable_tail_refused"))]
            let max_split_size = u64::MAX;
            #[cfg(tidepool_broken = "expandable_tail_refused")]
            let max_split_size = sizing.max_split_size; // BROKEN: an oversize block kept whole
            Sizing { small_size: 0, max_split_size, ..*sizing }
        } else {
            *sizing
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_pages_of_a_range() {
        let (base, p) = (0x1000_0000u64, 0x100u64);
        assert_eq!(whole_pages(base, p, base, base + p), Some((base, base + p)));
        assert_eq!(whole_pages(base, p, base + 1, base + 2 * p), Some((base + p, base + 2 * p)));
        assert_eq!(whole_pages(base, p, base + 1, base + 2 * p - 1), None);
        let got = whole_pages(base, p, base + 10, base + 3 * p + 5);
        assert_eq!(got, Some((base + p, base + 3 * p)));
    }
}

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
//! This file holds the ranges' types, placement and growth; the release of pages is in
//! `page_release.rs`, page moves in `page_moves.rs`, counters, range reports and invariants in
//! `vm_report.rs`, the chunk table in `page_table.rs` and stitched blocks in `stitch.rs`.

use super::history::Action;
use super::*;
use crate::device::PhysHandle;
use crate::pool::Sizing;
use crate::types::SortedMap;
use page_table::{Chunk, PageTable};
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
    /// Growths made while the pool had freed no block yet (see [`Shared::with_headroom`]).
    build_up: u64,
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

/// A growth at the top of a transient range maps at least its mapped pages ÷ this (see
/// [`Shared::with_headroom`]): the free pages it leaves at the top are under 0.2 % of the
/// range, and a range that grows in many small steps (a static snapshot's blocks, a first
/// training step) makes a device call per ~0.2 % of its size rather than per request.
/// Measured on the six shipped traces and the three real snapshots: 1/512 leaves every trace's
/// peak and steady-state maps unchanged and cuts growths on the snapshots (10 GiB static:
/// 2898 → 1596; cs336: 888 → 654); 1/256 cut them further (1137, 499) but raised vit_train's
/// peak from 1.0112 to 1.0136 × live and mobilenetv2_train's `residency` over `expandable`;
/// 1/128 raised t5_train's by 0.25 %, 1/64 by 0.9 %.
const HEADROOM_DIVISOR: u64 = 512;

/// A *build-up* — growths while the pool has freed no block yet: weights being loaded, a
/// static snapshot replayed, the first allocations of a first step — only grows, so past its
/// first `BUILD_UP_EXACT_GROWTHS` growths of a range each growth's headroom is one page more
/// than the last one's (up to [`HEADROOM_MAX_PAGES`]); the first free ends it for good. Without
/// it a range's headroom is `1 / HEADROOM_DIVISOR` of its mapped pages, nothing while it is
/// small, so a 10 GiB build-up of ~3 MiB blocks (the `layoutediting` snapshot) made a growth
/// (a `cuMemCreate` and a `cuMemMap`) per ~2 allocations: 1596 growths, 521 with the ramp.
/// What it can cost is the last headroom, at most 20 MiB per range, left free at the top.
/// Measured: a ramp after 0, 4 or 8 exact growths moves no peak of the six shipped traces or
/// of the two snapshots with history (the static one: 1.0005 → 1.0019 × live at 8, `caching`
/// 1.0056); 8
/// keeps a short build-up (a few tensors) page-exact and leaves `mlp_train` and
/// `mobilenetv2_train` unchanged. Rejected: the most headroom from the first growth on
/// (`mlp_train` 1.032 → 1.046 × live), and a ramp over every run of growths with no free
/// between them, not only the first (`t5_train` above `caching`, `vit_train` 1.011 → 1.019).
const BUILD_UP_EXACT_GROWTHS: u64 = 8;

/// The most pages a growth's headroom reaches: 20 MiB of 2 MiB pages, PyTorch's granule of
/// mapping in large expandable segments (`kLargeBuffer`). Measured (at 1/256): 32 pages cut
/// growths on the 10 GiB snapshot only from 1137 to 1085, for a peak 0.2 % higher.
const HEADROOM_MAX_PAGES: u64 = 10;

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

    fn add_creates(&mut self, n: u64) {
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
    scratch: Vec<(PhysHandle, u64)>,
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
fn oom() -> AllocError {
    AllocError::OutOfMemory(Box::default())
}

fn device_err(e: DeviceError) -> AllocError {
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
fn place(pool: &Pool, r: &Range, rounded: u64, page: u64) -> Option<Place> {
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
fn free_run_end_holding(pool: &Pool, r: &Range, need: u64) -> Option<BlockId> {
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
    pub(super) fn reuse_fits(
        &self,
        st: &State,
        block: BlockId,
        rounded: u64,
        sizing: &Sizing,
    ) -> bool {
        let mut own = None;
        let own = self.alloc_sizing(st, block, sizing, &mut own);
        if !st.pool.reuse_is_best_fit(block, rounded, own) {
            return false;
        }
        // The search serves by the configured rules whatever the block's own split rule
        // (`find_free`: `Sizing::may_serve`): in a range that rule lifts `max_split_size`, so
        // the merged block is checked against the configured one too — one oversize for this
        // request is passed over by the search (which grows the range instead), never reused.
        // BROKEN (`reuse_oversize_in_range`): the block's own rule decided alone.
        if !st.vm.is_empty() && !cfg!(tidepool_broken = "reuse_oversize_in_range") {
            let b = st.pool.block(block);
            let right = b.next.map(|r| st.pool.block(r)).filter(|r| r.state == BlockState::Free);
            let merged = b.size + right.map_or(0, |r| r.size);
            if !sizing.may_serve(merged, rounded) {
                return false;
            }
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
    /// learning run open), since a cached block is not free in the pool.
    pub(super) fn large_cacheable(st: &State, config: &Config) -> bool {
        !config.expandable_segments
            || config.release_threshold == u64::MAX && st.vm.learning.is_empty()
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

    /// The expandable path of `find_or_reserve`, once the mapped free blocks had nothing: grows
    /// the range, climbing the out-of-memory ladder (wait for pending events and search again,
    /// release cached transient memory, retry). `None` where the range has no virtual room left
    /// for the request (the caller takes an ordinary segment). `need` is the free block wanted
    /// (`rounded`, or more for an aligned request: see `aligned.rs`); `rounded` goes into the
    /// out-of-memory report.
    pub(super) fn find_or_grow(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        (bytes, rounded, need): (u64, u64, u64),
    ) -> Result<Option<BlockId>, AllocError> {
        let mut retried = false;
        loop {
            // An aligned request (`need` above `rounded`) is never stitched: a stitch's own
            // range need not start at the alignment, and the padding split off its front would
            // be a free block in its segment that a small request takes, pinning every chunk
            // the stitch borrowed. (`cfg(tidepool_broken = "stitch_aligned")` stitches it.)
            let stitchable = need == rounded || cfg!(tidepool_broken = "stitch_aligned");
            let grown = self.grow(st, config, key, need, stitchable);
            if super::oom::is_rejected(&grown) {
                let page = st.vm.page;
                let pages = need.div_ceil(page) * page;
                return Err(self.rejection(st, config, key, (bytes, rounded, pages)));
            }
            match grown {
                Ok(None) => return Ok(None),
                Ok(Some(b)) => {
                    if retried {
                        st.counters.retries += 1;
                    }
                    return Ok(Some(b));
                }
                Err(AllocError::OutOfMemory(_)) if !retried => {
                    retried = true;
                    if self.ladder_wait(st)?
                        && let Some(b) = self.find_free(st, config, key, need)
                    {
                        st.counters.retries += 1;
                        return Ok(Some(b));
                    }
                    self.poll_retiring(st, true);
                    self.release_segments(st, |s| s.key.residency == Residency::Transient)?;
                }
                Err(AllocError::OutOfMemory(_)) => {
                    if !self.broken(Broken::LadderUncounted) {
                        st.counters.retries += 1;
                    }
                    st.counters.ooms += 1;
                    let page = st.vm.page;
                    let placed = st.vm.by_key.get(&key).and_then(|b| {
                        place(&st.pool, &st.vm.ranges[b], need, page).map(|p| p.pages * page)
                    });
                    let grow = placed.unwrap_or_else(|| need.div_ceil(page) * page);
                    let report = self.oom_report(st, config, key, bytes, rounded, grow);
                    st.note(Action::Oom, DeviceAddr(report.device_free), bytes, key.stream);
                    return Err(AllocError::OutOfMemory(Box::new(report)));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Maps pages into `key`'s range where a block of `rounded` fits with the fewest new ones
    /// (or a stitched block serves it, if `stitchable`); returns the free block that holds
    /// them, or `None` where the range has no room for it. Nothing changes on an error.
    fn grow(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        rounded: u64,
        stitchable: bool,
    ) -> Result<Option<BlockId>, AllocError> {
        self.poll_retiring(st, false);
        // Stitched blocks freed into a stream cache and flushed since: their chunks go home.
        self.unstitch_freed(st);
        let page = st.vm.page;
        let base = st.vm.by_key[&key];
        // PyTorch's `find_expandable_block`: the free block ending a run of mapped pages serves
        // a request it holds, whatever `max_split_size` says (`get_free_block` refused it as
        // oversize; `try_allocate_expandable_block` takes it anyway, and `should_split` splits
        // it), before any page is mapped: the lowest such block, as PyTorch walks the unmapped
        // blocks in address order. (`cfg(tidepool_broken = "expandable_tail_refused")`: the
        // block is passed over and pages are mapped elsewhere, or an ordinary segment taken.)
        #[cfg(not(tidepool_broken = "expandable_tail_refused"))]
        if let Some(b) = free_run_end_holding(&st.pool, &st.vm.ranges[&base], rounded) {
            return Ok(Some(b));
        }
        let Some(exact) = place(&st.pool, &st.vm.ranges[&base], rounded, page) else {
            return Ok(None);
        };
        let mapped = st.vm.ranges[&base].pages.len();
        if stitchable && let Some(b) = self.try_stitch(st, config, key, rounded, exact)? {
            return Ok(Some(b));
        }
        // A stitch that grew the range at its top for what its free chunks lacked, and then
        // failed (a map of its own range refused), left those pages free at the top: the place
        // found before it is stale (a growth there would map them again). Search and place
        // anew. (The broken build `cfg(tidepool_broken = "stale_place")` grows the stale place.)
        #[cfg(not(tidepool_broken = "stale_place"))]
        let unchanged = st.vm.ranges[&base].pages.len() == mapped;
        #[cfg(tidepool_broken = "stale_place")]
        let unchanged = {
            let _ = mapped;
            true
        };
        let exact = match unchanged {
            true => exact,
            false => {
                if let Some(b) = self.find_free(st, config, key, rounded) {
                    return Ok(Some(b));
                }
                let Some(again) = place(&st.pool, &st.vm.ranges[&base], rounded, page) else {
                    return Ok(None);
                };
                again
            }
        };
        if st.pool.frees() == 0 {
            st.vm.ranges.get_mut(&base).expect("the key's range").build_up += 1;
        }
        let wide = self.with_headroom(st, key, exact);
        if wide.pages > exact.pages {
            // Out of memory for the headroom is not out of memory for the request.
            match self.grow_at(st, config, key, wide) {
                Err(AllocError::OutOfMemory(_)) if !self.broken(Broken::HeadroomOom) => {}
                grown => return grown.map(Some),
            }
        }
        self.grow_at(st, config, key, exact).map(Some)
    }

    /// `place` widened by the growth headroom where it ends the range's top run: at least
    /// `1 / HEADROOM_DIVISOR` of the range's mapped pages, at most [`HEADROOM_MAX_PAGES`], no
    /// more than the free bytes the range may keep (`release_threshold`; none in a persistent
    /// range or while a learning run is open on its stream), and only over unmapped pages that
    /// nothing retires.
    fn with_headroom(&self, st: &State, key: PoolKey, place: Place) -> Place {
        let page = st.vm.page;
        let r = &st.vm.ranges[&st.vm.by_key[&key]];
        let keep =
            if key.residency == Residency::Persistent || st.vm.learning.contains_key(&key.stream) {
                0
            } else {
                st.vm.threshold
            };
        // A build-up (no block freed yet) only grows: past its first growths, one page more
        // headroom per growth.
        let ramp = match st.pool.frees() {
            0 => r.build_up.saturating_sub(BUILD_UP_EXACT_GROWTHS),
            _ => 0,
        };
        let pages = (r.pages.len() as u64 / HEADROOM_DIVISOR)
            .max(ramp)
            .min(HEADROOM_MAX_PAGES)
            .min(keep / page);
        if pages <= place.pages {
            return place;
        }
        let (exact_end, end) = (place.lo + place.pages * page, place.lo + pages * page);
        if end > r.base + r.size
            || r.segs.keys().next_back().is_some_and(|&t| t >= exact_end)
            || r.blocked(place.lo, end)
        {
            return place;
        }
        Place { lo: place.lo, pages }
    }

    /// Maps the pages of `place` (unmapped, not retiring) into `key`'s range and joins them to
    /// the pool; returns the free block that holds them. Nothing changes on an error.
    pub(super) fn grow_at(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        place: Place,
    ) -> Result<BlockId, AllocError> {
        // The chunk list lives in `Vm` between growths: a growth allocates nothing for it.
        let mut chunks = std::mem::take(&mut st.vm.scratch);
        let grown = self.grow_with(st, config, key, place, &mut chunks);
        chunks.clear();
        st.vm.scratch = chunks;
        grown
    }

    /// [`Shared::grow_at`] with `chunks`, empty, to collect the growth's physical allocations.
    fn grow_with(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        place: Place,
        chunks: &mut Vec<(PhysHandle, u64)>,
    ) -> Result<BlockId, AllocError> {
        let page = st.vm.page;
        let base = st.vm.by_key[&key];
        let Place { lo, pages } = place;
        // The caps (`throw_on_cudamalloc_oom`'s rejection, or the out-of-memory of a cap) are
        // checked below, once other streams' cached chunks are taken: a growth those chunks
        // serve alone creates no memory and is never refused.
        let throw = config.throw_on_oom;
        // BROKEN (`reject_before_taking`): the whole growth weighed, chunks to take included.
        if throw
            && cfg!(tidepool_broken = "reject_before_taking")
            && self.rejects(st, config, pages * page)
        {
            return Err(super::oom::rejected());
        }
        // Whole chunks other streams cached, then new chunks for the rest (one `cuMemCreate`
        // and one `cuMemMap` per chunk, not per page). A moved chunk may bring more pages than
        // needed where the gap above the window has room for them.
        let room = {
            let r = &st.vm.ranges[&base];
            let win_end = lo + pages * page;
            let next_run = r.segs.range(win_end..).next().map_or(r.base + r.size, |(&b, _)| b);
            let retiring = match r.retiring.is_empty() {
                true => u64::MAX,
                false => r.retiring.range(win_end..).next().copied().unwrap_or(u64::MAX),
            };
            let lent = match r.lent.is_empty() {
                true => u64::MAX,
                false => r.lent.range(win_end..).next().map_or(u64::MAX, |(&a, _)| a),
            };
            (next_run.min(retiring).min(lent) - lo) / page
        };
        let retiring_before = st.vm.retiring.len();
        if let Err(e) = self.take_pages(st, config, key, pages, room, chunks) {
            // Chunks taken before the error are in no range: they go back to the device.
            if !cfg!(tidepool_broken = "taken_chunks_lost") {
                let taken = chunks.len();
                self.give_back_taken(st, retiring_before, chunks, taken);
            }
            return Err(e);
        }
        // The chunks taken lead `chunks`; those created follow.
        let taken = chunks.len();
        let mut have: u64 = chunks.iter().map(|c| c.1).sum();
        let pages = pages.max(have);
        let create = (pages - have) * page;
        if create > 0 {
            // The range holds all `pages` after the growth: the new chunks and the taken ones,
            // which are carved out of their donors' pools and in no reserved bytes meanwhile.
            // BROKEN (`cap_skips_taken`): only the new pages weighed; the growth passes the cap
            // by the taken ones.
            let add = match cfg!(tidepool_broken = "cap_skips_taken") {
                true => create,
                false => pages * page,
            };
            let refused = if self.rejects(st, config, add) {
                Some(super::oom::rejected())
            } else if !self.within_limit(st, config, add) {
                Some(oom())
            } else {
                None
            };
            if let Some(e) = refused {
                // As a refused creation: the chunks taken go back to their donors, or the device.
                self.give_back_taken(st, retiring_before, chunks, taken);
                return Err(e);
            }
        }
        while have < pages {
            let most = if config.stitching { STITCH_CHUNK_PAGES } else { MAX_CHUNK_PAGES };
            let n = (pages - have).min(most);
            match self.device.vm_create(n * page) {
                Ok(h) => {
                    st.vm.counts.add_creates(1);
                    chunks.push((h, n));
                    have += n;
                }
                Err(e) => {
                    self.give_back_taken(st, retiring_before, chunks, taken);
                    return Err(device_err(e));
                }
            }
        }
        let end = lo + pages * page;
        let mut va = lo;
        for (i, &(h, n)) in chunks.iter().enumerate() {
            if let Err(e) = self.device.vm_map(DeviceAddr(va), n * page, h) {
                // Unmap what this growth mapped (the chunks before this one), from the top
                // down; where the device refuses, the chunks still mapped (from `lo` up to the
                // refused one) stay: they join the pool as free pages, released later like
                // any (a refused unmap forgotten here kept its mapping, and its address, for
                // good: every later growth over it failed).
                let mut kept = i;
                let mut at = va;
                while kept > 0 {
                    let m = chunks[kept - 1].1;
                    let unmapped = self.device.vm_unmap(DeviceAddr(at - m * page), m * page);
                    // BROKEN (`rollback_unmap_forgotten`): a refused unmap is let go of.
                    if unmapped.is_err() && !cfg!(tidepool_broken = "rollback_unmap_forgotten") {
                        break;
                    }
                    st.vm.counts.add_unmaps(1);
                    at -= m * page;
                    kept -= 1;
                }
                // The chunks left mapped here stay (a moved one's old mapping retiring as after
                // any move); the others go back to their donors, or to the device.
                let mut rest = chunks.split_off(kept);
                self.give_back_taken(st, retiring_before, &mut rest, taken.saturating_sub(kept));
                if kept > 0 {
                    let range = st.vm.ranges.get_mut(&base).expect("the key's range");
                    let mut a = lo;
                    for &(h, m) in &chunks[..kept] {
                        range.pages.insert(Chunk { handle: h, lo: a, pages: m });
                        a += m * page;
                    }
                    self.join_pages(st, base, lo, a - lo);
                }
                self.publish_vm(&mut st.vm);
                return Err(device_err(e));
            }
            st.vm.counts.add_maps(1);
            va += n * page;
        }
        let range = st.vm.ranges.get_mut(&base).expect("the key's range");
        let mut va = lo;
        for &(h, n) in chunks.iter() {
            range.pages.insert(Chunk { handle: h, lo: va, pages: n });
            va += n * page;
        }
        debug_assert_eq!(va, end);
        let blk = self.join_pages(st, base, lo, pages * page);
        self.publish_vm(&mut st.vm);
        Ok(blk)
    }

    /// Mapped pages `[lo, lo + bytes)` of range `base`, in no run yet (just mapped, or back
    /// from a stitched block), join the pool: extending or joining the runs they touch.
    /// Returns the free block that holds them.
    pub(super) fn join_pages(&self, st: &mut State, base: u64, lo: u64, bytes: u64) -> BlockId {
        let end = lo + bytes;
        let range = st.vm.ranges.get_mut(&base).expect("the key's range");
        let key = range.key;
        let left = range
            .segs
            .range(..lo)
            .next_back()
            .filter(|&(&b, &s)| b + st.pool.segment(s).size == lo)
            .map(|(_, &s)| s);
        let right = range.segs.get(&end).copied();
        let (seg, blk) = st.pool.extend(key, lo, bytes, left, right);
        // The runs table: a left neighbour keeps its base (and its entry); a right one joined
        // to it, or grown down to `lo`, leaves its entry at `end`.
        if right.is_some() {
            range.segs.remove(&end);
        }
        if left.is_none() {
            range.segs.insert(lo, seg);
        }
        debug_assert_eq!(range.segs.get(&st.pool.segment(seg).base), Some(&seg));
        st.note(Action::SegmentMap, DeviceAddr(lo), bytes, key.stream);
        // Segments per stream: the new run counts one, each neighbour it joined one less. A
        // stream with a run here already has its cache.
        match (left.is_some(), right.is_some()) {
            (false, false) => {
                self.ensure_cache(st, key.stream);
                *st.segment_streams.entry(key.stream).or_default() += 1;
            }
            (true, true) => Self::forget_segment(st, key.stream),
            _ => {}
        }
        blk
    }

    /// For a plan's region (`adopt.rs`): the span of `key`'s range a region of `need` bytes
    /// would take if its runs were joined into one segment, one bin the plan packs into with no
    /// walls but the blocks that stay busy: from the lowest run holding an `adoptable` block
    /// (an escape of the learning run), up to the end of the top run or `lowest + need`
    /// (page-rounded), whichever is higher. `None` where no run holds one, a page there is
    /// retiring, or the span leaves the range.
    pub(super) fn joinable_span(
        &self,
        st: &State,
        key: PoolKey,
        need: u64,
        adoptable: impl Fn(BlockId) -> bool,
    ) -> Option<(u64, u64)> {
        let &base = st.vm.by_key.get(&key)?;
        let (page, r) = (st.vm.page, &st.vm.ranges[&base]);
        let lo = r.segs.iter().find_map(|(&b, &s)| {
            st.pool.segment_blocks(s).any(|(id, _)| adoptable(id)).then_some(b)
        })?;
        let top = r.segs.iter().next_back().map_or(lo, |(&b, &s)| b + st.pool.segment(s).size);
        let hi = top.max(lo + need.div_ceil(page) * page);
        (!r.blocked(lo, hi) && hi <= r.base + r.size).then_some((lo, hi))
    }

    /// Maps every unmapped page of `key`'s range in `[lo, hi)` (page-aligned, none retiring;
    /// see [`Shared::joinable_span`]), joining the runs there into one segment. Gaps mapped
    /// before an error stay mapped, as free blocks of the pool.
    pub(super) fn join_runs(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        (lo, hi): (u64, u64),
    ) -> Result<(), AllocError> {
        let Some(&base) = st.vm.by_key.get(&key) else { return Ok(()) };
        let (page, r) = (st.vm.page, &st.vm.ranges[&base]);
        let mut gaps = Vec::new();
        let mut at = lo;
        for (&b, &s) in r.segs.range(lo..hi) {
            gaps.push((at, b));
            at = b + st.pool.segment(s).size;
        }
        gaps.push((at, hi));
        for (a, b) in gaps.into_iter().filter(|(a, b)| b > a) {
            self.grow_at(st, config, key, Place { lo: a, pages: (b - a) / page })?;
        }
        Ok(())
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

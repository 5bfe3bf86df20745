//! Growth of an expandable range (see `expandable.rs`): where nothing mapped fits, the range
//! grows where the request needs the fewest new pages, with the out-of-memory ladder around it;
//! the pages come from chunks other streams cached (`page_moves.rs`) or new ones (`cuMemCreate`,
//! `cuMemMap`), and the pool's run there is extended or joined to its neighbours. A failure
//! midway gives back what the growth made or took. Plans' regions join runs here too.

#[cfg(not(tidepool_broken = "expandable_tail_refused"))]
use super::expandable::free_run_end_holding;
use super::expandable::{MAX_CHUNK_PAGES, Place, STITCH_CHUNK_PAGES, device_err, oom, place};
use super::history::Action;
use super::page_table::Chunk;
use super::*;
use crate::device::PhysHandle;

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

/// A *build-up* — growths while no block was freed yet ([`Shared::freed_any`]): weights being loaded, a
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

impl<D: Device> Shared<D> {
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
            let grown = self.grow(st, config, key, (rounded, need), stitchable);
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
                    self.ladder_release(st)?;
                }
                Err(AllocError::OutOfMemory(_)) => {
                    if !self.broken(Broken::LadderUncounted) {
                        st.counters.retries += 1;
                    }
                    let page = st.vm.page;
                    let placed = st.vm.by_key.get(&key).and_then(|b| {
                        place(&st.pool, &st.vm.ranges[b], need, page).map(|p| p.pages * page)
                    });
                    let grow = placed.unwrap_or_else(|| need.div_ceil(page) * page);
                    // Counted and noted where the ladder gives up (`OomSink::count_oom`).
                    let report = self.oom_report(st, config, key, bytes, rounded, grow);
                    return Err(AllocError::OutOfMemory(Box::new(report)));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Maps pages into `key`'s range where a free block of `rounded` bytes fits with the fewest
    /// new ones (or a stitched block serves it, if `stitchable`); returns the free block that
    /// holds them, or `None` where the range has no room for it. `taken`: the bytes the
    /// request takes of that block (its rounded size; `rounded` is more for an aligned one),
    /// which the headroom counts on. Nothing changes on an error.
    fn grow(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        (taken, rounded): (u64, u64),
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
        if !Self::freed_any(st) {
            st.vm.ranges.get_mut(&base).expect("the key's range").build_up += 1;
        }
        let wide = self.with_headroom(st, key, exact, taken);
        if wide.pages > exact.pages {
            let mapped = st.vm.ranges[&base].pages.len();
            // Out of memory for the headroom is not out of memory for the request.
            match self.grow_at(st, config, key, wide) {
                Err(AllocError::OutOfMemory(_)) if !self.broken(Broken::HeadroomOom) => {}
                grown => return grown.map(Some),
            }
            // A map refused midway whose rollback's unmap was refused too left the chunks
            // before it mapped, free pages at `exact`'s place: search and place anew, as after
            // a failed stitch. (The broken build `cfg(tidepool_broken = "headroom_stale_place")`
            // maps over them: the device refuses, and the allocation fails with its error.)
            #[cfg(not(tidepool_broken = "headroom_stale_place"))]
            if st.vm.ranges[&base].pages.len() != mapped {
                if let Some(b) = self.find_free(st, config, key, rounded) {
                    return Ok(Some(b));
                }
                let Some(again) = place(&st.pool, &st.vm.ranges[&base], rounded, page) else {
                    return Ok(None);
                };
                return self.grow_at(st, config, key, again).map(Some);
            }
            #[cfg(tidepool_broken = "headroom_stale_place")]
            let _ = mapped;
        }
        self.grow_at(st, config, key, exact).map(Some)
    }

    /// `place` widened by the growth headroom where it ends the range's top run: at least
    /// `1 / HEADROOM_DIVISOR` of the range's mapped pages, at most [`HEADROOM_MAX_PAGES`], no
    /// more than the free bytes the range may keep (`release_threshold`; none in a persistent
    /// range or while a learning run is open on its stream) — counted with the free bytes its
    /// stream has already, once the request took `taken` bytes of the growth, as the trim after
    /// a free counts them — and only over unmapped pages that nothing retires.
    pub(super) fn with_headroom(
        &self,
        st: &State,
        key: PoolKey,
        place: Place,
        taken: u64,
    ) -> Place {
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
        let ramp = match Self::freed_any(st) {
            false => r.build_up.saturating_sub(BUILD_UP_EXACT_GROWTHS),
            true => 0,
        };
        // The growth's pages free once the request took its bytes, with the stream's free
        // bytes already there, stay within `keep` (the trim's measure: it would unmap the
        // excess at the stream's next free). BROKEN (`headroom_past_free`): `keep` alone, so a
        // stream with free bytes elsewhere grew past it.
        let room = match cfg!(tidepool_broken = "headroom_past_free") || keep == u64::MAX {
            true => u64::MAX,
            false => keep.saturating_add(taken).saturating_sub(st.pool.free_bytes_of(key.stream)),
        };
        let pages = (r.pages.len() as u64 / HEADROOM_DIVISOR)
            .max(ramp)
            .min(HEADROOM_MAX_PAGES)
            .min(keep / page)
            .min(room / page);
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

    /// Whether a block was ever freed, which ends a build-up: into the pool, or into a stream
    /// cache. A block freed into a lane and taken again by a hit never reaches the pool, so
    /// the pool's count alone kept the build-up ramping on the fast path where
    /// `global_lock:true` (every free a pool free) had ended it: a growth mapped pages more
    /// ahead (`stitch_kernels` seed 2476: a private pool's 4 MiB block freed and taken again,
    /// then a one-page growth mapped four). The lanes mark their first free. (A lane dropped
    /// from the table is a gone stream's with no segment left: a free it took reached the
    /// pool before its segments could go.)
    /// BROKEN (`build_up_past_lane_frees`): the pool's count alone.
    fn freed_any(st: &State) -> bool {
        st.pool.frees() != 0
            || !cfg!(tidepool_broken = "build_up_past_lane_frees")
                && st.lanes.iter().any(|c| c.took_a_free())
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

//! Giving pages back (expandable segments): wholly free chunks are unmapped and their physical
//! memory released once the range's stream has finished the work enqueued so far.
//!
//! ```text
//!  run  [ busy ][ free chunk ][ free chunk ][ busy ][ free ]   (a chunk goes only whole)
//!                └─ event on the stream ─┘
//!                   done? ─▶ unmap, release, the segment is cut around them (Pool::carve)
//!                   not yet ─▶ queried again, or waited for (a counted host sync)
//! ```
//!
//! Who releases: `empty_cache`, `trim_to` (down to its floor) and the out-of-memory ladder
//! (transient ranges), `release_persistent` (persistent ones), `trim` after frees (a transient
//! range's free mapped bytes above `release_threshold`), a stream's release or destruction
//! (`stream_done`), and the allocator's end (`vm_leftovers`: what the device refused, left to
//! the family). Physical allocations the device refuses to release wait in `Vm::unreleased` for
//! another try.

use super::expandable::*;
use super::*;
use crate::device::PhysHandle;
use crate::pool::Segment;

/// Which retiring mappings a poll waits for on the host where their event has not completed.
#[derive(Clone, Copy, Debug)]
pub(super) enum Waits {
    /// None: the completed ones go, the rest stay for a later poll.
    No,
    /// All of them.
    All,
    /// Those of this stream's ranges, and those whose chunk moved into one ([`Vm::retires_for`]):
    /// a learning run's end on the stream (`adopt.rs`), which releases the stream's pages, and
    /// `release_stream` and `destroy_stream`, which release them and its ranges.
    For(StreamId),
}

impl Vm {
    /// Whether retiring entry `r` concerns `stream`: a page of it lies in one of the stream's
    /// ranges (a trim's chunk there, or the old place of a chunk it gave away: walls of its
    /// range), or a chunk of it moved into one (in transit: no release takes it until then).
    pub(super) fn retires_for(&self, r: &Retiring, stream: StreamId) -> bool {
        let ours = |base: &u64| self.ranges.get(base).is_some_and(|g| g.key.stream == stream);
        // BROKEN (`adopt_skips_transit`): chunks moved into the stream's ranges not waited for.
        r.pages.iter().any(|(base, ..)| ours(base))
            || (!cfg!(tidepool_broken = "adopt_skips_transit") && self.moved_into(r, stream))
    }

    /// Whether a chunk of retiring entry `r` moved into one of `stream`'s ranges: in transit
    /// there until `r`'s mapping goes.
    pub(super) fn moved_into(&self, r: &Retiring, stream: StreamId) -> bool {
        r.pages.iter().any(|&(_, _, _, then)| match then {
            Then::Moved(h) => self
                .ranges
                .values()
                .any(|g| g.key.stream == stream && g.pages.chunks().iter().any(|c| c.handle == h)),
            Then::Release(..) => false,
        })
    }
}

impl<D: Device> Shared<D> {
    /// Releases physical allocations a failed growth had in hand.
    pub(super) fn drop_handles(&self, st: &mut State, handles: &[(PhysHandle, u64)]) {
        for &(h, _) in handles {
            self.release_handle(&mut st.vm, h);
        }
    }

    /// Releases an unmapped physical allocation; one the device refuses (an error, a panic)
    /// waits in `unreleased` for [`Shared::retry_releases`].
    fn release_handle(&self, vm: &mut Vm, handle: PhysHandle) {
        if self.broken(Broken::LostReleases) {
            let _ = self.device.vm_release(handle); // BROKEN: a refused release loses the handle
            vm.counts.add_releases(1);
            return;
        }
        match self.device.vm_release(handle) {
            Ok(()) => vm.counts.add_releases(1),
            Err(_) => vm.unreleased.push(handle),
        }
    }

    /// Tries again to release the allocations the device refused before.
    fn retry_releases(&self, vm: &mut Vm) {
        for h in std::mem::take(&mut vm.unreleased) {
            self.release_handle(vm, h);
        }
    }

    /// Whole free chunks of range `base` in its runs that satisfy `which`, as runs (free block,
    /// first page, end), the highest first, until they hold `want` pages, at most `cap` pages in
    /// all (a chunk that would pass `cap` is passed over; with `moving`, so is a chunk a stitched
    /// block also maps: a page move unmaps it here, and the stitch would keep its memory; and
    /// always a chunk in transit, [`Then::Moved`]).
    pub(super) fn free_page_runs(
        &self,
        st: &State,
        base: u64,
        want: u64,
        cap: u64,
        moving: bool,
        mut which: impl FnMut(&Segment) -> bool,
    ) -> Vec<(BlockId, u64, u64)> {
        let (page, r) = (st.vm.page, &st.vm.ranges[&base]);
        // BROKEN (`transit_released`): a chunk whose old place still retires is released here
        // (its memory held by that mapping and counted in no reserved bytes).
        let transit = match st.vm.retiring.is_empty() || cfg!(tidepool_broken = "transit_released")
        {
            true => Vec::new(),
            false => st.vm.in_transit(),
        };
        let mut out = Vec::new();
        let (mut left, mut got) = (want, 0u64);
        for (_, &seg) in r.segs.iter().rev() {
            if left == 0 {
                break;
            }
            if !which(st.pool.segment(seg)) {
                continue;
            }
            let mut runs: Vec<_> = st
                .pool
                .segment_blocks(seg)
                .filter(|(_, b)| b.state == BlockState::Free)
                .filter_map(|(id, b)| {
                    whole_pages(r.base, page, b.addr, b.addr + b.size).map(|(a, z)| (id, a, z))
                })
                .collect();
            runs.reverse();
            for (id, a, z) in runs {
                // The whole chunks inside [a, z), from the top down, each no larger than what is
                // left to find; neighbouring ones form one run.
                let mut top = z;
                let mut run_hi = z;
                while top > a && left > 0 {
                    let c = r.pages.get(top - page).expect("a run's page is mapped");
                    let fits = c.lo >= a
                        && c.lo + c.pages * page == top
                        && got + c.pages <= cap
                        && !(moving && r.aliased.contains_key(&c.lo))
                        && !transit.contains(&c.handle);
                    if fits {
                        left = left.saturating_sub(c.pages);
                        got += c.pages;
                    } else if top < run_hi {
                        out.push((id, top, run_hi));
                    }
                    let next = c.lo.max(a);
                    if !fits {
                        run_hi = next;
                    }
                    top = next;
                }
                if top < run_hi {
                    out.push((id, top, run_hi));
                }
                if left == 0 {
                    break;
                }
            }
        }
        out
    }

    /// Cuts `[a, b)` out of free block `block` of range `base` in the pool, keeping the range's
    /// segment table and the per-stream segment counts.
    pub(super) fn carve_run(&self, st: &mut State, base: u64, block: BlockId, a: u64, b: u64) {
        let seg = st.pool.block(block).segment;
        let old_base = st.pool.segment(seg).base;
        let stream = st.pool.segment(seg).key.stream;
        let (below, above) = st.pool.carve(block, a, b);
        let range = st.vm.ranges.get_mut(&base).expect("range");
        range.segs.remove(&old_base);
        for s in [below, above].into_iter().flatten() {
            range.segs.insert(st.pool.segment(s).base, s);
        }
        match (below, above) {
            (Some(_), Some(_)) => *st.segment_streams.entry(stream).or_default() += 1,
            (None, None) => Self::forget_segment(st, stream),
            _ => {}
        }
    }

    /// [`Shared::carve_run`] for pages leaving the run `[a, b)` (unmapped, moved or lent), noted
    /// in the history as a `segment_unmap` on `stream`.
    pub(super) fn carve_unmapped(
        &self,
        st: &mut State,
        (base, block): (u64, BlockId),
        a: u64,
        b: u64,
        stream: StreamId,
    ) {
        self.carve_run(st, base, block, a, b);
        st.note(Action::SegmentUnmap, DeviceAddr(a), b - a, stream);
    }

    /// Unmaps and releases wholly free chunks of the ranges' runs that satisfy `which`, the
    /// highest first, until at most `keep` free mapped bytes are left per range (a chunk is
    /// released whole, so a range may end below `keep`; 0: release all), each range only after
    /// its stream's work so far has completed (an event; a host sync where it has not), and
    /// first the retiring mappings whose event completed, or that `waits` names (waited for).
    ///
    /// With `Waits::No`, a range whose stream's work has not completed is not waited for: its
    /// chunks leave the pool at once and retire behind the stream's event ([`Retiring`]),
    /// unmapped and released by a later poll once it completes, and counted reserved until then
    /// (a trim under `release_threshold`: a free never waits on the host, as
    /// `cudaMallocAsync`'s pools trim without blocking).
    pub(super) fn release_pages(
        &self,
        st: &mut State,
        which: impl FnMut(&Segment) -> bool,
        keep: u64,
        waits: Waits,
    ) -> Result<(), AllocError> {
        self.release_pages_above(st, which, keep, waits, None, false)
    }

    /// [`Shared::release_pages`], with a `floor` (`trim_to`): no chunk goes whose release would
    /// take this allocator's reserved bytes below it (one that would is passed over, as a
    /// smaller one further on may fit), counted once the retiring mappings the release waits
    /// for (or finds completed) are gone. `None`: no floor. With `go_on` (the out-of-memory
    /// ladder), a chunk whose unmapping the device refuses stays mapped, a free block of its
    /// range, and the release goes on with the chunks below it and the other ranges; the
    /// first refusal is the answer once the rest is done. Without, the release ends there.
    pub(super) fn release_pages_above(
        &self,
        st: &mut State,
        mut which: impl FnMut(&Segment) -> bool,
        keep: u64,
        waits: Waits,
        floor: Option<u64>,
        go_on: bool,
    ) -> Result<(), AllocError> {
        let wait = !matches!(waits, Waits::No);
        if self.role.graph_held() && !self.broken(Broken::GraphPoolReleased) {
            return Ok(()); // a graph's replays write the pool's free pages (`release_segment`)
        }
        self.retry_releases(&mut st.vm);
        // A moved page still mapped at its old place would outlive its release there (the
        // driver frees memory at its last unmapping): old places go first (those whose event
        // completed only, where the release does not wait).
        self.poll_retiring_then(st, waits);
        // Freed stitched blocks (flushed from the stream caches) give their chunks back first.
        self.unstitch_freed(st);
        let page = st.vm.page;
        // Pages the floor lets go (whole pages above it: never below it).
        let mut left = match floor {
            None => u64::MAX,
            Some(f) => st.pool.reserved_bytes().saturating_sub(f) / page,
        };
        let bases: Vec<u64> = st.vm.ranges.keys().copied().collect();
        let mut result = Ok(());
        let mut refused = None; // a stitch's unmapping refused
        for base in bases {
            if left == 0 {
                break;
            }
            let max = if keep == 0 {
                u64::MAX
            } else {
                let free = self.range_free_bytes(st, base, &mut which);
                if free <= keep {
                    continue;
                }
                (free - keep).div_ceil(page)
            }
            .min(left);
            // (Without a floor, `left` is `u64::MAX`: no chunk is passed over for it.)
            let runs = self.free_page_runs(st, base, max, left, false, &mut which);
            if runs.is_empty() {
                continue;
            }
            let stream = st.vm.ranges[&base].key.stream;
            if self.broken(Broken::StitchUnmapEarly) {
                let _ = self.drop_stitches_over(st, base, &runs); // BROKEN: before its work is done
            }
            // A stitched block may alias these chunks: its unmapping is waited for below.
            let retire =
                !wait && st.vm.ranges[&base].aliased.is_empty() && st.vm.stitches.is_empty();
            // Its work cannot be waited for: its pages stay mapped (the next range).
            match self.stream_mark(st, stream, !retire) {
                Err(e) => {
                    if self.broken(Broken::VmEventErrors) {
                        return Err(e); // BROKEN: the release (and the allocation under it) fails
                    }
                    continue;
                }
                Ok(Some(event)) => {
                    let pages: u64 = runs.iter().map(|&(_, a, b)| (b - a) / page).sum();
                    left = left.saturating_sub(pages);
                    self.retire_runs(st, base, runs, event);
                    continue;
                }
                Ok(None) => {}
            }
            // The stream's work is done: the cached stitched blocks over these chunks go first
            // (the driver frees memory at its last unmapping). A refusal is the release's
            // answer once the rest is done.
            // BROKEN (`stitch_refusal_unreported`): `Ok` with the stitch and its chunks mapped.
            if let Err(e) = self.drop_stitches_over(st, base, &runs)
                && !cfg!(tidepool_broken = "stitch_refusal_unreported")
            {
                refused.get_or_insert(AllocError::from(e));
            }
            // A stitch whose unmapping the device refused still maps its chunks (dead, tried
            // again at the next release): they stay, mapped and in the home range, as a page
            // move passes them over. Released, the stitch mapped allocations the range no
            // longer had, counted released while the device still held them.
            // BROKEN (`stitch_refused_released`): released all the same.
            let still_aliased = !st.vm.ranges[&base].aliased.is_empty()
                && !cfg!(tidepool_broken = "stitch_refused_released");
            let runs = match still_aliased {
                true => self.free_page_runs(st, base, max, left, true, &mut which),
                false => runs,
            };
            for (block, a, b) in runs {
                // From the top down; stop at the first refusal (with `go_on`, go on below the
                // refused chunk: `[done, hi)` is what went since the last refusal).
                let (mut done, mut hi) = (b, b);
                while done > a {
                    let c = st.vm.ranges[&base].pages.get(done - page).expect("a mapped chunk");
                    if let Err(e) = self.device.vm_unmap(DeviceAddr(c.lo), c.pages * page) {
                        if result.is_ok() {
                            result = Err(e.into());
                        }
                        if !go_on {
                            break;
                        }
                        if done < hi {
                            self.carve_unmapped(st, (base, block), done, hi, stream);
                        }
                        (done, hi) = (c.lo, c.lo);
                        continue;
                    }
                    st.vm.counts.add_unmaps(1);
                    self.release_handle(&mut st.vm, c.handle);
                    st.vm.ranges.get_mut(&base).expect("range").pages.remove(c.lo);
                    left = left.saturating_sub(c.pages);
                    done = c.lo;
                }
                if done < hi {
                    self.carve_unmapped(st, (base, block), done, hi, stream);
                }
                if result.is_err() && !go_on {
                    self.publish_vm(&mut st.vm);
                    return result;
                }
            }
        }
        self.publish_vm(&mut st.vm);
        result.and(refused.map_or(Ok(()), Err))
    }

    /// Free mapped bytes of range `base` (free blocks of its runs) where they satisfy `which`.
    fn range_free_bytes(
        &self,
        st: &State,
        base: u64,
        which: &mut impl FnMut(&Segment) -> bool,
    ) -> u64 {
        let r = &st.vm.ranges[&base];
        r.segs
            .values()
            .filter(|&&s| which(st.pool.segment(s)))
            .flat_map(|&s| st.pool.segment_blocks(s))
            .filter(|(_, b)| b.state == BlockState::Free)
            .map(|(_, b)| b.size)
            .sum()
    }

    /// Returns once `stream`'s work enqueued so far has completed: an event recorded and queried,
    /// waited for (a host sync) if it has not completed. A stream destroyed through this family
    /// was drained; one the device forgot otherwise costs a wait for the whole device.
    /// Where `wait` is false and the work has not completed: `Some`, the event that marks it,
    /// instead of a host wait (the caller's to give back).
    fn stream_mark(
        &self,
        st: &mut State,
        stream: StreamId,
        wait: bool,
    ) -> Result<Option<EventId>, AllocError> {
        if self.broken_skip_events.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let event = match self.event(st) {
            Ok(event) => event,
            // BROKEN (`release_event_refused`): the release keeps the stream's pages mapped
            // (`empty_cache` returned `Ok` with its free pages still cached).
            Err(e) if cfg!(tidepool_broken = "release_event_refused") => return Err(e),
            // No event to mark its work (the device refused to create one): as for a refused
            // record, wait for all of the device's.
            Err(_) => return Ok(self.host_wait(st).map(|()| None)?),
        };
        let r = match self.device.record_event(event, stream) {
            Err(DeviceError::UnknownStream(_)) if self.gone_drained(stream) => Ok(()),
            Err(e) if self.broken(Broken::VmEventErrors) => Err(e),
            // No event marks its work (a stream destroyed elsewhere, maybe still draining, or
            // a refused record): wait for all of the device's.
            Err(_) => self.host_wait(st),
            Ok(()) => match self.device.query_event(event) {
                Ok(true) => Ok(()),
                // BROKEN (`trim_waits`): a trim waits on the host for the stream's work.
                _ if !wait && !cfg!(tidepool_broken = "trim_waits") => return Ok(Some(event)),
                _ => self.sync_event(st, event),
            },
        };
        st.free_events.push(event);
        Ok(r.map(|()| None)?)
    }

    /// A release that does not wait ([`Shared::release_pages`]): the free runs' chunks
    /// leave the pool and the page table now, held in the reserved bytes, and retire behind
    /// `event` (their stream's work so far); the poll that sees it complete unmaps and releases
    /// them. The range does not map over them meanwhile (`Range::retiring`).
    fn retire_runs(
        &self,
        st: &mut State,
        base: u64,
        runs: Vec<(BlockId, u64, u64)>,
        event: EventId,
    ) {
        let page = st.vm.page;
        let key = st.vm.ranges[&base].key;
        let stream = key.stream;
        let mut pages = Vec::new();
        for (block, a, b) in runs {
            self.carve_run(st, base, block, a, b);
            st.pool.hold(key, b - a);
            st.note(Action::SegmentUnmap, DeviceAddr(a), b - a, stream);
            let range = st.vm.ranges.get_mut(&base).expect("range");
            let mut va = a;
            while va < b {
                let c = range.pages.remove(va).expect("a mapped chunk");
                range.retiring.extend((va..va + c.pages * page).step_by(page as usize));
                pages.push((base, va, c.pages, Then::Release(c.handle, key)));
                va += c.pages * page;
            }
        }
        st.vm.retiring.push(Retiring { event, pages });
    }

    /// Unmaps the old mappings of moved pages whose donor's event has completed (with `block`:
    /// waits for them, a host sync each).
    #[inline]
    pub(super) fn poll_retiring(&self, st: &mut State, block: bool) {
        self.poll_retiring_then(st, if block { Waits::All } else { Waits::No });
    }

    /// [`Shared::poll_retiring`], waiting for the mappings `waits` names.
    fn poll_retiring_then(&self, st: &mut State, waits: Waits) {
        if !st.vm.retiring.is_empty() {
            self.poll_retiring_now(st, waits);
        }
    }

    /// [`Shared::poll_retiring`] where pages retire.
    #[cold]
    fn poll_retiring_now(&self, st: &mut State, waits: Waits) {
        let page = st.vm.page;
        let mut keep = Vec::new();
        // A capture refuses host waits (and queries): none is tried, or counted, meanwhile.
        // BROKEN (`wait_counted_in_capture`): tried, refused, and counted a host sync.
        let waits = match waits {
            Waits::All | Waits::For(_)
                if self.device.capture_underway()
                    && !cfg!(tidepool_broken = "wait_counted_in_capture") =>
            {
                Waits::No
            }
            w => w,
        };
        for mut r in std::mem::take(&mut st.vm.retiring) {
            let block = match waits {
                Waits::No => false,
                Waits::All => true,
                // BROKEN (`adopt_waits_all`): every stream's mappings waited for.
                Waits::For(_) if cfg!(tidepool_broken = "adopt_waits_all") => true,
                Waits::For(s) => st.vm.retires_for(&r, s),
            };
            let done = match self.device.query_event(r.event) {
                Ok(true) => true,
                _ if block => self.sync_event(st, r.event).is_ok(),
                _ => false,
            };
            if done {
                r.pages.retain(|&(base, va, n, then)| {
                    if self.device.vm_unmap(DeviceAddr(va), n * page).is_err() {
                        return true;
                    }
                    st.vm.counts.add_unmaps(1);
                    if let Some(range) = st.vm.ranges.get_mut(&base) {
                        for p in (va..va + n * page).step_by(page as usize) {
                            range.retiring.remove(&p);
                        }
                    }
                    // A trim's chunk: its memory goes now, and leaves the reserved bytes.
                    if let Then::Release(h, key) = then {
                        self.release_handle(&mut st.vm, h);
                        st.pool.unhold(key, n * page);
                    }
                    false
                });
            }
            if r.pages.is_empty() {
                st.free_events.push(r.event);
            } else {
                keep.push(r);
            }
        }
        st.vm.retiring = keep;
    }

    /// After frees: a transient range whose free mapped bytes exceed `release_threshold` gives
    /// pages back down to it. Checked for the streams whose free bytes changed, and only when
    /// they grew by a page since the last check (from their lowest since). Errors leave pages
    /// mapped.
    pub(super) fn trim(&self, st: &mut State) {
        if !st.vm.trim_due() {
            return;
        }
        // (Chunks earlier trims retired whose stream's work has completed went just before:
        // `Shared::settle`, this function's one caller.)
        let threshold = st.vm.threshold;
        // A capture refuses the host waits a release may need (and the driver calls that
        // conflict with it): nothing now, and nothing taken or remembered, so the first trim
        // after the capture checks every stream that changed before or during it, whichever
        // stream's free runs it. (Remembered, a trim that released nothing under the capture
        // kept its pages mapped until a page more was freed: broken build `trim_in_capture`.
        // Checked in the loop below, after the list was taken, the streams after the one it
        // stopped at were dropped from it and kept their pages until their own next change:
        // broken build `capture_drops_trims`.)
        let late = cfg!(tidepool_broken = "capture_drops_trims");
        if !cfg!(tidepool_broken = "trim_in_capture") && !late && self.device.capture_underway() {
            return;
        }
        // The streams whose free bytes changed since the last trim that ran. (Not those since
        // the statistics were last published: a `stats()` read in between hid a stream's frees
        // from a trim due later — a learning run's, a lowered threshold's — which then kept
        // its free pages, where `global_lock:true`, which publishes nothing, gave them back.)
        // BROKEN (`trim_dirty_published`): the publishing's changes, which a read empties.
        let streams: Vec<(StreamId, bool)> = match cfg!(tidepool_broken = "trim_dirty_published") {
            true => st.pool.dirty_streams().into_iter().map(|s| (s, false)).collect(),
            false => st.pool.take_trim_streams(),
        };
        for (s, whole) in streams {
            let t = if st.vm.learning.contains_key(&s) { 0 } else { threshold };
            if t == u64::MAX {
                continue;
            }
            let free = st.pool.free_bytes_of(s);
            if free <= t {
                st.vm.checked.remove(&s);
                continue;
            }
            let by_learning = t != threshold; // a learning run's own threshold of 0
            if let Some(c) = st.vm.checked.get_mut(&s) {
                // Under `release_threshold`, the memo follows the stream's free bytes down: what
                // the stream spent since (of any key: persistent or ordinary segments, its small
                // range) and its transient ranges then freed again is growth all the same. Kept
                // at its old height, a stream that reused free persistent memory hid that many
                // bytes of later transient frees from the threshold. (A learning run keeps the
                // high mark it was measured with: followed down there, its trims unmapped and
                // mapped again far more — gpt2_train's first step 729/487 maps/unmaps against
                // 635/390, t5_train's 617/398 against 412/203 — and vit_train's first run
                // peaked a page higher.)
                // BROKEN (`trim_memo_stale`): the memo stays where the last check left it.
                if free < *c && !by_learning && !cfg!(tidepool_broken = "trim_memo_stale") {
                    *c = free;
                }
                // But a free that left a free block of a page or more may have freed a whole
                // page beside bytes the last check could not release: a page half free beside
                // a live block, whose block then went, grew the free bytes by half a page and
                // stayed mapped. (A learning run keeps its high mark: see above.)
                // BROKEN (`trim_memo_whole_page`): skipped, the page stayed mapped.
                let whole =
                    whole && !by_learning && !cfg!(tidepool_broken = "trim_memo_whole_page");
                if free < c.saturating_add(st.vm.page) && !whole {
                    continue;
                }
            }
            // BROKEN (`capture_drops_trims`): the capture checked here, the rest of the list lost.
            if late && self.device.capture_underway() {
                return;
            }
            let which =
                |seg: &Segment| seg.key.stream == s && seg.key.residency == Residency::Transient;
            let _ = self.release_pages(st, which, t, Waits::No);
            let after = st.pool.free_bytes_of(s);
            // Above the threshold still, and a chunk moved into the stream's ranges is in
            // transit (passed over): nothing remembered, so the stream's next change checks
            // again — the chunk may go then. (Remembered, it stayed mapped past the threshold
            // until the stream freed a page more; broken build `transit_memo_kept`.)
            let passed_over = after > t
                && !st.vm.retiring.is_empty()
                && !cfg!(tidepool_broken = "transit_memo_kept")
                && st.vm.retiring.iter().any(|r| st.vm.moved_into(r, s));
            match passed_over {
                true => st.vm.checked.remove(&s),
                false => st.vm.checked.insert(s, after),
            };
        }
    }

    /// A named scope's learning run opened (`open`) or ended on `stream`. While one is open,
    /// frees on the stream give its transient range's whole free pages back at once (as
    /// `release_threshold_mb:0` would, for that stream only): the learning run's peak is then its
    /// live bytes, not the pages its freed blocks left mapped, and since the runs after it are
    /// served from the plan's region, the maps and unmaps this costs are paid in that run only.
    /// (`mlp_train`: the first step's peak 1.033 × the plan without it, 1.003 with it.)
    pub(super) fn set_learning(&self, st: &mut State, stream: StreamId, open: bool) {
        let n = st.vm.learning.entry(stream).or_default();
        match open {
            true => *n += 1,
            false => *n = n.saturating_sub(1),
        }
        // The stream's trims now keep nothing: what they remembered as checked, under the
        // configured threshold or at an earlier run's end (not followed down since, with no
        // threshold), does not hold the run's frees back.
        // BROKEN (`learning_memo_kept`): kept, the run's frees were not given back until the
        // stream's free bytes passed that figure by a page.
        if open && !cfg!(tidepool_broken = "learning_memo_kept") {
            st.vm.checked.remove(&stream);
        }
        // And the opening's trim checks the stream whether or not its free bytes changed since
        // the last trim: an earlier trim (another stream's learning run) that took the stream
        // and skipped it, under no threshold, left it unlisted, and its free pages stayed
        // mapped through the run.
        // BROKEN (`learning_trim_unlisted`): listed only by a change, so whether the pages went
        // depended on the stream's last free (a lane's reuse changes nothing in the pool).
        if open && !cfg!(tidepool_broken = "learning_trim_unlisted") {
            st.pool.mark_trim_stream(stream);
        }
        if *n == 0 {
            st.vm.learning.remove(&stream);
        }
        // The stream's small blocks cached before the run opened are free from now on, as
        // under `global_lock`: the opening's trim sees them (their pages go). The small lanes
        // stay open meanwhile, so the run's own small frees still wait in them (design notes,
        // "Small blocks in the stream caches under a release threshold").
        // BROKEN (`learning_small_lanes_kept`): left in the lanes, their pages stayed mapped
        // until a flush (an out-of-memory ladder's, at a cost of a retry and a host sync).
        if open && !cfg!(tidepool_broken = "learning_small_lanes_kept") {
            self.flush_stream(st, stream, false);
        }
        let cacheable = Self::large_cacheable(st, &self.config.load());
        self.cache_large.store(cacheable, Ordering::Relaxed);
        if !cacheable {
            // Blocks cached before the run opened are free from now on, as they would have
            // been without the cache: the run's trims see them.
            self.flush_large(st);
        }
    }

    /// Frees the virtual ranges of keys satisfying `which` that have nothing mapped (a destroyed
    /// or released stream's, or all of them when the allocator goes).
    pub(super) fn free_ranges(&self, st: &mut State, mut which: impl FnMut(&PoolKey) -> bool) {
        self.retry_releases(&mut st.vm);
        let gone: Vec<u64> = st
            .vm
            .ranges
            .values()
            .filter(|r| which(&r.key) && r.pages.is_empty() && r.retiring.is_empty())
            .map(|r| r.base)
            .filter(|&b| !st.vm.stitches.iter().any(|s| s.home == b))
            .collect();
        let mut freed = false;
        for base in gone {
            let size = st.vm.ranges[&base].size;
            if self.device.vm_free(DeviceAddr(base), size).is_ok() {
                freed = true;
                let r = st.vm.ranges.remove(&base).expect("listed");
                st.vm.spans.retain(|&(b, _)| b != base);
                st.vm.by_key.remove(&r.key);
                st.vm.virtual_bytes -= size;
            }
        }
        self.publish_vm(&mut st.vm);
        // The last range left by switching expandable segments off is gone: the stream caches
        // open again as the configuration has them (`Vm::in_play`), as `set_config` would open
        // them, under this lock. Only a widening (closed lanes open, large blocks cacheable),
        // so nothing cached needs a flush. Not for a closed allocator (nothing allocates).
        // BROKEN (`lanes_closed_after_ranges`): closed until the next `set_config`.
        if freed
            && st.vm.is_empty()
            && !st.stash_closed
            && !st.config.expandable_segments
            && !cfg!(tidepool_broken = "lanes_closed_after_ranges")
        {
            let config = st.config.clone();
            self.cache_large.store(Self::large_cacheable(st, &config), Ordering::Relaxed);
            self.configure_lanes(st, &config, self.recording.load(Ordering::Relaxed));
        }
    }

    /// What the ranges still hold on the device as the allocator goes (the calls that would
    /// have given it back were refused), for the family to try again (`leftovers.rs`): every
    /// mapping, old places of moved pages included, every physical allocation and every range.
    /// (A range holding a block still counted as allocated, which only a bug leaves by now,
    /// stays as it is.)
    pub(super) fn vm_leftovers(&self, vm: &mut Vm, pool: &Pool) -> Vec<Leftover> {
        let page = vm.page;
        // The stitches' mappings first: a physical allocation is freed at its last unmapping.
        let mut left = Self::stitch_leftovers(vm);
        left.extend(vm.unreleased.drain(..).map(Leftover::Release));
        for r in std::mem::take(&mut vm.retiring) {
            for &(_, va, n, then) in &r.pages {
                left.push(Leftover::Unmap { va, bytes: n * page });
                if let Then::Release(h, _) = then {
                    left.push(Leftover::Release(h));
                }
            }
            left.push(Leftover::Event(r.event));
        }
        for range in vm.ranges.values() {
            if range.segs.values().any(|&id| pool.segment(id).busy_blocks != 0) {
                continue;
            }
            for c in range.pages.chunks() {
                left.push(Leftover::Unmap { va: c.lo, bytes: c.pages * page });
                left.push(Leftover::Release(c.handle));
            }
            left.push(Leftover::Free { base: range.base, size: range.size });
        }
        left
    }
}

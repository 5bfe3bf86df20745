//! The slow path, under the global lock: best fit in the stream's own pool, a free segment of
//! another stream (strict or wait_event; none under never), a new segment; freeing back into
//! the pool; flushing the stream caches; returning segments to the device.

use super::history::Action;
use super::owner::Owner;
use super::page_release::Waits;
use super::*;
use crate::config::MIN_ALIGN;

impl<D: Device> Allocator<D> {
    /// A buffer for a block popped from a stream cache.
    pub(super) fn hand_out_cached(
        &self,
        b: &CachedBlock,
        bytes: u64,
        stream: StreamId,
        rounded: u64,
        residency: Residency,
    ) -> Buffer<D> {
        let q = b.quadrant;
        self.hand_out(b.ptr, bytes, b.size, stream, Some(b.block), rounded, residency, q)
    }

    /// A buffer for a block just handed out; tells the device's sanitizer.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn hand_out(
        &self,
        ptr: DeviceAddr,
        requested: u64,
        size: u64,
        stream: StreamId,
        block: Option<BlockId>,
        rounded: u64,
        residency: Residency,
        quadrant: usize,
    ) -> Buffer<D> {
        // A large block waits in its stream's first lane once freed: its buffer holds that
        // lane's owner, so the free stashes the hold there.
        let owner = match is_small(quadrant) {
            true => self.owners.owner(stream),
            false => self.owners.owner_of_lane(stream, 0),
        };
        self.hand_out_to(ptr, requested, size, stream, block, rounded, residency, quadrant, owner)
    }

    /// [`Allocator::hand_out`] with the buffer's hold on the allocator given.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub(crate) fn hand_out_to(
        &self,
        ptr: DeviceAddr,
        requested: u64,
        size: u64,
        stream: StreamId,
        block: Option<BlockId>,
        rounded: u64,
        residency: Residency,
        quadrant: usize,
        owner: Arc<Owner<D>>,
    ) -> Buffer<D> {
        if block.is_some() {
            self.shared.device.note_handout(ptr, size, stream);
        }
        let origin = block.map_or(Origin::None, Origin::Pool);
        Buffer::new(ptr, requested, size, stream, origin, owner, rounded, residency, quadrant)
    }
}

/// Free block `b`, found for a request aligned to `align`, cut to start at the alignment (its
/// padding split off as a free block of its own; `pool/align.rs`). Unchanged for `align` up
/// to [`MIN_ALIGN`], which every block starts at.
#[inline]
fn aligned_start(st: &mut State, b: BlockId, align: u64) -> BlockId {
    match align > MIN_ALIGN {
        true => st.pool.split_front(b, align),
        false => b,
    }
}

impl<D: Device> Shared<D> {
    /// Finds a free block for `key` or makes one, climbing the out-of-memory ladder.
    pub(super) fn find_or_reserve(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        bytes: u64,
        rounded: u64,
    ) -> Result<BlockId, AllocError> {
        #[cfg(not(any(
            tidepool_broken = "locked_pop_unpolled",
            tidepool_broken = "reuse_large_unpolled"
        )))]
        if !st.pending.is_empty() {
            self.process_events(st);
        }
        self.find_or_reserve_aligned(st, config, key, bytes, rounded, 0)
    }

    /// [`Shared::find_or_reserve`] for a block that starts at a multiple of `align` (0, or any
    /// power of two up to [`MIN_ALIGN`]: every block does): the free block returned starts
    /// there, its padding split off as a free block of its own (`pool/align.rs`). Inline (into
    /// `alloc_in_once` and `find_or_reserve`): a call fewer per search, −0.5 % instructions per
    /// op on the training traces (2026-12-06).
    #[inline(always)]
    pub(super) fn find_or_reserve_aligned(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        bytes: u64,
        rounded: u64,
        align: u64,
    ) -> Result<BlockId, AllocError> {
        // (Its callers poll the pending frees' events first: `find_or_reserve`, and
        // `Allocator::alloc_in_once` before the stream caches' locked pops.)
        #[cfg(any(
            tidepool_broken = "locked_pop_unpolled",
            tidepool_broken = "reuse_large_unpolled"
        ))]
        if !st.pending.is_empty() {
            self.process_events(st);
        }
        // Only holders of the global lock count searches: a load and a store, no shared RMW.
        let searches = &self.scope_counters.searches;
        searches.store(searches.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        if key.kind == crate::stats::PoolKind::Large {
            // A large block waiting in a stream cache is searched as the pool would hold it
            // (a stitched one's chunks back home, where they would be).
            self.flush_large(st);
            self.unstitch_freed(st);
        }
        // Any block of `need` bytes holds `rounded` bytes at an aligned address (blocks start
        // at multiples of MIN_ALIGN).
        let need = if align > MIN_ALIGN { rounded + align - MIN_ALIGN } else { rounded };
        if let Some(b) = self.find_placed(st, config, key, rounded, align) {
            return Ok(aligned_start(st, b, align));
        }
        self.find_or_reserve_cold(st, config, key, (bytes, rounded, need), align)
    }

    /// [`Shared::find_or_reserve_aligned`] past a miss of the first search (out of line: a
    /// request rarely gets here, and its code kept inline spread the common path over three
    /// times the instruction-cache lines).
    #[cold]
    #[inline(never)]
    fn find_or_reserve_cold(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        (bytes, rounded, need): (u64, u64, u64),
        align: u64,
    ) -> Result<BlockId, AllocError> {
        let aligned = align > MIN_ALIGN;
        let find = |sh: &Self, st: &mut State| sh.find_placed(st, config, key, rounded, align);
        let at = |st: &mut State, b: BlockId| aligned_start(st, b, align);
        // Before going further afield, return what the stream caches hold: no request grows
        // the pool while a cached block could serve it once coalesced. (The caches still move
        // placement, by keeping blocks from their free neighbours meanwhile: up to 0.5 % of
        // peak reserved on the shipped traces, never less than without them; design notes,
        // "What the stream caches cost in memory".)
        if self.flush_all(st) > 0
            && let Some(b) = find(self, st)
        {
            return Ok(at(st, b));
        }
        let z = &config.sizing;
        let seg_size = match self.passthrough.load(Ordering::Relaxed) {
            // caching:false: a segment of the block's own size, returned when it is freed.
            true => need.next_multiple_of(z.min_block_size),
            false if z.segment_size(rounded) >= need => z.segment_size(rounded),
            false => need.next_multiple_of(z.round_large),
        };
        self.collect_garbage(st, config, seg_size)?;
        if self.expandable(st, config, key)
            && let Some(b) = self.find_or_grow(st, config, key, (bytes, rounded, need))?
        {
            let blk = st.pool.block(b);
            if !aligned || blk.size >= rounded + crate::pool::padding(blk.addr, align) {
                return Ok(at(st, b));
            }
        }
        if let Some(b) = self.take_from_other_stream(st, config, key, need)? {
            return Ok(at(st, b));
        }
        let (mut retried, mut oversize_released) = (false, false);
        loop {
            let reserved = self.reserve(st, config, key, seg_size);
            if oom::is_rejected(&reserved) {
                return Err(self.rejection(st, config, key, (bytes, rounded, seg_size)));
            }
            match reserved {
                Ok(b) => {
                    if retried {
                        st.counters.retries += 1;
                    }
                    return Ok(at(st, b));
                }
                Err(AllocError::OutOfMemory(_)) if !retried && !self.device.capture_underway() => {
                    // PyTorch's `release_available_cached_blocks`: first only cached oversize
                    // segments of the request's stream and pool, then an attempt (no retry).
                    if !oversize_released && !self.broken(Broken::OversizeReleasedLast) {
                        oversize_released = true;
                        if self.release_oversize(st, config, key, rounded)? {
                            continue;
                        }
                    }
                    // The ladder: wait for pending events and search the pool again (their
                    // blocks may now fit), then release cached transient segments and retry.
                    // Both count as PyTorch's `release_cached_blocks` + `alloc_block(isRetry)`
                    // do: the wait in `num_sync_all_streams` (pending or not), the attempt after
                    // it in `num_alloc_retries` (successful or not).
                    retried = true;
                    if self.ladder_wait(st)?
                        && let Some(b) = find(self, st)
                    {
                        st.counters.retries += 1;
                        return Ok(at(st, b));
                    }
                    self.ladder_release(st)?;
                }
                Err(AllocError::OutOfMemory(_)) => {
                    if retried && !self.broken(Broken::LadderUncounted) {
                        st.counters.retries += 1;
                    }
                    // Counted and noted where the ladder gives up (`OomSink::count_oom`).
                    let report = self.oom_report(st, config, key, bytes, rounded, seg_size);
                    return Err(AllocError::OutOfMemory(Box::new(report)));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Reserves a new segment for `key`; a refusal (device or limit) is `OutOfMemory`.
    pub(super) fn reserve(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        seg_size: u64,
    ) -> Result<BlockId, AllocError> {
        let refused = || AllocError::OutOfMemory(Box::default());
        if self.rejects(st, config, seg_size) {
            return Err(oom::rejected());
        }
        if !self.within_limit(st, config, seg_size) {
            return Err(refused());
        }
        match self.device.reserve(seg_size) {
            Ok(ptr) => {
                self.ensure_cache(st, key.stream);
                st.counters.device_alloc += 1;
                *st.segment_streams.entry(key.stream).or_default() += 1;
                st.note(Action::SegmentAlloc, ptr, seg_size, key.stream);
                self.count_oversize_segment(st, ptr.0, seg_size, true);
                Ok(st.pool.add_segment(key, ptr.0, seg_size))
            }
            // A refusal of the memory itself (capacity, limit, or the driver's own out-of-memory code)
            // enters the OOM ladder; any other device error is passed on.
            Err(
                DeviceError::OutOfMemory { .. }
                | DeviceError::Driver { code: DeviceError::CUDA_ERROR_OUT_OF_MEMORY, .. },
            ) => Err(refused()),
            Err(e) => Err(AllocError::Device(e)),
        }
    }

    /// Cross-stream reuse: takes a whole free segment cached for another stream, if one fits.
    /// Under `Strict` only when the owner's work is done (an event recorded on it now has already
    /// completed: no host sync); under `WaitEvent` at once, by making `key.stream` wait for that
    /// event on the device.
    pub(super) fn take_from_other_stream(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        rounded: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        if config.cross_stream == CrossStream::Never
            || !st.segment_streams.keys().any(|&s| s != key.stream)
        {
            return Ok(None);
        }
        let vm = &st.vm;
        let fits = |s: &crate::pool::Segment| {
            !vm.contains(s.base)
                && s.key.stream != key.stream
                && s.key.residency == key.residency
                && s.key.kind == key.kind
                && s.size >= rounded
                && config.sizing.may_serve(s.size, rounded)
        };
        let mut candidates = st.pool.releasable_segments(fits);
        candidates.sort_by_key(|&id| (st.pool.segment(id).size, st.pool.segment(id).base));
        for seg in candidates {
            let owner = st.pool.segment(seg).key.stream;
            let event = match self.mark(st, owner) {
                Mark::Event(event) => event,
                Mark::Drained => {
                    // The owner was destroyed, hence drained: nothing can still use the segment.
                    self.move_segment(st, seg, key.stream);
                    return Ok(Some(st.pool.segment(seg).first));
                }
                // Nothing tells whether the owner is done with it: leave it.
                Mark::Failed => continue,
            };
            let ready = match config.cross_stream {
                _ if self.broken_skip_events.load(Ordering::Relaxed) => true,
                // A wait the device refuses orders nothing: leave the segment.
                CrossStream::WaitEvent => self.device.wait_event(key.stream, event).is_ok(),
                CrossStream::Strict => self.device.query_event(event).unwrap_or(false),
                CrossStream::Never => false,
            };
            st.free_events.push(event);
            if ready {
                self.move_segment(st, seg, key.stream);
                return Ok(Some(st.pool.segment(seg).first));
            }
        }
        Ok(None)
    }

    /// Moves the free segment `seg` to stream `to`. The history notes the move as PyTorch's
    /// viewers can replay it, a `segment_free` on the old stream and a `segment_alloc` on the
    /// new one (no device call is made or counted): PyTorch never moves a segment between
    /// streams, and a viewer that undoes the entries from the dump's segments back otherwise
    /// drew the segment on its new stream from the start. BROKEN (`takeover_unrecorded`):
    /// nothing noted.
    pub(super) fn move_segment(&self, st: &mut State, seg: SegmentId, to: StreamId) {
        self.ensure_cache(st, to);
        let (from, base, size) = {
            let s = st.pool.segment(seg);
            (s.key.stream, s.base, s.size)
        };
        if !cfg!(tidepool_broken = "takeover_unrecorded") {
            st.note(Action::SegmentFree, DeviceAddr(base), size, from);
            st.note(Action::SegmentAlloc, DeviceAddr(base), size, to);
        }
        st.pool.rekey_segment(seg, to);
        Self::forget_segment(st, from);
        *st.segment_streams.entry(to).or_default() += 1;
    }

    pub(super) fn forget_segment(st: &mut State, stream: StreamId) {
        if let Some(n) = st.segment_streams.get_mut(&stream) {
            *n -= 1;
            if *n == 0 {
                st.segment_streams.remove(&stream);
            }
        }
    }

    /// Releases segments with no busy block that satisfy `which`. Each release is a host sync.
    /// Expandable segments satisfying `which` give back their whole free pages instead.
    pub(super) fn release_segments(
        &self,
        st: &mut State,
        which: impl FnMut(&crate::pool::Segment) -> bool,
    ) -> Result<(), AllocError> {
        self.release_segments_then(st, which, Waits::All)
    }

    /// [`Shared::release_segments`], waiting on the host only for the retiring mappings `waits`
    /// names (`Waits::For`: a learning run's end, `adopt.rs`; a stream's release).
    pub(super) fn release_segments_then(
        &self,
        st: &mut State,
        mut which: impl FnMut(&crate::pool::Segment) -> bool,
        waits: Waits,
    ) -> Result<(), AllocError> {
        if self.device.capture_underway() {
            // cuMemFree is illegal during a capture: everything stays cached until it ends.
            return Ok(());
        }
        if !st.vm.is_empty() {
            self.release_pages(st, &mut which, 0, waits)?;
        }
        let (vm, initial) = (&st.vm, st.initial);
        for seg in st
            .pool
            .releasable_segments(|s| !vm.contains(s.base) && Some(s.base) != initial && which(s))
        {
            self.release_segment(st, seg)?;
        }
        Ok(())
    }

    /// The out-of-memory ladder's release of cached transient memory (after its wait), as
    /// [`Shared::release_segments`] except that a refusal ends nothing: a chunk whose unmapping
    /// (or a segment whose free) the device refuses stays mapped (cached) and counted, the
    /// others go, and the request's retry then succeeds or fails on its own. What was refused
    /// is not what the request asked for, so its error is not the request's.
    pub(super) fn ladder_release(&self, st: &mut State) -> Result<(), AllocError> {
        let transient = |s: &crate::pool::Segment| s.key.residency == Residency::Transient;
        // BROKEN (`ladder_refusal_fails`): the first refusal ends the release, and the request
        // fails with the device's error.
        if cfg!(tidepool_broken = "ladder_refusal_fails") {
            return self.release_segments(st, transient);
        }
        if self.device.capture_underway() {
            return Ok(()); // as `release_segments_then`
        }
        if !st.vm.is_empty() {
            let _ = self.release_pages_above(st, transient, 0, Waits::All, None, true);
        }
        let (vm, initial) = (&st.vm, st.initial);
        for seg in st.pool.releasable_segments(|s| {
            !vm.contains(s.base) && Some(s.base) != initial && transient(s)
        }) {
            let _ = self.release_segment(st, seg);
        }
        Ok(())
    }

    /// The out-of-memory ladder's first step (segments and expandable ranges alike): idle plan
    /// regions go back to the pool (cached memory too, [`Shared::release_idle_regions_locked`]),
    /// then the wait for every pending event, counted as PyTorch's `release_cached_blocks`
    /// counts it: in `num_sync_all_streams` whether or not an event was pending. Whether a
    /// region went back or an event was pending (only then may a search of the pool find more
    /// than it did).
    pub(super) fn ladder_wait(&self, st: &mut State) -> Result<bool, AllocError> {
        // A capture refuses host waits: nothing is waited for meanwhile (PyTorch skips
        // `release_cached_blocks` during a capture). BROKEN (`ladder_waits_in_capture`): the
        // refused wait failed the allocation with the device's error instead of out of memory
        // (the expandable ladder climbs during a capture on another stream).
        if self.device.capture_underway() && !cfg!(tidepool_broken = "ladder_waits_in_capture") {
            return Ok(false);
        }
        let regions = self.release_idle_regions_locked(st, true);
        let had_pending = !st.pending.is_empty();
        if had_pending || !self.broken(Broken::LadderUncounted) {
            self.sync_events(st)?;
        }
        Ok(had_pending || regions)
    }

    /// The ladder's first step under `max_split_size_mb` (PyTorch's
    /// `release_available_cached_blocks`): of the free transient ordinary segments of `key`'s
    /// stream and pool of at least `max_split_size` (oversize blocks are never split, so each is
    /// one free block), releases the smallest that holds `max(rounded, max_split_size)`, or,
    /// where none does, the largest ones until that many bytes went. Whether it found that
    /// much (then the caller tries again); nothing without `max_split_size_mb`.
    fn release_oversize(
        &self,
        st: &mut State,
        config: &Config,
        key: PoolKey,
        rounded: u64,
    ) -> Result<bool, AllocError> {
        let max_split = config.sizing.max_split_size;
        if max_split == u64::MAX {
            return Ok(false);
        }
        let want = rounded.max(max_split);
        let (vm, initial) = (&st.vm, st.initial);
        let same = PoolKey { residency: Residency::Transient, ..key };
        let mut found: Vec<(u64, SegmentId)> = st
            .pool
            .releasable_segments(|s| {
                s.key == same
                    && s.size >= max_split
                    && !vm.contains(s.base)
                    && Some(s.base) != initial
            })
            .into_iter()
            .map(|id| (st.pool.segment(id).size, id))
            .collect();
        found.sort_unstable_by_key(|&(size, id)| (size, id.0));
        // What went, not what was found: a pool a graph uses releases nothing
        // (`release_segment`), and a retry then would only be refused again.
        // BROKEN (`oversize_release_claimed`): found counted as released.
        let claimed = cfg!(tidepool_broken = "oversize_release_claimed");
        if let Some(&(_, id)) = found.iter().find(|&&(size, _)| size >= want) {
            return Ok(self.release_segment(st, id)? || claimed);
        }
        let mut released = 0;
        for &(size, id) in found.iter().rev() {
            if released >= want {
                break;
            }
            if self.release_segment(st, id)? || claimed {
                released += size;
            }
        }
        Ok(released >= want)
    }

    /// Returns one ordinary segment with no busy block to the device (a host sync); whether it
    /// went. Not in a private pool a graph uses: the segment stays cached (its free blocks are
    /// memory the replays write; broken mode `GraphPoolReleased`), `Ok(false)`.
    pub(super) fn release_segment(
        &self,
        st: &mut State,
        seg: SegmentId,
    ) -> Result<bool, AllocError> {
        if self.role.graph_held() && !self.broken(Broken::GraphPoolReleased) {
            return Ok(false);
        }
        let base = st.pool.segment(seg).base;
        // Release on the device first: if it fails, the segment stays cached and consistent.
        self.device.release(DeviceAddr(base))?;
        let stream = st.pool.segment(seg).key.stream;
        let size = st.pool.segment(seg).size;
        st.pool.remove_segment(seg);
        st.note(Action::SegmentFree, DeviceAddr(base), size, stream);
        Self::forget_segment(st, stream);
        self.count_oversize_segment(st, base, size, false);
        st.counters.device_free += 1;
        st.counters.host_syncs += 1;
        Ok(true)
    }

    /// Frees a block on behalf of a dropped buffer: into its stream's cache when it has no uses
    /// on other streams and the cache has room (no global lock), else into the pool or, after
    /// `record_stream`, behind events. A large-pool block goes to the stream's first lane, which
    /// holds at most one: it is reused only where that is exactly the pool's best fit
    /// ([`Shared::reuse_large`]), and any other search of the large pool frees it first.
    pub(super) fn free(&self, f: buffer::Freed) {
        self.free_stash(f, false);
    }

    /// [`Shared::free`]; with `stash`, a block that goes to a stream cache leaves the buffer's
    /// hold on the allocator there (`true`: the caller forgets it, see `owner.rs`).
    #[inline]
    pub(super) fn free_stash(&self, f: buffer::Freed, stash: bool) -> bool {
        self.device.note_reclaim(f.ptr, f.size, f.stream);
        if !f.used_elsewhere
            && !f.pool_only
            && self.fast_path.load(Ordering::Relaxed)
            && let Some(cache) = self.lane_for_free(f.quadrant, f.size, f.stream)
        {
            let class = ClassKey { residency: f.residency, rounded: f.rounded };
            let b = CachedBlock {
                block: f.block,
                ptr: f.ptr,
                size: f.size,
                requested: f.requested,
                quadrant: f.quadrant,
            };
            if let Ok(stashed) = cache.push_stash(class, b, f.stream, stash) {
                return stashed;
            }
        }
        self.free_into_pool(f);
        false
    }

    /// The lane a freed block of quadrant `q` and `size` bytes on `stream` may go to: this
    /// thread's lane for a small-pool block; the stream's first lane for a large one (which holds
    /// one at most: when its hint says it has one, the push would refuse, so its lock is
    /// skipped — a stale hint only sends the block to the pool, which is always correct).
    #[inline]
    pub(super) fn lane_for_free(
        &self,
        q: usize,
        size: u64,
        stream: StreamId,
    ) -> Option<crate::sync::SlotRef<'_, Arc<StreamCache>>> {
        match counters::is_small(q) {
            true => self.caches.fast(stream),
            false => self.caches.first_lane(stream).filter(|c| self.takes_large(c, size)),
        }
    }

    /// Whether a freed large block of `size` bytes may wait in `first`, its stream's first
    /// lane: large blocks are cached at all (not over expandable segments that release pages),
    /// it is below `max_split_size`, and the lane holds no large block yet (a relaxed hint;
    /// the push checks again under the lane's lock).
    #[inline(always)]
    pub(super) fn takes_large(&self, first: &StreamCache, size: u64) -> bool {
        self.cache_large.load(Ordering::Relaxed)
            && size < self.oversize_at.load(Ordering::Relaxed)
            && first.large_blocks() == 0
    }

    /// A capture holds back the freed block `f` (`capture/table.rs`, under the capture table's lock):
    /// it is no longer allocated, still active (pending), until [`Shared::free_held`], as a
    /// block whose free waits on events is (PyTorch's figures for a block freed in a capture
    /// after `record_stream`).
    #[cold]
    pub(super) fn pend_held(&self, f: &buffer::Freed) {
        if self.broken(Broken::HeldBlocksAllocated) {
            return; // BROKEN: counted as allocated until the graph lets go of it
        }
        let mut st = self.lock_state();
        st.note(Action::FreeRequested, f.ptr, f.requested, f.stream);
        st.pool.mark_pending(f.block);
        st.base.move_to_pending(f.quadrant, f.size);
    }

    /// Lets go of a block [`Shared::pend_held`] pended: freed as a dropped buffer's would be
    /// (behind events on the streams it was used on), or, with `ordered` (a capture showed its
    /// stream ordered after those uses), into the pool with its uses forgotten.
    #[cold]
    pub(super) fn free_held(&self, f: buffer::Freed, ordered: bool) {
        self.device.note_reclaim(f.ptr, f.size, f.stream);
        self.free_from(f, !self.broken(Broken::HeldBlocksAllocated), ordered);
    }

    /// The part of [`Shared::free`] under the global lock: into the pool, or behind events.
    #[cold]
    pub(super) fn free_into_pool(&self, f: buffer::Freed) {
        self.free_from(f, false, false);
    }

    /// [`Shared::free_into_pool`] of an allocated block, or (`pended`) of one already moved to
    /// pending ([`Shared::pend_held`]); with `ordered`, its recorded uses are forgotten (known
    /// to come first).
    fn free_from(&self, f: buffer::Freed, pended: bool, ordered: bool) {
        let block = f.block;
        let mut st = self.lock_state();
        if f.used_elsewhere && !st.buffer_uses.is_empty() {
            st.buffer_uses.remove(&f.ptr.0);
        }
        if !pended {
            st.note(Action::FreeRequested, f.ptr, f.requested, f.stream);
        }
        let uses = if st.stream_uses.is_empty() {
            Vec::new()
        } else {
            st.stream_uses.remove(&block).unwrap_or_default()
        };
        if uses.is_empty() || ordered || self.broken_skip_events.load(Ordering::Relaxed) {
            Self::free_now(&mut st, &f, pended);
            return;
        }
        let mut events = Vec::new();
        let mut wait_on_host = false;
        for s in uses {
            match self.mark(&mut st, s) {
                Mark::Event(event) => events.push((s, event)),
                Mark::Drained => {}
                Mark::Failed => wait_on_host = true,
            }
        }
        if self.passthrough.load(Ordering::Relaxed) || st.stash_closed {
            // caching:false, or the allocator closed: the block goes back to the device now,
            // once the other streams' work on it completed.
            wait_on_host |= self.wait_now(&mut st, &mut events);
        }
        if wait_on_host {
            // No event marks that stream's work: wait for all of it on the host instead (after
            // which every event just recorded has completed too).
            let done = self.host_wait(&mut st).is_ok();
            st.free_events.extend(events.drain(..).map(|(_, event)| event));
            if !done {
                // BROKEN (`failed_wait_lost`): a wait the device failed (not a capture) lost
                // the block for good: it stayed allocated, its segment never released.
                if cfg!(tidepool_broken = "failed_wait_lost") && !self.device.capture_underway() {
                    return;
                }
                if self.device.capture_underway() && self.broken(Broken::RefusedWaitLeaks) {
                    return; // BROKEN: as above, for a wait the capture refused
                }
                // Nothing proves the other streams are done with the block: it waits for the
                // next host wait that succeeds (`release_parked`: the next event poll once no
                // capture is underway, `empty_cache`, the allocator's drop), never reused
                // before. A capture refused the wait, or the device failed it.
                if !pended {
                    st.pool.mark_pending(block);
                    st.base.move_to_pending(f.quadrant, f.size);
                }
                st.parked.push(block);
                return;
            }
        }
        if events.is_empty() {
            Self::free_now(&mut st, &f, pended);
            return;
        }
        if !pended {
            st.pool.mark_pending(block);
            st.base.move_to_pending(f.quadrant, f.size);
        }
        Self::pend_on(&mut st, block, events);
    }

    /// Frees the block of `f` into the pool now: allocated, or (`pended`) pending.
    #[inline(always)]
    pub(super) fn free_now(st: &mut State, f: &buffer::Freed, pended: bool) {
        st.pool.free(f.block);
        match pended {
            true => st.base.pending_done(f.quadrant, f.size, f.requested),
            false => st.base.live_down(f.quadrant, f.size, f.requested),
        }
        st.note(Action::FreeCompleted, f.ptr, f.requested, f.stream);
    }

    /// Forgets what `use_on` tracked for the buffer at `ptr` (being freed).
    pub(super) fn forget_uses(&self, ptr: DeviceAddr) {
        let mut st = self.lock_state();
        st.buffer_uses.remove(&ptr.0);
    }

    /// Flushes every stream cache into the pool; returns how many blocks moved.
    pub(super) fn flush_all(&self, st: &mut State) -> usize {
        let mut n = 0;
        // (An empty lane's drain returns at its cached-bytes word: no block is empty. Asking
        // `cached_blocks` first scanned its class table and took its lock once more.)
        for c in st.lanes.iter() {
            n += flush_into(c, &mut st.pool).len();
        }
        n
    }

    /// Frees into the pool the large-pool block each stream cache may hold, so that a search of
    /// the large pool sees them as if they had never been cached. The caller holds the global
    /// lock. (A block cached concurrently is as if freed after the search.)
    pub(super) fn flush_large(&self, st: &mut State) {
        for c in st.lanes.iter() {
            if c.large_blocks() > 0
                && let Some(b) = c.drain_large()
            {
                st.pool.free(b.block);
            }
        }
    }

    /// Same-stream reuse of a large block without the pool's split and coalesce: the block
    /// `stream` caches for `class`, if handing it out is exactly what freeing it and taking the
    /// best fit would do ([`Shared::reuse_fits`]: the pool's check, and over expandable segments
    /// the range's rules; the stream holds no other large block back from the pool). Accounted like a stream-cache hit. The caller holds the global lock.
    pub(super) fn reuse_large(
        &self,
        st: &mut State,
        stream: StreamId,
        class: ClassKey,
        bytes: u64,
        config: &Config,
    ) -> Option<CachedBlock> {
        let cache = self.caches.first_lane(stream)?;
        // No large block of the request's class: the pop would find none (a lane holds one
        // large block at most), so the lane is not locked. (One cached concurrently is as if
        // freed after this section.)
        if !cache.holds_large_of(class) {
            return None;
        }
        let sizing = &config.sizing;
        // The check asks the pool for its best fit, which must see the blocks whose events
        // completed as free, as the search would (PyTorch's `malloc` polls them before every
        // search): the caller, `Allocator::alloc_in_once`, polled them first. BROKEN
        // (`locked_pop_unpolled`): polled here, for this check alone.
        if cfg!(tidepool_broken = "locked_pop_unpolled") && !st.pending.is_empty() {
            self.process_events(st);
        }
        // The search also weighs the other residency's best fit, which wins where it is
        // smaller (`find_placed`): the cached block is reused only where none is.
        // BROKEN (`reuse_other_residency`): the block's own residency alone was checked.
        let key =
            PoolKey { residency: class.residency, stream, kind: crate::stats::PoolKind::Large };
        let other = match cfg!(tidepool_broken = "reuse_other_residency") {
            true => None,
            false => self.other_placed(st, config, key, class.rounded, MIN_ALIGN),
        };
        let other = other.map(|b| st.pool.block(b).size);
        let locked = &*st;
        // Nothing placement depends on changes in this section after the check (the requested
        // bytes and the statistics below do not move blocks), so the block may be handed out
        // again without the lock while no other section began (`pop_large`). But a pending
        // block joins the pool as its events complete, with no section begun, and may then
        // fit better: while any is pending, the verdict is not kept, and every reuse is checked
        // under the lock. BROKEN (`large_verdict_pending`): kept, and a hit handed the lane's
        // block out where a completed block fitted better.
        let fits = |b: &CachedBlock| self.reuse_fits(locked, b.block, class.rounded, sizing, other);
        let pop = match st.pending.is_empty() || cfg!(tidepool_broken = "large_verdict_pending") {
            true => cache.pop_checked_at(class, bytes, fits, self.epoch.load(Ordering::Relaxed)),
            false => cache.pop_checked(class, bytes, fits),
        };
        match pop {
            Pop::Hit(b) => Some(b),
            Pop::Miss => None,
            Pop::NeedsLock => {
                // Accepted, but another request size or too little credit: account it here.
                // Large blocks are popped under the global lock only, so it is the same block.
                let b = cache.pop_locked(class, stream)?;
                if b.requested != bytes {
                    st.pool.set_requested(b.block, bytes);
                }
                st.base.live_up(b.quadrant, b.size, bytes, || &st.lanes[..]);
                Some(b)
            }
        }
    }

    /// Flushes one stream's cache into the pool, closing it first if the stream goes away.
    pub(super) fn flush_stream(&self, st: &mut State, stream: StreamId, close: bool) {
        for c in self.caches.lanes(stream) {
            if close {
                c.close();
            }
            flush_into(&c, &mut st.pool);
        }
    }

    /// Refuses a stream the device does not have; streams it confirmed are remembered here,
    /// so each is asked about once. The caller holds the global lock.
    #[inline]
    pub(super) fn check_stream(&self, st: &mut State, stream: StreamId) -> Result<(), AllocError> {
        if st.streams.contains_key(&stream) || self.broken(Broken::UnknownStreams) {
            return Ok(());
        }
        self.confirm_stream(st, stream)
    }

    /// [`Shared::check_stream`] of a stream not confirmed yet: asks the device once.
    #[inline(never)]
    fn confirm_stream(&self, st: &mut State, stream: StreamId) -> Result<(), AllocError> {
        if !self.device.has_stream(stream) {
            return Err(AllocError::UnknownStream(stream));
        }
        st.streams.insert(stream, ());
        Ok(())
    }

    /// Refuses a stream the device does not have, asking the device (no global lock).
    pub(super) fn stream_exists(&self, stream: StreamId) -> Result<(), AllocError> {
        if self.broken(Broken::UnknownStreams) || self.device.has_stream(stream) {
            Ok(())
        } else {
            Err(AllocError::UnknownStream(stream))
        }
    }

    /// Whether `stream` went from the device since an open scope on it saw the family's count
    /// of gone streams at `seen` (`Family::note_gone`): the device is asked only when that
    /// count moved.
    /// BROKEN (`scope_outlives_stream`): never (a scope served on, and learned, on a dead
    /// stream).
    pub(super) fn stream_gone_since(&self, stream: StreamId, seen: u64) -> bool {
        !cfg!(tidepool_broken = "scope_outlives_stream")
            && self.family.gone.load(Ordering::Acquire) != seen
            && self.stream_exists(stream).is_err()
    }

    /// Gives `stream` a cache if it has none (it is about to own memory): the lanes of the first
    /// of its slots that has none or whose stream is gone (see `CacheTable`), made now or
    /// re-tagged from the destroyed stream, else unslotted lanes.
    pub(super) fn ensure_cache(&self, st: &mut State, stream: StreamId) {
        if self.caches.get(stream).is_some() {
            return;
        }
        let config = self.config.load();
        let recording = self.recording.load(Ordering::Relaxed);
        let closed = recording && !self.broken(Broken::HistoryLanesOpen);
        let limits = limits(&config, closed, st.vm.in_play(&config));
        // Readers that loaded the old table must retry; opened before any lane is re-tagged,
        // so that a reader that sees a new tag fails its collect.
        st.base.touch(&self.stats);
        let known = st.streams.contains_key(&stream) || self.broken(Broken::UnknownStreams);
        // The first of its slots with no lanes yet, or whose stream is gone.
        let mut chosen = None;
        for slot in lane_table::slot_choices(stream) {
            let lanes = self.caches.slot_lanes(slot);
            if lanes.is_empty() {
                chosen = Some((slot, lanes));
                break;
            }
            // The slot's stream was destroyed (or never known): its lanes were closed and
            // flushed.
            let mut retired = lanes.iter().all(|c| c.is_closed());
            if let Some(old) = lanes.first().map(|c| c.stream())
                && known
                && !retired
                && !self.broken(Broken::UnknownStreams)
                && !self.device.has_stream(old)
            {
                // The slot's stream was destroyed on the device behind the allocator's back:
                // it is let go of as `release_stream` would (its cached blocks go to the pool,
                // under its own key: no other stream takes them without an event on it, which
                // now fails). That closes its lanes.
                st.streams.remove(&old);
                self.flush_stream(st, old, true);
                retired = true;
            }
            if known && retired && !self.broken(Broken::NoLaneRetag) {
                chosen = Some((slot, lanes));
                break;
            }
            if self.broken(Broken::NoSecondSlot) {
                break;
            }
        }
        match chosen {
            Some((_, lanes)) if !lanes.is_empty() => {
                self.retag_slot(st, stream, &lanes, limits, config.sizing);
            }
            chosen => {
                // Destroyed (or forgotten) since it was checked: its caches never take a block.
                let lanes = self.new_lanes(st, stream, limits, config.sizing, !known);
                // Unslotted where all its slots serve other streams: no fast path, only its
                // figures.
                self.caches.add(lanes, chosen.map(|(slot, _)| slot));
            }
        }
        st.lanes = Arc::new(self.caches.all().iter().cloned().collect());
    }

    /// Re-tags the lanes of `stream`'s slot, whose stream is gone (`slot`, all closed), for
    /// `stream`: they open again under `limits` and `sizing` and publish its pool figures.
    /// The old stream keeps a carrier for its own figures (new unslotted lanes, closed) while
    /// it has segments (its live buffers may outlive it); unslotted lanes of gone streams with
    /// no segment left are dropped from the table. The caller holds the global lock and made
    /// statistics readers retry.
    fn retag_slot(
        &self,
        st: &mut State,
        stream: StreamId,
        slot: &[Arc<StreamCache>],
        limits: Limits,
        sizing: crate::pool::Sizing,
    ) {
        let old = slot[0].stream();
        for lane in slot {
            // (Nothing, after the flush that closed it: a closed lane takes no block.)
            for b in lane.retag(stream, limits, sizing) {
                st.pool.free(b.block);
            }
        }
        slot[0].publish_pool_free(st.pool.free_bytes_of(stream));
        st.counters.lane_retags += 1;
        self.caches.resort(|c| {
            c.stream() != old
                && !self.caches.is_slotted(c)
                && c.is_closed()
                && !st.segment_streams.contains_key(&c.stream())
        });
        if st.segment_streams.contains_key(&old) {
            self.caches.add(self.new_lanes(st, old, limits, sizing, true), None);
        }
    }

    /// New lanes for `stream` under `limits` and `sizing`, the first publishing its pool free
    /// bytes; `closed`, they take no block (a stream gone, or a carrier of its figures). The
    /// caller holds the global lock and adds them to the table.
    fn new_lanes(
        &self,
        st: &State,
        stream: StreamId,
        limits: Limits,
        sizing: crate::pool::Sizing,
        closed: bool,
    ) -> Vec<Arc<StreamCache>> {
        let lanes: Vec<_> = (0..lane_table::LANES)
            .map(|k| {
                let cache = StreamCache::new_lane(stream, limits, k);
                cache.configure(limits, sizing);
                if closed {
                    cache.close();
                }
                if st.stash_closed {
                    // Closed in every build (the call was inside the `debug_assert`, so a release
                    // build left a lane made after the close with an open stash); a new lane
                    // holds nothing to give back.
                    let kept = cache.close_stash();
                    debug_assert_eq!(kept, 0);
                }
                #[cfg(feature = "test-hooks")]
                self.break_lane(&cache);
                Arc::new(cache)
            })
            .collect();
        lanes[0].publish_pool_free(st.pool.free_bytes_of(stream));
        lanes
    }

    /// Bytes of `stream`'s segments in blocks that are not free in the pool: allocated, or freed
    /// and waiting on events (flush the stream's caches first, or their blocks count too).
    pub(super) fn bytes_in_use_on(&self, st: &State, stream: StreamId) -> u64 {
        st.pool
            .segments()
            .filter(|(_, seg)| seg.key.stream == stream)
            .flat_map(|(id, _)| st.pool.segment_blocks(id))
            .filter(|(_, b)| b.state != BlockState::Free)
            .map(|(_, b)| b.size)
            .sum()
    }
}

/// The size an `oom` history entry records for a request of `bytes` rounded to `rounded`: the
/// rounded size, as PyTorch's `record_trace(TraceEntry::OOM, device_free, params.size(), …)`
/// records it. BROKEN (`oom_entry_requested`): the request as asked.
pub(super) fn oom_size(bytes: u64, rounded: u64) -> u64 {
    if cfg!(tidepool_broken = "oom_entry_requested") { bytes } else { rounded }
}

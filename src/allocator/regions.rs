//! Learned plans and their regions: the memory a named scope's planned run hands out, made
//! and adopted as a learning run ends, and returned to the pool in one stream-ordered batch.

use super::plan::Settling;
use super::state::PlanState;
use super::*;

/// Learned plans by scope name, then stream: a scope opening looks its name up as a `&str` and
/// keeps the table's `Arc<str>`, so a known name costs no allocation. (Few streams per name.)
/// Names are the program's own, so they are hashed with FNV-1a rather than SipHash (a third of
/// a scope's opening was hashing its name).
pub(super) type Plans =
    HashMap<std::sync::Arc<str>, Vec<(StreamId, PlanState)>, std::hash::BuildHasherDefault<Fnv>>;

/// FNV-1a, 64 bits: a few instructions a byte for a short name.
pub(super) struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl std::hash::Hasher for Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// The plan state of scope `name` on `stream`, made empty if there is none.
pub(super) fn plan_entry<'p>(
    plans: &'p mut Plans,
    name: &str,
    stream: StreamId,
) -> &'p mut PlanState {
    if !plans.contains_key(name) {
        plans.insert(name.into(), Vec::new());
    }
    let streams = plans.get_mut(name).expect("inserted above");
    match streams.iter().position(|(s, _)| *s == stream) {
        Some(i) => &mut streams[i].1,
        None => {
            streams.push((stream, PlanState::default()));
            &mut streams.last_mut().expect("pushed above").1
        }
    }
}

impl<D: Device> Shared<D> {
    /// The plan learned for a named scope and its region, if any, and the name as the table
    /// keeps it (a new `Arc<str>` while the name has no entry).
    pub(super) fn plan_for(
        &self,
        name: &str,
        stream: StreamId,
    ) -> (std::sync::Arc<str>, Option<Arc<Learned>>, Option<Arc<Region>>) {
        let mut plans = lock(&self.plans);
        let Some((key, streams)) = plans.get_key_value(name) else {
            return (name.into(), None, None);
        };
        let key = key.clone();
        let Some(p) = streams.iter().position(|(s, _)| *s == stream) else {
            return (key, None, None);
        };
        let p = &mut plans.get_mut(name).expect("found above")[p].1;
        // A region one of whose slices was freed during a foreign capture serves no run again,
        // nor does a poisoned one (nothing could order a slice's reuse): the plan lets go of
        // it (a later run makes a new one, or learns again where the region held the plan's
        // addresses). A poisoned one let go of waits for a host wait (`State::poisoned`).
        // BROKEN (`poisoned_region_kept`): the plan kept a poisoned region, which every later
        // run was denied (all plan misses), and its memory stayed allocated for good.
        let dead = |r: &mut Arc<Region>| {
            r.is_foreign() || (r.is_poisoned() && !cfg!(tidepool_broken = "poisoned_region_kept"))
        };
        let foreign = p.region.take_if(dead);
        if foreign.as_ref().is_some_and(|r| r.is_adopted()) {
            p.learned = None;
        }
        // A run that follows the plan ends the learning mark of an earlier run of the scope
        // (see `learning_opens`).
        let stale = p.learned.is_some()
            && p.learning != 0
            && !cfg!(tidepool_broken = "forgotten_learning_kept");
        if stale {
            p.learning = 0;
            let mut st = self.lock_state();
            self.set_learning(&mut st, stream, false);
        }
        let found = (key, p.learned.clone(), p.region.clone());
        drop(plans);
        if let Some(r) = foreign {
            self.release_region(r);
        }
        found
    }

    /// Stores what a named scope learned on `stream`; the old plan's region is let go (it
    /// returns to the pool once no escaped buffer holds it). Nothing for a stream gone since
    /// the run last saw it there (`seen`, see [`Shared::stream_gone_since`]): asked under the
    /// plans' lock, which `destroy_stream` takes to forget its plans once it counted it gone.
    pub(super) fn learn(&self, name: &str, stream: StreamId, learned: Option<Learned>, seen: u64) {
        let old = {
            let mut plans = lock(&self.plans);
            if self.stream_gone_since(stream, seen) {
                return;
            }
            let entry = plan_entry(&mut plans, name, stream);
            entry.learned = learned.map(Arc::new);
            entry.region.take()
        };
        if let Some(region) = old {
            self.release_region(region);
        }
    }

    /// Reserves the region of a named scope's plan `learned`: the stream's cached transient
    /// segments with no live block are released first (the plan replaces them), then one block
    /// of the plan's size is taken from the pool. `Ok(None)` when the scope learned another
    /// plan since this run opened: a region belongs to the plan it was made for (another plan's
    /// offsets may reach past it), so the run is served by the pool instead.
    pub(super) fn make_region(
        &self,
        name: &str,
        stream: StreamId,
        learned: &Arc<Learned>,
    ) -> Result<Option<Arc<Region>>, AllocError> {
        let mut plans = lock(&self.plans);
        let entry = plan_entry(&mut plans, name, stream);
        if !entry.learned.as_ref().is_some_and(|l| Arc::ptr_eq(l, learned)) {
            return Ok(None);
        }
        if let Some(r) = &entry.region {
            return Ok(Some(r.clone()));
        }
        let size = learned.region_size;
        let config = self.config.load();
        if config.sizing.round(size).is_none() {
            return Err(AllocError::InvalidSize { requested: size });
        }
        let mut st = self.lock_state();
        // The stream's cached blocks go back to the pool first, so the trim can release them.
        self.flush_stream(&mut st, stream, false);
        self.release_segments(&mut st, |s| {
            s.key.stream == stream && s.key.residency == Residency::Transient
        })?;
        let (block, base) = self.region_block(&mut st, &config, stream, size)?;
        let bsize = block.size;
        // Under the lock, in the section that made the block live: a `stats()` read takes it
        // in the same copy as the allocated bytes (`plain_counters`). BROKEN (`extras_apart`):
        // after it.
        #[cfg(not(tidepool_broken = "extras_apart"))]
        self.scope_counters.region_bytes.fetch_add(bsize, Ordering::Relaxed);
        drop(st);
        #[cfg(tidepool_broken = "extras_apart")]
        self.scope_counters.region_bytes.fetch_add(bsize, Ordering::Relaxed);
        let region = Arc::new(Region::new(vec![block], base, bsize));
        entry.region = Some(region.clone());
        Ok(Some(region))
    }

    /// A learning run (no plan yet) of named scope `name` opens on `stream`: over expandable
    /// segments the stream's transient pages are then given back as they are freed until it
    /// ends (see `set_learning`). The stream counts one mark per named scope, held by the run
    /// of it that opened last (`PlanState::learning`): a run that finds an earlier run's mark
    /// ends it. Nothing tells an earlier run still open from one that was `mem::forget`-ten
    /// (which never ends: its mark trimmed the stream at every free for good), and two runs
    /// of one scope on one stream at once learn one plan anyway. Returns the run's mark (never
    /// 0), or 0 without expandable segments.
    pub(super) fn learning_opens(&self, name: &str, stream: StreamId) -> u64 {
        if !self.config.load().expandable_segments {
            return 0;
        }
        let mark = self.family.next_id();
        let mut plans = lock(&self.plans);
        let earlier = std::mem::replace(&mut plan_entry(&mut plans, name, stream).learning, mark);
        let mut st = self.lock_state();
        self.set_learning(&mut st, stream, true);
        // BROKEN (`forgotten_learning_kept`): a mark per run, ended by its run's end only.
        if earlier != 0 && !cfg!(tidepool_broken = "forgotten_learning_kept") {
            self.set_learning(&mut st, stream, false);
        }
        mark
    }

    /// The learning run of `name` on `stream` that opened with `mark` ends: its mark ends,
    /// unless a later run of the scope ended it already (or `destroy_stream` forgot the
    /// scope's plans on the stream, and the mark with them). A run that opened counted goes
    /// uncounted whatever the configuration is now (one that turned expandable segments off
    /// meanwhile left the count raised: the stream's pages were trimmed at every free for good
    /// once they were on again).
    /// BROKEN (`learning_count_kept`): the end asks the configuration again.
    pub(super) fn learning_ends(&self, name: &str, stream: StreamId, mark: u64) {
        if cfg!(tidepool_broken = "learning_count_kept") && !self.config.load().expandable_segments
        {
            return;
        }
        let mut plans = lock(&self.plans);
        let entry = plans.get_mut(name).and_then(|v| v.iter_mut().find(|(s, _)| *s == stream));
        let own = match entry {
            Some((_, p)) if p.learning == mark => {
                p.learning = 0;
                true
            }
            _ => cfg!(tidepool_broken = "forgotten_learning_kept"),
        };
        if own {
            let mut st = self.lock_state();
            self.set_learning(&mut st, stream, false);
        }
    }

    /// Lets go of the regions of learned plans that nothing else holds — no scope run, planned
    /// buffer, graph or escaped buffer — so that `empty_cache` can release their memory (a
    /// region is cached memory, as a free segment is). A plan whose offsets are relative to its
    /// region stays learned: the scope's next run makes the region anew. One whose region
    /// adopted the learning run's segments ([`Region::is_adopted`]: its offsets are addresses
    /// in them) is forgotten with it: the next run learns again. Takes the plans' lock, then the
    /// state's: the caller holds neither. Whether it let go of any.
    pub(super) fn release_idle_regions(&self) -> bool {
        self.release_idle_regions_of(|_| true)
    }

    /// [`Shared::release_idle_regions`] for the plans of the streams `which` picks. Escapes
    /// settling into a region are waited for (counted host syncs). Nothing during a capture
    /// (its memory may not be freed then).
    pub(super) fn release_idle_regions_of(&self, which: impl Fn(StreamId) -> bool) -> bool {
        self.release_idle_regions_then(true, which, |_, _| true)
    }

    /// [`Shared::release_idle_regions_of`] for the regions `fits` also picks (asked under the
    /// global lock); escapes settling into a region are waited for only with `wait` (else
    /// polled: `trim_to`, which waits for no free).
    pub(super) fn release_idle_regions_then(
        &self,
        wait: bool,
        which: impl Fn(StreamId) -> bool,
        fits: impl FnMut(&State, &Region) -> bool,
    ) -> bool {
        if self.device.capture_underway() {
            return false;
        }
        let idle = {
            let mut plans = lock(&self.plans);
            self.take_idle_regions(&mut plans, &mut self.lock_state(), wait, which, fits)
        };
        let any = !idle.is_empty();
        for region in idle {
            self.release_region(region);
        }
        any
    }

    /// [`Shared::release_idle_regions`] for the out-of-memory ladder (`wait`: escapes settling
    /// into a region are waited for, as the ladder waits for pending frees) and a closed
    /// allocator's lock sections (only polled), which hold the global lock: the plans' lock
    /// comes first in the lock order, so it is only tried (held by another thread, nothing is
    /// let go this time), and the regions' blocks go straight to the pool. Nothing during a
    /// capture. Whether it let go of any.
    pub(super) fn release_idle_regions_locked(&self, st: &mut State, wait: bool) -> bool {
        if self.broken(Broken::OomKeepsRegions) || self.device.capture_underway() {
            return false;
        }
        let idle = match crate::sync::try_lock(&self.plans) {
            Some(mut plans) => self.take_idle_regions(&mut plans, st, wait, |_| true, |_, _| true),
            None => return false,
        };
        let any = !idle.is_empty();
        for region in idle {
            // The plan's was its one hold, and no one can take another now. (A poisoned one
            // waits for a host wait, as `release_region` has it.)
            match crate::sync::arc_into_inner(region) {
                Some(r) if r.is_poisoned() => st.poisoned.push(r),
                Some(r) => self.return_region(st, r),
                None => {}
            }
        }
        any
    }

    /// Takes from `plans` the regions of the streams `which` picks that only their plan holds
    /// (see [`Shared::release_idle_regions`]), forgetting the adopted plans with theirs.
    fn take_idle_regions(
        &self,
        plans: &mut Plans,
        st: &mut State,
        wait: bool,
        which: impl Fn(StreamId) -> bool,
        mut fits: impl FnMut(&State, &Region) -> bool,
    ) -> Vec<Arc<Region>> {
        let mut idle = Vec::new();
        let entries = plans.values_mut().flat_map(|streams| streams.iter_mut());
        for (_, p) in entries.filter(|(s, _)| which(*s)) {
            // Escapes whose other streams' work completed (`wait`: is waited for) join it: it
            // may be idle now.
            if let Some(r) = &p.region {
                self.settle_region(st, r, wait);
            }
            // A holder clones the plan's `Arc` under the plans' lock only (`plan_for`,
            // `make_region`, `adopt_region`): a count of one here stays one while it is held.
            // (A poisoned one nothing else holds goes too: it waits for a host wait in
            // `State::poisoned`, then returns to the pool.)
            #[cfg(not(tidepool_broken = "region_idle"))]
            let alone = |r: &mut Arc<Region>| {
                Arc::strong_count(r) == 1
                    && (r.is_idle()
                        || (r.is_poisoned()
                            && !r.is_claimed()
                            && !cfg!(tidepool_broken = "poisoned_region_kept")))
            };
            // BROKEN: another hold (a run that has not claimed it yet) is not seen.
            #[cfg(tidepool_broken = "region_idle")]
            let alone = |r: &mut Arc<Region>| r.is_idle();
            let Some(r) = p.region.take_if(|r| alone(r) && fits(st, r)) else { continue };
            if r.is_adopted() && !self.broken(Broken::AdoptedPlanKept) {
                p.learned = None;
            }
            idle.push(r);
        }
        plans.retain(|_, streams| {
            streams.retain(|(_, p)| p.learned.is_some() || p.region.is_some() || p.learning != 0);
            !streams.is_empty()
        });
        idle
    }

    /// Forgets the plans learned on `stream` (destroyed): their regions return to the pool once
    /// no run or escaped buffer holds them. Their runs' learning marks end (nothing of the
    /// stream is left to trim).
    pub(super) fn forget_plans(&self, stream: StreamId) {
        let regions: Vec<Arc<Region>> = {
            let mut plans = lock(&self.plans);
            let mut regions = Vec::new();
            let mut marks = 0;
            for streams in plans.values_mut() {
                streams.retain_mut(|(s, p)| match *s == stream {
                    true => {
                        regions.extend(p.region.take());
                        marks += usize::from(p.learning != 0);
                        false
                    }
                    false => true,
                });
            }
            plans.retain(|_, streams| !streams.is_empty());
            if marks != 0 && !cfg!(tidepool_broken = "forgotten_learning_kept") {
                let mut st = self.lock_state();
                for _ in 0..marks {
                    self.set_learning(&mut st, stream, false);
                }
            }
            regions
        };
        for region in regions {
            self.release_region(region);
        }
    }

    /// Drops one hold on a region; the last one returns its block to the pool. A poisoned one
    /// (nothing ordered a slice's reuse) keeps its blocks allocated until a host wait
    /// ([`Shared::release_parked`]).
    pub(super) fn release_region(&self, region: Arc<Region>) {
        match crate::sync::arc_into_inner(region) {
            Some(r) => {
                let mut st = self.lock_state();
                // (A region a foreign capture's graph may use is kept for good: nothing shows
                // that graph gone.)
                if r.is_foreign() {
                    st.foreign_regions.push(r);
                    return;
                }
                match r.is_poisoned() {
                    true => st.poisoned.push(r),
                    false => self.return_region(&mut st, r),
                }
            }
            // A closed allocator (no handle left; the count goes to 0 before it closes): the
            // plan's region may be idle now, which a lock section's end returns to the device
            // (`Shared::release_closed`). Without it, the region stayed until another free.
            None if self.handles.load(Ordering::Acquire) == 0
                && !cfg!(tidepool_broken = "closed_keeps_cache") =>
            {
                drop(self.lock_state());
            }
            None => {}
        }
    }

    /// Returns a region no one holds to the pool. The caller holds the global lock. Escapes'
    /// blocks still settling go to the pool as a freed buffer's would: behind their events.
    pub(super) fn return_region(&self, st: &mut State, r: Region) {
        let size = r.size;
        let (blocks, settling) = r.into_parts();
        st.note_returned(&blocks, true);
        batch::return_batch(&mut st.pool, &mut st.base, None, &blocks);
        for s in settling {
            Self::pend_settling(st, s);
        }
        self.scope_counters.region_bytes.fetch_sub(size, Ordering::Relaxed);
    }

    /// An escape's block still settling, out of a region no one holds: pending on its events,
    /// as a freed buffer's block with uses on other streams is.
    pub(super) fn pend_settling(st: &mut State, s: Settling) {
        let b = s.block;
        st.note_returned(&[b], s.events.is_empty());
        if s.events.is_empty() {
            // (Not kept settling: `settle` lets it join. A count of 0 would pend it for good.)
            batch::return_batch(&mut st.pool, &mut st.base, None, &[b]);
            return;
        }
        st.pool.mark_pending(b.block);
        st.base.move_to_pending(b.quadrant, b.size);
        Self::pend_on(st, b.block, s.events);
    }

    /// An escape of a learning run, pinned in `region` (which adopted its segment), is freed
    /// with uses on other streams recorded for its pool block: an event is recorded on each
    /// and the block joins the region once they complete ([`Region::settle`]; its slice stays
    /// pinned meanwhile), as the block would otherwise join the pool. Whether it was taken:
    /// `false` where a stream's work can be neither marked nor waited for on the host (the
    /// caller frees it as before: into the pool, its slice pinned for good).
    ///
    /// Before, every such escape (a gradient the communication stream reads, say) took the
    /// event path to the pool and left its slice pinned for good: each later run missed the
    /// plan there, and the region never became idle, so `empty_cache`, the out-of-memory
    /// ladder and `release_stream` never let go of it. (`cfg(tidepool_broken =
    /// "escape_pinned")` does that again.)
    pub(super) fn absorb_later(
        &self,
        region: &Region,
        block: BatchBlock,
        ptr: DeviceAddr,
        stream: StreamId,
    ) -> bool {
        if cfg!(tidepool_broken = "escape_pinned") || !region.is_pinned(ptr.0) {
            return false;
        }
        let mut st = self.lock_state();
        let uses = st.stream_uses.get(&block.block).cloned().unwrap_or_default();
        let mut events = Vec::new();
        for s in uses {
            match self.mark(&mut st, s) {
                Mark::Event(e) => events.push((s, e)),
                Mark::Drained => {}
                // No event marks that stream's work: the host waits for all of it (a counted
                // sync, as a freed buffer's block waits), after which no stream's work is left
                // to wait for, or to mark. Where even that fails (a capture refuses it, or the
                // device failed), the caller frees the block as before, its slice pinned for
                // good. (BROKEN, `escape_unmarked_pinned`: that, without trying the wait.)
                Mark::Failed
                    if !cfg!(tidepool_broken = "escape_unmarked_pinned")
                        && self.host_wait(&mut st).is_ok() =>
                {
                    st.free_events.extend(events.drain(..).map(|(_, e)| e));
                    break;
                }
                Mark::Failed => {
                    st.free_events.extend(events.into_iter().map(|(_, e)| e));
                    return false;
                }
            }
        }
        if st.stash_closed && !events.is_empty() && !cfg!(tidepool_broken = "closed_settling") {
            // A closed allocator has no later lock section to let the block join once its
            // events complete, nor a run to claim the region: the host waits now (a counted
            // sync per event), as for a freed buffer's block, and the region, idle, goes back
            // as the lock is let go. (BROKEN, `closed_settling`: it settles, and the region
            // stays until the last buffer goes.)
            if self.wait_now(&mut st, &mut events) && self.host_wait(&mut st).is_err() {
                return false;
            }
        }
        // Taken back (for the sanitizer) before the slice can be unpinned: a run holding the
        // region may plan a slice over it as soon as it is. (BROKEN, `escape_reclaimed_late`:
        // the caller did it after, and such a hand-out read as one over a live buffer.)
        if !cfg!(tidepool_broken = "escape_reclaimed_late") {
            self.device.note_reclaim(ptr, block.size, stream);
        }
        // Pinned (checked above), and only this escape's free unpins its slice: taken.
        // (Streams destroyed through the family were drained: nothing to wait for.)
        if events.is_empty() {
            region.absorb(block, ptr.0);
        } else {
            region.absorb_later(Settling { offset: ptr.0, block, events });
        }
        st.stream_uses.remove(&block.block);
        st.buffer_uses.remove(&ptr.0);
        true
    }

    /// [`Shared::settle_region`] for a run that just claimed `region`, under the global lock.
    pub(super) fn settle_claimed(&self, region: &Region) {
        let mut st = self.lock_state();
        self.settle_region(&mut st, region, false);
    }

    /// Lets the escapes settling into `region` whose events completed join it: queried, or
    /// with `wait` waited for (a counted host sync each, as `empty_cache` waits for pending
    /// frees). Nothing during a capture, whose streams refuse both. The caller holds the global
    /// lock.
    pub(super) fn settle_region(&self, st: &mut State, region: &Region, wait: bool) {
        if !region.is_settling() || self.device.capture_underway() {
            return;
        }
        let dev = &self.device;
        // BROKEN (`settling_polled`): only polled, so `empty_cache` and the ladder keep it.
        match wait && !cfg!(tidepool_broken = "settling_polled") {
            true => {
                let syncs = &mut st.counters.host_syncs;
                let done =
                    |e| super::events::count_host_wait(syncs, dev.synchronize_event(e)).is_ok();
                region.settle(done, &mut st.free_events);
            }
            false => region.settle(|e| dev.query_event(e).unwrap_or(false), &mut st.free_events),
        }
    }

    /// Returns a scope's locally cached blocks of `stream` to the pool under one lock, and
    /// flushes the stream's cache with them.
    pub(super) fn free_blocks(&self, stream: StreamId, blocks: &[BatchBlock]) {
        if blocks.is_empty() {
            return;
        }
        let mut st = self.lock_state();
        self.return_to_stream(&mut st, stream, blocks);
    }

    /// Frees `blocks` of `stream` into the pool and flushes every cache lane of the stream, so
    /// its cached blocks coalesce with them. The caller holds the global lock.
    pub(super) fn return_to_stream(&self, st: &mut State, stream: StreamId, blocks: &[BatchBlock]) {
        let lanes = self.caches.lanes(stream);
        st.note_returned(blocks, true);
        batch::return_batch(&mut st.pool, &mut st.base, lanes.first().map(|c| &**c), blocks);
        for cache in lanes.iter().skip(1) {
            flush_into(cache, &mut st.pool);
        }
    }

    /// Takes a fresh transient block of `bytes` on `stream` for a plan's region, found or
    /// reserved like any allocation and accounted as allocated: the block and its address.
    pub(super) fn region_block(
        &self,
        st: &mut State,
        config: &Config,
        stream: StreamId,
        bytes: u64,
    ) -> Result<(BatchBlock, u64), AllocError> {
        // (The error is built only on the error path: `ok_or` built and dropped it each time.)
        let Some(rounded) = config.sizing.round(bytes) else {
            return Err(AllocError::InvalidSize { requested: bytes });
        };
        self.check_stream(st, stream)?;
        let key =
            PoolKey { residency: Residency::Transient, stream, kind: config.sizing.kind(rounded) };
        let block = self.find_or_reserve(st, config, key, bytes, rounded)?;
        let mut own = None;
        let sizing = self.alloc_sizing(st, block, &config.sizing, &mut own);
        let block = st.pool.allocate(block, rounded, bytes, sizing);
        let (addr, size) = (st.pool.block(block).addr, st.pool.block(block).size);
        let held = st.pool.segment(st.pool.block(block).segment).key.residency;
        let q = quadrant(key.kind, held);
        st.base.live_up(q, size, bytes, || self.caches.all());
        Ok((BatchBlock { block, quadrant: q, size, requested: bytes }, addr))
    }
}

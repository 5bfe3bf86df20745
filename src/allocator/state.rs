//! The allocator's shared state: [`Shared`] (device, config, caches, published statistics, plans)
//! and the slow-path [`State`] behind the global lock, with [`Locked`], the guard that marks the
//! published statistics stale when it is let go (the next `stats()` publishes them).
//!
//! ```text
//!  Shared ─┬─ state: Mutex<State> ── pool, pending events per stream, stream uses, counters
//!          ├─ caches (lock-free per-stream caches, fast_cache/)
//!          ├─ stats: SeqBlock (published copy, counters.rs)
//!          └─ plans: Mutex<name → stream → learned plan + region>
//! ```

use super::history::{Action, Ring, Tap};
use super::observers::Observers;
use super::*;

pub(crate) struct Shared<D: Device> {
    pub(super) device: Guarded<D>,
    pub(super) config: ArcCell<Config>,
    pub(super) device_total: u64,
    pub(super) state: Mutex<State>,
    /// One cache per stream that owns memory; added to under `state`'s lock.
    pub(super) caches: CacheTable,
    /// Whether frees may use the stream caches (`Config::fast_path`), set with the config.
    pub(super) fast_path: AtomicBool,
    /// The largest request the lanes' small hits may serve (0: none): the lanes' own bound
    /// (`StreamCache::fast_max_of` of the limits they are configured with, set beside them), a
    /// hint that sends a larger request to the large hit without looking its lane up.
    pub(super) small_hint: AtomicU64,
    /// Whether statistics are published for lock-free readers (off under `global_lock`, where
    /// `stats()` reads them under the lock), set with the config.
    pub(super) publish_stats: AtomicBool,
    /// The base statistics as published by the slow path (see `counters.rs`).
    pub(super) stats: SeqBlock<BASE_WORDS>,
    /// Test-only deliberate bug: skip every event that orders cross-stream reuse.
    pub(super) broken_skip_events: AtomicBool,
    /// Test-only deliberate bugs (`broken.rs`), one bit per [`Broken`] mode.
    #[cfg(feature = "test-hooks")]
    pub(super) broken: AtomicU64,
    /// Test only: what the next `set_config` runs between the lanes' new bounds and their
    /// flush ([`Allocator::before_next_flush`]).
    #[cfg(feature = "test-hooks")]
    pub(super) in_config_window: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    /// Test only: what the next lock-free `stats()` runs right after its copy
    /// ([`Allocator::after_next_collect`]).
    #[cfg(all(feature = "test-hooks", not(loom)))]
    pub(super) after_collect: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    /// Test only: what the next snapshot pickle runs right after the allocator's segments
    /// were read, or the next summary after its read ([`Allocator::after_next_view`]).
    #[cfg(feature = "test-hooks")]
    pub(super) after_view: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    /// Whether the memory history is recorded (then every operation takes the slow path).
    pub(super) recording: AtomicBool,
    /// Whether a freed large block may wait in its stream's cache: not with expandable segments,
    /// where a cached block would keep its pages from being released.
    pub(super) cache_large: AtomicBool,
    /// Out-of-memory observers and the failure callback (`observers.rs`).
    pub(super) observers: Observers,
    /// Acquisitions of `state`'s lock, for tests proving the fast path skips it.
    pub(super) lock_count: AtomicU64,
    /// Advanced (under the lock) by every section of `state`'s lock that may change the pool
    /// ([`Shared::lock_state`]): a large block checked in section `e` may be handed out again
    /// without the lock while it still reads `e` (`fast_cache::LargeVerdict`).
    pub(super) epoch: AtomicU64,
    /// Learned plans of named scopes, by name and stream. Taken before `state`, never inside it.
    pub(super) plans: Mutex<super::regions::Plans>,
    pub(super) scope_counters: ScopeCounters,
    /// Expandable-segment figures for lock-free readers (`expandable.rs`).
    pub(super) vm_published: expandable::VmPublished,
    /// What the general allocator and its private pools share (`private_pool.rs`).
    pub(super) family: Arc<private_pool::Family<D>>,
    /// Streams routed to private pools (used in the general allocator only).
    pub(super) routes: private_pool::Routes<D>,
    /// Which pool this is (id 0: the general allocator), and who uses it.
    pub(super) role: private_pool::PoolRole,
    /// `caching:false`: every free returns its segment to the device (`passthrough.rs`).
    pub(super) passthrough: AtomicBool,
    /// Blocks of at least this size (`max_split_size`) are oversize: never kept in a stream
    /// cache, so `oversize_allocations` counts exactly the live ones.
    pub(super) oversize_at: AtomicU64,
    /// The accumulated figures at the last `reset_accumulated_stats` (subtracted on read).
    pub(super) accumulated_base: ArcCell<MemoryStats>,
    /// The `Allocator` values of this allocator (the application's handles; a private pool's
    /// are its `MemPool`s'): when the general allocator's last one goes, the captures still
    /// underway are ended (`capture::end_orphaned`).
    pub(super) handles: AtomicUsize,
    /// Set by the first `begin_capture` (whose device captures): ends every capture of the
    /// family still underway. A function, so that `Allocator`'s drop, which knows only
    /// `D: Device`, can call what needs `D: Capture`.
    pub(super) end_captures: std::sync::OnceLock<fn(&super::Allocator<D>)>,
}

/// What a named scope learned, and the region its plan lives in.
#[derive(Default)]
pub(super) struct PlanState {
    pub(super) learned: Option<Arc<Learned>>,
    pub(super) region: Option<Arc<Region>>,
    /// The mark of the learning run of the scope on the stream that holds the stream's
    /// learning count (`Shared::learning_opens`), 0 if none.
    pub(super) learning: u64,
}

/// Scope and plan counters, updated without the allocator's lock, and the two counters of the
/// whole path that only its lock's holders write (readers load them without it).
#[derive(Default)]
pub(super) struct ScopeCounters {
    pub(super) plan_hits: AtomicU64,
    pub(super) plan_misses: AtomicU64,
    pub(super) plan_fallbacks: AtomicU64,
    pub(super) escapes: AtomicU64,
    pub(super) region_bytes: AtomicU64,
    /// Best-fit searches: written only under the global lock (a load and a store).
    pub(super) searches: AtomicU64,
    /// Allocation attempts that took the global lock (`MemoryStats::locked_allocations`):
    /// written only under it, as `searches`.
    pub(super) locked: AtomicU64,
}

/// A block freed by its user while other streams may still use it.
pub(super) struct PendingEvent {
    pub(super) event: EventId,
    pub(super) block: BlockId,
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) retries: u64,
    pub(super) ooms: u64,
    pub(super) device_alloc: u64,
    pub(super) device_free: u64,
    pub(super) host_syncs: u64,
    /// Waits for every pending event (PyTorch's `num_sync_all_streams`).
    pub(super) sync_all: u64,
    /// Reservations refused before the device was asked (`throw_on_cudamalloc_oom`,
    /// PyTorch's `num_oom_rejections`).
    pub(super) oom_rejections: u64,
    /// Slots whose lanes were re-tagged for a new stream (`CacheTable`).
    pub(super) lane_retags: u64,
}

#[derive(Default)]
pub(super) struct State {
    /// The configuration in force: the same `Arc` as `Shared::config` holds, replaced with it
    /// under this lock (`set_config`), so the slow path reads it here without loading the cell.
    pub(super) config: Arc<Config>,
    /// A second handle of `config` (or none): an allocation's plan holds it while the lock is
    /// held and gives it back, so the slow path touches no reference count.
    pub(super) config_spare: Option<Arc<Config>>,
    pub(super) pool: Pool,
    pub(super) counters: Counters,
    /// Streams a block was used on besides its own (`record_stream`), by block.
    pub(super) stream_uses: HashMap<BlockId, Vec<StreamId>>,
    /// Events recorded at free time, per stream they were recorded on, oldest first.
    pub(super) pending: BTreeMap<StreamId, VecDeque<PendingEvent>>,
    /// Outstanding events per pending block.
    pub(super) pending_count: HashMap<BlockId, usize>,
    /// Freed blocks whose free needed a host wait that a stream capture refused or the device
    /// failed: pending until a host wait that succeeds, made once no capture is underway
    /// (`Shared::release_parked`).
    pub(super) parked: Vec<BlockId>,
    /// Blocks freed while a capture of another family (or of the device itself) captured their
    /// stream or a stream they were used on: pending for the allocator's life, since the
    /// foreign graph's replays may write them for as long as it lives, which nothing here sees
    /// (`Shared::hold_for_foreign`); freed with the rest when the allocator goes.
    pub(super) foreign_held: Vec<super::buffer::Freed>,
    /// Regions let go of after one of their slices was freed during such a capture
    /// (`Region::mark_foreign`): their blocks stay allocated for the allocator's life, as
    /// `foreign_held`'s do, and go back with its segments.
    pub(super) foreign_regions: Vec<super::plan::Region>,
    /// Regions let go of while poisoned (a slice's reuse could be ordered by nothing): their
    /// blocks stay allocated until a device-wide synchronisation shows every use done
    /// (`Shared::release_parked`: the next event poll or sync with no capture underway).
    pub(super) poisoned: Vec<super::plan::Region>,
    /// Recorded-and-completed events ready for reuse.
    pub(super) free_events: Vec<EventId>,
    /// Streams that own segments, with how many (cross-stream search is skipped with one).
    pub(super) segment_streams: BTreeMap<StreamId, usize>,
    /// Every stream cache in stream order, as `Shared::caches` lists them (replaced with that
    /// list, under this lock): the lock holder walks them without loading the shared list.
    pub(super) lanes: Arc<Vec<Arc<StreamCache>>>,
    /// Statistics kept under this lock, published when read (`Shared::publish_now`).
    pub(super) base: BaseStats,
    /// Scratch list of streams whose pool free bytes changed.
    pub(super) dirty: Vec<StreamId>,
    /// Streams the device confirmed exist (asked once each); `destroy_stream` removes them.
    /// (A sorted vector: the slow path asks on every allocation, for one of a few streams.)
    pub(super) streams: crate::types::SortedMap<StreamId, ()>,
    /// Who last wrote and who read since, per live buffer (by address) announced with
    /// `use_on` on a stream other than its own; dropped when the buffer is freed.
    pub(super) buffer_uses: HashMap<u64, UseState>,
    /// Expandable segments: virtual ranges and their pages (`expandable.rs`).
    pub(super) vm: expandable::Vm,
    /// Where the memory history is recorded while it is: the family's ring (`history.rs`).
    pub(super) history: Option<Tap>,
    /// Ordinary segments of at least `max_split_size` (PyTorch's `oversize_segments`).
    pub(super) oversize_segments: crate::types::Stat,
    /// Bases of the segments counted in `oversize_segments`.
    pub(super) oversize_bases: BTreeSet<u64>,
    /// The segment reserved up front (`initial_pool_size`), by base: kept until the end.
    pub(super) initial: Option<u64>,
    /// The allocator's last handle is gone: stream caches made from now on keep no owner
    /// references (`owner.rs`).
    pub(super) stash_closed: bool,
    /// `reset_peak_stats` was called in this lock section: the peaks are reset as it ends,
    /// after its settle ([`Shared::publish`]), to what it leaves.
    pub(super) peaks_reset_due: bool,
    /// This allocator's share of `Family::reserved`: its reserved bytes as last counted in,
    /// plus what a check of the caps charged since (`pool_size.rs`).
    pub(super) family_share: u64,
}

/// The streams that touched a buffer, as `Buffer::use_on` tracks them (cudarc's read and write
/// events, by stream): a use waits for the last writer, a write also for the readers since.
pub(super) struct UseState {
    pub(super) writer: StreamId,
    pub(super) readers: Vec<StreamId>,
}

impl State {
    /// Adds an entry to the memory history, if it is recorded.
    #[inline]
    pub(super) fn note(&mut self, action: Action, addr: DeviceAddr, size: u64, stream: StreamId) {
        if let Some(tap) = &self.history {
            tap.push(action, addr, size, stream);
        }
    }

    /// Notes the frees of `blocks`, allocated pool blocks going back in a batch (`free_batch`'s
    /// buffers, a scope's locally cached blocks, a plan region's blocks), if the history is
    /// recorded: a `free_requested` each, and (`completed`: the block joins the pool now, not
    /// behind events) its `free_completed`. Called before the pool frees them.
    /// BROKEN (`batch_frees_unrecorded`): nothing noted; the history kept them allocated.
    pub(super) fn note_returned(&mut self, blocks: &[super::batch::BatchBlock], completed: bool) {
        if self.history.is_none() || cfg!(tidepool_broken = "batch_frees_unrecorded") {
            return;
        }
        for b in blocks {
            let block = self.pool.block(b.block);
            let (addr, stream) =
                (DeviceAddr(block.addr), self.pool.segment(block.segment).key.stream);
            self.note(Action::FreeRequested, addr, b.requested, stream);
            if completed {
                self.note(Action::FreeCompleted, addr, b.requested, stream);
            }
        }
    }
}

/// The global lock held: marks the published statistics stale when let go (`Shared::publish`).
pub(super) struct Locked<'a, D: Device> {
    pub(super) sh: &'a Shared<D>,
    pub(super) st: MutexGuard<'a, State>,
}

impl<D: Device> Deref for Locked<'_, D> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.st
    }
}

impl<D: Device> DerefMut for Locked<'_, D> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.st
    }
}

impl<D: Device> Drop for Locked<'_, D> {
    #[inline]
    fn drop(&mut self) {
        self.sh.publish(&mut self.st);
    }
}

impl<D: Device> Shared<D> {
    /// Records into `ring` from now on (`None`: stops recording): the stream caches close (or
    /// open again), so that every operation takes the slow path, which records it.
    pub(super) fn tap_history(&self, ring: Option<Ring>) {
        let on = ring.is_some();
        let mut st = self.lock_state();
        self.recording.store(on, Ordering::Relaxed);
        self.routes.set_recording(on);
        let config = st.config.clone();
        self.configure_lanes(&st, &config, on);
        if on {
            self.flush_all(&mut st);
        }
        let graph = self.role.graph_made.load(Ordering::Relaxed);
        st.history = ring.map(|r| Tap::new(r, self.role.id, graph));
    }

    /// Sets the stream caches' bounds, the fast path's switch and its size hint from `config`,
    /// the lanes closed to hits and frees alike (room and size bound 0) while the history is
    /// `recording`. The caller holds the global lock (and flushes what the new bounds leave
    /// out).
    pub(super) fn configure_lanes(&self, st: &State, config: &Config, recording: bool) {
        self.fast_path.store(config.fast_path() && !recording, Ordering::Relaxed);
        let closed = recording && !self.broken(Broken::HistoryLanesOpen);
        let lane_limits = limits(config, closed, st.vm.in_play(config));
        let hint = StreamCache::fast_max_of(lane_limits, &config.sizing);
        self.small_hint.store(hint, Ordering::Relaxed);
        for c in self.caches.all().iter() {
            c.configure(lane_limits, config.sizing);
        }
    }

    /// Marks a range's start or end in the history, if it is recorded (`history.rs`); the
    /// ring it went to. (The allocator's lock is taken to find the ring, and let go before the
    /// ring's is taken.)
    pub(super) fn annotate(&self, name: std::sync::Arc<str>, start: bool) -> Option<Ring> {
        if !self.recording.load(Ordering::Relaxed) {
            return None; // (no lock taken when nothing records)
        }
        let ring = self.history_ring()?;
        lock(&ring).annotate(name, start);
        Some(ring)
    }

    /// The family's history ring, while this allocator records into it.
    pub(super) fn history_ring(&self) -> Option<Ring> {
        self.lock_state().history.as_ref().map(|t| t.ring().clone())
    }
}

impl<D: Device> Shared<D> {
    /// Gives lane `c` the deliberate bugs that lanes keep under their own locks, as they are
    /// on now: `HotCreditKept`, `UnmarkedCredit` and the tag checks. Called for every lane at
    /// `Allocator::set_broken` and for each lane made later, so that a mode turned on before a
    /// stream had lanes (as the fuzz harness does, from the start) reaches them too.
    #[cfg(feature = "test-hooks")]
    pub(super) fn break_lane(&self, c: &super::fast_cache::StreamCache) {
        use super::fast_cache::{TAG_FREES, TAG_HITS};
        c.set_keep_hot(self.broken(Broken::HotCreditKept));
        c.set_unmarked(self.broken(Broken::UnmarkedCredit));
        c.set_broken_tags(TAG_FREES, self.broken(Broken::RetaggedLaneTakesStaleFrees));
        c.set_broken_tags(TAG_HITS, self.broken(Broken::RetaggedLaneServesAnyStream));
    }

    /// Whether the deliberate bug `mode` is on (never without feature `test-hooks`).
    #[inline(always)]
    pub(super) fn broken(&self, mode: Broken) -> bool {
        #[cfg(feature = "test-hooks")]
        return self.broken.load(Ordering::Relaxed) & mode.bit() != 0;
        #[cfg(not(feature = "test-hooks"))]
        {
            let _ = mode;
            false
        }
    }

    /// Whether `buffer` was made by this allocator: its owner handle leads here. Buffers of
    /// other allocators are refused, never looked up in this one's tables.
    #[inline]
    pub(super) fn owns(&self, buffer: &Buffer<D>) -> bool {
        let theirs: &Shared<D> = &buffer.owner;
        std::ptr::eq(theirs, self) || self.broken(Broken::ForeignBuffers)
    }
}

impl<D: Device> Drop for Shared<D> {
    /// The last handle and the last buffer are gone: wait for pending events and return every
    /// segment to the device.
    fn drop(&mut self) {
        let plans = std::mem::take(&mut *lock(&self.plans));
        let mut st = lock(&self.state);
        let mut st = std::mem::take(&mut *st);
        // Whatever of it the device takes back below, none of it is this allocator's any more.
        self.family.reserved.fetch_sub(std::mem::take(&mut st.family_share), Ordering::AcqRel);
        self.flush_all(&mut st);
        // No buffer is left (each holds the allocator), so the plans hold the only regions.
        for plan in plans.into_values().flatten().map(|(_, p)| p) {
            if let Some(r) = plan.region.and_then(|r| Arc::try_unwrap(r).ok()) {
                let (blocks, settling) = r.into_parts();
                st.note_returned(&blocks, true);
                for b in blocks {
                    st.pool.free(b.block);
                }
                // (Waited for below, with the other pending blocks.)
                for s in settling {
                    Self::pend_settling(&mut st, s);
                }
            }
        }
        let _ = self.sync_events(&mut st);
        // What no wait showed complete (a capture underway refuses every host wait, or the
        // device failed one): blocks still pending on events of other streams, or parked for a
        // host wait. Nothing will poll this allocator again, so they are taken as done and
        // what that frees goes to the family to be given back after a device-wide
        // synchronisation (`Leftovers::add_after_sync`). BROKEN (`unsettled_drop_lost`): they
        // stay pending, and their segments or pages outlive every allocator of the family.
        let unsettled = (!st.pending.is_empty() || !st.parked.is_empty())
            && !cfg!(tidepool_broken = "unsettled_drop_lost");
        // During a capture nothing is released here (`release_segments` waits for each
        // segment's stream first, which a capture refuses), and what is left may still be used
        // by work of its own stream: given back after that synchronisation too, not at once
        // (an unmap, which a capture allows, would pull pages from under a running kernel).
        // BROKEN (`captured_drop_unmaps`): tried at once.
        let in_capture =
            self.device.capture_underway() && !cfg!(tidepool_broken = "captured_drop_unmaps");
        if unsettled {
            for (_, events) in std::mem::take(&mut st.pending) {
                for done in events {
                    Self::event_done(&mut st, done);
                }
            }
            for block in std::mem::take(&mut st.parked) {
                Self::pending_block_done(&mut st, block);
            }
        }
        // Blocks held for a foreign capture's graph: nothing of this allocator is left to hand
        // them out, so they go back with its segments (releasing memory a live graph still
        // uses is the application's doing: it let go of the graph's allocator first).
        for f in std::mem::take(&mut st.foreign_held) {
            Self::free_now(&mut st, &f, true);
        }
        for r in std::mem::take(&mut st.foreign_regions) {
            self.return_region(&mut st, r);
        }
        st.initial = None; // the initial pool goes too
        self.poll_retiring(&mut st, true);
        // (Unsettled or in a capture: nothing goes back before that synchronisation.)
        if !unsettled && !in_capture {
            let _ = self.release_segments(&mut st, |_| true);
            self.free_ranges(&mut st, |_| true);
        }
        let mut left: Vec<Leftover> = Vec::new();
        for e in st.free_events.drain(..) {
            if self.device.destroy_event(e).is_err() {
                left.push(Leftover::Event(e));
            }
        }
        if self.broken(Broken::LostLeftovers) {
            return; // BROKEN: what the device refused above is lost with this allocator
        }
        // What the device refused: the family tries again (`leftovers.rs`).
        let vm_left = self.vm_leftovers(&mut st.vm, &st.pool);
        // A mapping still in place here is one no wait showed idle (the host wait for its
        // stream's work, or for a retiring page's event, failed) or one whose unmap the device
        // refused: `vm_unmap` does not wait, so the ranges' leftovers go only after a
        // device-wide synchronisation, as unsettled blocks' do. Tried at once, they pulled
        // pages from under a kernel still running. BROKEN (`unwaited_pages_unmapped`): at once.
        let unwaited = vm_left.iter().any(|l| matches!(l, Leftover::Unmap { .. }))
            && !cfg!(tidepool_broken = "unwaited_pages_unmapped");
        let after_sync = match unwaited {
            true => vm_left,
            false => {
                left.extend(vm_left);
                Vec::new()
            }
        };
        let vm = &st.vm;
        // Free segments only: one holding a block still counted as allocated (only a bug
        // leaves one by now) stays as it is.
        for id in st.pool.releasable_segments(|s| !vm.contains(s.base)) {
            left.push(Leftover::Segment(DeviceAddr(st.pool.segment(id).base)));
        }
        left.extend(st.pending.values().flatten().map(|p| Leftover::Event(p.event)));
        match unsettled || in_capture {
            true => {
                left.extend(after_sync);
                self.family.leftovers.add_after_sync(left, &self.device);
            }
            false => {
                if !after_sync.is_empty() {
                    self.family.leftovers.add_after_sync(after_sync, &self.device);
                }
                self.family.leftovers.add_and_retry(left, &self.device);
            }
        }
    }
}

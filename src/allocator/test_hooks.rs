//! **Test only** (feature `test-hooks`): the deliberate bugs' switches and the views of the
//! stream caches, lanes and free index that tests assert on.

use super::*;

impl<D: Device> Allocator<D> {
    /// **Test only — a deliberate bug.** While on, the allocator records no event for
    /// `record_stream` uses and hands another stream's free segments over without ordering, so
    /// tests can prove that the SimDevice sanitizer catches premature reuse.
    pub fn set_broken_skip_events(&self, on: bool) {
        self.shared.broken_skip_events.store(on, Ordering::Relaxed);
    }

    /// **Test only — deliberate bugs** (feature `test-hooks`): turns the deliberate bug `mode`
    /// on or off, so tests can prove that they catch the bug its fix removed.
    #[doc(hidden)]
    pub fn set_broken(&self, mode: Broken, on: bool) {
        match on {
            true => self.shared.broken.fetch_or(mode.bit(), Ordering::Relaxed),
            false => self.shared.broken.fetch_and(!mode.bit(), Ordering::Relaxed),
        };
        if mode == Broken::DevicePanicsUnwind {
            self.shared.device.set_unwind(on);
        }
        if mode == Broken::CaptureForks {
            self.shared.device.set_records_in_captures(on);
        }
        if mode == Broken::DestroyedStreamsPerId {
            self.shared.family.destroyed_per_id(on);
        }
        // The lanes check these under their own locks, with no `Shared` in sight: each lane
        // holds its own copy (lanes made later copy them when made: `Shared::break_lane`).
        self.shared.caches.all().iter().for_each(|c| self.shared.break_lane(c));
    }

    /// **Test only** (feature `test-hooks`): whether `stream`'s cache is closed (`None`: it
    /// has none), so tests can see that a refused `destroy_stream` changed nothing.
    #[doc(hidden)]
    pub fn stream_cache_closed(&self, stream: StreamId) -> Option<bool> {
        self.shared.caches.get(stream).map(|c| c.is_closed())
    }

    /// **Test only** (feature `test-hooks`): the bytes each cache lane of `stream` holds, in
    /// lane order (empty before the stream has caches), and the calling thread's lane, so tests
    /// can see which lane a free cached its block in.
    #[doc(hidden)]
    pub fn lanes_cached_bytes(&self, stream: StreamId) -> (Vec<u64>, usize) {
        let lanes = self.shared.caches.lanes(stream);
        (lanes.iter().map(|c| c.cached_bytes_now()).collect(), lane_table::thread_lane())
    }

    /// **Test only** (feature `test-hooks`): whether each cache lane of `stream`, in lane
    /// order, is biased towards its owner thread now (`biased_lanes`, `lane_lock.rs`).
    #[doc(hidden)]
    pub fn lanes_biased(&self, stream: StreamId) -> Vec<bool> {
        self.shared.caches.lanes(stream).iter().map(|c| c.is_biased()).collect()
    }

    /// **Test only.** The stream each cache lane serves, in table order (lanes of a stream are
    /// adjacent): what the table holds, slotted lanes and unslotted ones alike.
    pub fn lane_streams(&self) -> Vec<StreamId> {
        self.shared.caches.all().iter().map(|c| c.stream()).collect()
    }

    /// **Test only.** The pool's free-index slots (one per pool key with segments, and retired
    /// ones waiting for a new key).
    pub fn pool_index_slots(&self) -> usize {
        lock(&self.shared.state).pool.index_slots()
    }

    /// **Test only.** Runs of consecutive stream ids the allocator's family keeps as destroyed
    /// through it (the record's size; see `destroyed.rs`).
    pub fn destroyed_stream_runs(&self) -> usize {
        self.shared.family.destroyed_runs()
    }

    /// **Test only.** How many times a fast-path slot's lanes were re-tagged for a new stream
    /// (its old stream destroyed), so far.
    pub fn lane_retags(&self) -> u64 {
        lock(&self.shared.state).counters.lane_retags
    }

    /// **Test only.** Polls the events that pending frees wait on, in a lock section of its
    /// own, as an allocation under the lock does before its search: the blocks whose events
    /// completed join the pool. Returns how many did. (A lock-free stream-cache hit polls
    /// nothing: the differential harness uses this to tell that lag from a difference.)
    pub fn poll_events(&self) -> usize {
        let mut st = self.shared.lock_state();
        let before = st.pending_count.len();
        self.shared.process_events(&mut st);
        before - st.pending_count.len()
    }

    /// **Test only.** Runs `window` once, in the next [`Allocator::set_config`]'s lock section
    /// between the lanes taking the new bounds and their flush: a stand-in for another
    /// thread's lock-free hit racing the call. `window` runs under the global lock, so it may
    /// only try hits ([`Allocator::hit_only`]); the slow path would wait for that lock.
    pub fn before_next_flush(&self, window: impl FnOnce() + Send + 'static) {
        *lock(&self.shared.in_config_window) = Some(Box::new(window));
    }

    /// **Test only.** Runs `window` once, in the next lock-free [`Allocator::stats`] right
    /// after its copy of the published figures (with no lock held): a stand-in for another
    /// thread's work between that copy and the rest of the read. What `window` changes must not
    /// show in that read, which is one picture of one moment.
    #[cfg(not(loom))]
    pub fn after_next_collect(&self, window: impl FnOnce() + Send + 'static) {
        *lock(&self.shared.after_collect) = Some(Box::new(window));
    }

    /// **Test only.** Runs `window` once, in the next [`Allocator::snapshot_pickle`] right
    /// after the allocator's segments were read (with no lock held), or in the next
    /// [`Allocator::memory_summary`] right after its read: a stand-in for another thread's
    /// work while a dump or a summary is taken. What `window` does must not show in that dump
    /// or summary, each one picture of one moment.
    pub fn after_next_view(&self, window: impl FnOnce() + Send + 'static) {
        *lock(&self.shared.after_view) = Some(Box::new(window));
    }

    /// **Test only.** The lock-free small hit alone: the buffer a lane hands out for `bytes`
    /// on `stream`, or `None` where the allocation would go on to the rest of the path.
    pub fn hit_only(&self, bytes: u64, stream: StreamId) -> Option<Buffer<D>> {
        self.hit(bytes, stream, Residency::Transient)
    }

    /// **Test only.** How many times the global lock has been taken so far (tests use it to
    /// prove that the fast path does not take it).
    pub fn global_lock_acquisitions(&self) -> u64 {
        self.shared.lock_count.load(Ordering::Relaxed)
    }
}

impl<D: Device> MemPool<D> {
    /// **Test only.** [`Allocator::poll_events`] for the pool: its own pending frees (a
    /// lock-free hit from one of its stream caches polls none either).
    pub fn poll_events(&self) -> usize {
        self.alloc.poll_events()
    }
}

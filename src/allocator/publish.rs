//! Statistics publishing: the slow path marks its figures stale when the global lock is let go
//! ([`Locked`]); the next reader publishes them, and assembles them with the stream caches' figures.

use super::*;

impl<D: Device> Shared<D> {
    /// Takes the global lock; the statistics are marked stale when it is let go.
    ///
    /// Every section that may change the pool comes through here, and advances the epoch first
    /// (a plain store: only holders of the lock write it), so a large block checked in an
    /// earlier section is not handed out again without the lock (`fast_cache::LargeVerdict`).
    ///
    /// The lock count is bumped under the lock with a load and a store (only lock holders
    /// write it): no atomic read-modify-write besides the mutex's own.
    pub(super) fn lock_state(&self) -> Locked<'_, D> {
        let st = lock(&self.state);
        self.count_lock();
        let e = self.epoch.load(Ordering::Relaxed);
        self.epoch.store(e.wrapping_add(1), Ordering::Release);
        Locked { sh: self, st }
    }

    /// Counts one acquisition of the global lock. The caller holds it.
    #[inline(always)]
    pub(super) fn count_lock(&self) {
        let n = self.lock_count.load(Ordering::Relaxed);
        self.lock_count.store(n + 1, Ordering::Relaxed);
    }

    /// What letting go of the global lock does: trims expandable ranges, and marks the published
    /// statistics stale (a write left open on the base block, see [`SeqBlock::open`]) instead of
    /// publishing them: the next reader publishes them ([`Shared::publish_now`]), so the slow
    /// path pays one store for its statistics, not a copy of every changed figure.
    /// (Under `global_lock` nothing is published: `stats()` reads under the lock.)
    ///
    /// Inlined into every lock section's end (`Locked`'s drop): the common case is a few loads
    /// and compares — nothing to settle, the extra figures' version unchanged, the family share
    /// unchanged, the base block's write already open — with each rarer step out of line.
    #[inline(always)]
    pub(super) fn publish(&self, st: &mut State) {
        if st.stash_closed
            || st.vm.settle_due()
            || st.peaks_reset_due
            || self.passthrough.load(Ordering::Relaxed)
        {
            self.settle_cold(st);
        }
        self.count_in_family(st);
        if self.publish_stats.load(Ordering::Relaxed) {
            self.stats.open();
        }
    }

    /// [`Shared::settle`] where there may be something to settle (out of line).
    #[cold]
    #[inline(never)]
    fn settle_cold(&self, st: &mut State) {
        self.settle(st);
        // After the settle, which may release memory (retired pages whose event completed, a
        // trim, a closed allocator's cache): reset before it, the peaks stayed above what the
        // section left, and `stats()` read peak > current right after `reset_peak_stats`
        // (found by the `allocator_ops` fuzzer once every section's end polled retired pages).
        // BROKEN (`peaks_reset_before_settle`): reset where `reset_peak_stats` asked for it.
        if st.peaks_reset_due {
            st.peaks_reset_due = false;
            self.reset_peaks_now(st);
        }
    }

    /// What every lock section ends with before its statistics go out: a closed allocator lets
    /// go of what it may, freed stitched blocks give their chunks back, expandable ranges are
    /// trimmed, and with caching off free segments go back to the device. A view that flushes
    /// the stream caches (`snapshot`, `expandable_ranges`) calls it before it reads, so that it
    /// shows what the lock section leaves, not pages or segments about to go.
    pub(super) fn settle(&self, st: &mut State) {
        if st.stash_closed {
            self.release_closed(st);
        }
        if !st.vm.is_empty() {
            self.unstitch_freed(st);
            // Pages retired behind their stream's event (a page move's old mapping under
            // `wait_event`, a trim's chunks under unfinished work) go once the event has
            // completed, at the first lock section's end after it, not only at the next trim or
            // growth: with no `release_threshold` no trim runs, and a training loop at steady
            // state grows no more, so a page move's old mapping stayed (a wall in the donor's
            // range, its chunk in transit) until some stream grew again. Where a trim is due
            // they go first, so that it sees them (as it did, even in a capture); otherwise no
            // event is queried during a capture.
            // BROKEN (`retiring_unpolled`): polled only where a trim is due.
            if !st.vm.retiring.is_empty()
                && (st.vm.trim_due()
                    || !cfg!(tidepool_broken = "retiring_unpolled")
                        && !self.device.capture_underway())
            {
                self.poll_retiring(st, false);
            }
            // (After a view's settle, the section's end trims nothing it listed: a trim checks
            // only the streams changed since the last one, and nothing was freed since.)
            self.trim(st);
            // (With no range left, the counters were published as the last range went.)
            self.publish_vm_changes(&mut st.vm);
        }
        if self.passthrough.load(Ordering::Relaxed) {
            self.release_free_segments(st);
        }
    }

    /// Flushes the stream caches into the pool and settles what that freed ([`Shared::settle`]):
    /// the state a view reads.
    pub(super) fn flush_for_view(&self, st: &mut State) {
        self.flush_all(st);
        if !cfg!(tidepool_broken = "view_unsettled") {
            self.settle(st);
        }
    }

    /// Publishes the base statistics and the pool's free bytes of every stream that changed
    /// (unless `global_lock` is on: then changes accumulate until it is turned off), closing
    /// the base block's open write. The caller holds the global lock.
    pub(super) fn publish_now(&self, st: &mut State) {
        if !self.publish_stats.load(Ordering::Relaxed) {
            return;
        }
        let counters = self.plain_counters(st);
        let changed = st.pool.take_changed();
        st.base.mirror_changed(&st.pool.stats(), counters, changed);
        let mut dirty = std::mem::take(&mut st.dirty);
        st.pool.take_dirty_streams(&mut dirty);
        for &s in &dirty {
            match self.caches.first_lane(s) {
                Some(c) => c.publish_pool_free(st.pool.free_bytes_of(s)),
                None => {
                    if let Some(c) = self.caches.get(s) {
                        c.publish_pool_free(st.pool.free_bytes_of(s));
                    }
                }
            }
        }
        st.dirty = dirty;
        // Last: closing the write tells readers that the pool free bytes are current too.
        st.base.publish(&self.stats);
    }

    /// The base's plain counters ([`counters::COUNTERS`]): the lock's own, then the expandable
    /// segments' as `publish_vm` left them, the extra figures (`extra_stats.rs`) and the scope
    /// counters written under the lock. In the base, a read takes them in the same copy as the
    /// pool's figures. (Read apart, after the copy, a growth another thread made meanwhile
    /// showed its maps and creates against the reserved bytes from before it, and an oversize
    /// allocation its oversize figures and its search against the allocated bytes before it.)
    pub(super) fn plain_counters(&self, st: &State) -> [u64; counters::COUNTERS] {
        let (c, v, sc) = (&st.counters, &self.vm_published, &self.scope_counters);
        let vm = |a: &AtomicU64| a.load(Ordering::Relaxed); // stored under this lock
        let mut out = [0; counters::COUNTERS];
        let lock_own = [c.retries, c.ooms, c.device_alloc, c.device_free, c.host_syncs];
        let vms = [
            u64::from(v.active.load(Ordering::Relaxed)),
            vm(&v.virtual_bytes),
            vm(&v.maps),
            vm(&v.unmaps),
            vm(&v.creates),
            vm(&v.releases),
            vm(&v.moves),
        ];
        let scopes = [vm(&sc.searches), vm(&sc.locked), vm(&sc.region_bytes)];
        let extra = extra_stats::words(st);
        let parts: [&[u64]; 4] = [&lock_own, &vms, &extra, &scopes];
        let mut at = 0;
        for part in parts {
            out[at..at + part.len()].copy_from_slice(part);
            at += part.len();
        }
        debug_assert_eq!(at, counters::COUNTERS);
        out
    }

    /// Adds the scope runs' tallies to statistics read elsewhere (counted as each run ends, by
    /// the run: none is written under the global lock, so none is in the base's copy).
    pub(super) fn with_scope_stats(&self, mut m: MemoryStats) -> MemoryStats {
        let c = &self.scope_counters;
        m.plan_hits = sh_load(&c.plan_hits);
        m.plan_misses = sh_load(&c.plan_misses);
        m.plan_fallbacks = sh_load(&c.plan_fallbacks);
        m.scope_escapes = sh_load(&c.escapes);
        m
    }
}

/// What a stream may cache under `config`, where `ranges` says whether blocks may be freed into
/// expandable ranges ([`super::expandable::Vm::in_play`]).
pub(super) fn limits(config: &Config, recording: bool, ranges: bool) -> Limits {
    Limits {
        // Recording the history closes every lane (to hits and frees alike): every operation
        // then takes the slow path, which records it. So does a `release_threshold` over
        // expandable segments (or over the ranges they left, switched off since): a free
        // there gives pages back at once, and a block waiting in a lane is not free in the
        // pool, so its page would stay mapped (large blocks are kept out of the lanes there
        // for the same reason: `Shared::large_cacheable`).
        // BROKEN (`lanes_under_threshold`): open, small blocks pin their pages.
        enabled: config.fast_path()
            && !recording
            && (!ranges
                || config.release_threshold == u64::MAX
                || cfg!(tidepool_broken = "lanes_under_threshold")),
        entries: config.fast_cache_entries,
        bytes: config.fast_cache_bytes,
        biased: config.biased_lanes,
        // Over expandable segments, the small pool's largest class lowest address first
        // (`fast_cache/`, `lowest_last`); elsewhere every class LIFO, as before.
        lowest_first: if config.expandable_segments { config.sizing.small_size } else { 0 },
    }
}

/// Builds [`MemoryStats`] from one consistent copy.
pub(super) fn stats_from(snap: counters::Snapshot) -> MemoryStats {
    let counters::Snapshot { base, fast, pool_free: slow, streams } = snap;
    let c = counters::counters(&base);
    let [retries, ooms, device_alloc, device_free, host_syncs] = *first::<5>(&c[..]);
    let [active, virtual_bytes, maps, unmaps, creates, releases, moves] = *first::<7>(&c[5..]);
    let (extra, scopes) =
        (&c[12..12 + extra_stats::EXTRA_WORDS], &c[12 + extra_stats::EXTRA_WORDS..]);
    let [searches, locked, region_bytes] = *first::<3>(scopes);
    let mut per_stream = Vec::new();
    let mut cached_fast_bytes = 0;
    for ((s, f), pool_free) in streams.iter().zip(&fast).zip(&slow) {
        let cached = f[counters::CACHED_BYTES];
        cached_fast_bytes += cached;
        // The lanes of a stream are adjacent: one entry per stream.
        match per_stream.last_mut() {
            Some((last, bytes)) if *last == s.0 => *bytes += cached + pool_free,
            _ => per_stream.push((s.0, cached + pool_free)),
        }
    }
    per_stream.retain(|&(_, bytes)| bytes > 0);
    let m = MemoryStats {
        blocks: counters::assemble(&base, &fast),
        num_alloc_retries: retries,
        num_ooms: ooms,
        num_device_alloc: device_alloc,
        num_device_free: device_free,
        num_host_syncs: host_syncs,
        expandable_segments: active != 0,
        virtual_reserved_bytes: virtual_bytes,
        num_device_map: maps,
        num_device_unmap: unmaps,
        num_physical_create: creates,
        num_physical_release: releases,
        num_pages_moved: moves,
        cached_free_bytes_per_stream: per_stream,
        cached_fast_bytes,
        best_fit_searches: searches,
        locked_allocations: locked,
        plan_region_bytes: region_bytes,
        ..MemoryStats::default()
    };
    extra_stats::with_extra_words(m, extra)
}

/// The first `N` words of `w`.
fn first<const N: usize>(w: &[u64]) -> &[u64; N] {
    w[..N].try_into().expect("the counters' layout")
}

pub(super) fn sh_load(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

//! The statistics' calls: `stats()` read lock-free (or under the lock), the reserved and
//! allocated bytes, and the peaks' reset, which reaches the family's private pools.

use super::*;

impl<D: Device> Allocator<D> {
    /// A consistent copy of every statistic, read without the global lock (see `counters.rs`):
    /// one double collect over the published base and stream-cache statistics. Under
    /// `global_lock:true` it is read under the lock instead; if writers keep interfering, too.
    /// Accumulated figures count from the last [`Allocator::reset_accumulated_stats`].
    ///
    /// The slow path does not publish its figures as it goes; when it has run since the last
    /// read, this read publishes them first, under the lock (once).
    pub fn stats(&self) -> MemoryStats {
        let sh = &self.shared;
        let lock_free = !sh.config.load().global_lock;
        if lock_free && sh.stats.is_open() {
            let mut st = lock(&sh.state);
            sh.count_lock();
            sh.publish_now(&mut st);
        }
        let raw = if lock_free
            && let Some(snap) = counters::collect(&sh.stats, || sh.caches.all(), STATS_TRIES)
        {
            let m = stats_from(snap);
            #[cfg(all(feature = "test-hooks", not(loom)))]
            if let Some(window) = lock(&sh.after_collect).take() {
                window();
            }
            // BROKEN (`vm_stats_apart`): the expandable segments' counters read after the
            // copy, apart from it: torn against its reserved bytes by another thread's growth.
            #[cfg(tidepool_broken = "vm_stats_apart")]
            let m = sh.with_vm_stats(m);
            // BROKEN (`extras_apart`): the extra figures (as the last lock section left them)
            // and the scope counters read after the copy, apart from it: torn against its
            // block figures by another thread's lock section meanwhile.
            #[cfg(tidepool_broken = "extras_apart")]
            let m = sh.with_extras_apart(m);
            sh.with_scope_stats(m)
        } else {
            self.stats_under_lock()
        };
        extra_stats::since(raw, &sh.accumulated_base.load(), sh.broken(Broken::ResetKeepsMaps))
    }

    /// Every statistic read under the lock: exact, whether or not they are being published
    /// (accumulated figures since the allocator was made).
    pub(super) fn stats_under_lock(&self) -> MemoryStats {
        self.shared.stats_under_lock()
    }

    /// Bytes currently reserved from the device.
    pub fn reserved_bytes(&self) -> u64 {
        self.stats().blocks.reserved_bytes.all.current
    }

    /// Bytes currently allocated to live buffers.
    pub fn allocated_bytes(&self) -> u64 {
        self.stats().blocks.allocated_bytes.all.current
    }

    /// Resets every peak statistic to its current value, PyTorch's `reset_peak_memory_stats`:
    /// this allocator's and, called on the general allocator, those of its private pools
    /// ([`MemPool`]s, CUDA graphs' pools) too, as PyTorch's reset covers every pool of the
    /// device. ([`MemPool::reset_peak_stats`] resets one pool's alone.)
    pub fn reset_peak_stats(&self) {
        self.shared.reset_peaks();
        for pool in self.shared.family_pools() {
            pool.reset_peaks();
        }
    }
}

impl<D: Device> Shared<D> {
    /// The private pools that the general allocator's statistics resets reach (none from a
    /// pool's own allocator).
    pub(super) fn family_pools(&self) -> Vec<Arc<Shared<D>>> {
        // BROKEN (`pool_stats_kept`): the general allocator's resets leave its pools' figures.
        if self.role.id != 0 || cfg!(tidepool_broken = "pool_stats_kept") {
            return Vec::new();
        }
        self.family.live_pools().into_iter().map(|(_, pool)| pool).collect()
    }

    /// [`Allocator::reset_peak_stats`] of this allocator alone.
    pub(super) fn reset_peaks(&self) {
        let mut st = self.lock_state();
        match cfg!(tidepool_broken = "peaks_reset_before_settle") {
            true => self.reset_peaks_now(&mut st),
            // Done as the section ends, after its settle (`Shared::settle_cold`).
            false => st.peaks_reset_due = true,
        }
    }

    /// Sets every peak to its current figure. The caller holds the global lock.
    pub(super) fn reset_peaks_now(&self, st: &mut State) {
        st.pool.reset_peak_stats();
        st.oversize_segments.reset_peak();
        st.base.reset_peaks(&self.caches.all());
    }

    /// [`Allocator::reset_accumulated_stats`] of this allocator alone.
    pub(super) fn reset_accumulated(&self) {
        let now = self.stats_under_lock();
        self.accumulated_base.store(Arc::new(now));
    }

    /// Every statistic read under the lock: exact, whether or not they are being published
    /// (accumulated figures since the allocator was made).
    pub(super) fn stats_under_lock(&self) -> MemoryStats {
        let sh = self;
        // The lock alone, not a lock section (`lock_state`), whose end settles: a read would
        // then release retired pages and trim, so under `global_lock`, where every read comes
        // here, when pages went hung on how often the statistics were read (the lock-free
        // read changes nothing). BROKEN (`locked_read_settles`): a section.
        #[cfg(tidepool_broken = "locked_read_settles")]
        let mut st = sh.lock_state();
        #[cfg(not(tidepool_broken = "locked_read_settles"))]
        let mut st = lock(&sh.state);
        #[cfg(not(tidepool_broken = "locked_read_settles"))]
        sh.count_lock();
        sh.stats_in(&mut st)
    }

    /// Every statistic read under the lock `st` the caller holds (see
    /// [`Shared::stats_under_lock`]).
    pub(super) fn stats_in(&self, st: &mut State) -> MemoryStats {
        let sh = self;
        let all = sh.caches.all();
        let inners: Vec<_> = all.iter().map(|c| c.lock_inner()).collect();
        let counters = sh.plain_counters(st);
        st.base.mirror(&st.pool.stats(), counters);
        let snap = counters::Snapshot {
            base: *st.base.words(),
            fast: inners.iter().map(|i| i.words).collect(),
            pool_free: (0..all.len())
                .map(|i| match CacheTable::is_first_lane(&all, i) {
                    true => st.pool.free_bytes_of(all[i].stream()),
                    false => 0,
                })
                .collect(),
            streams: all.iter().map(|c| c.stream()).collect(),
        };
        drop(inners);
        sh.with_scope_stats(stats_from(snap))
    }

    /// `m` with the extra figures and the scope counters of the base read apart from its copy
    /// (broken build `extras_apart`: what `stats()` did before they joined the base).
    #[cfg(tidepool_broken = "extras_apart")]
    fn with_extras_apart(&self, m: MemoryStats) -> MemoryStats {
        let mut m = extra_stats::with_extra_words(m, &extra_stats::words(&lock(&self.state)));
        let (c, sh_load) = (&self.scope_counters, super::publish::sh_load);
        m.best_fit_searches = sh_load(&c.searches);
        m.locked_allocations = sh_load(&c.locked);
        m.plan_region_bytes = sh_load(&c.region_bytes);
        m
    }
}

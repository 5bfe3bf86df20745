//! The pinned allocator's shared core ([`Inner`]): its lock, the recorded uses of blocks and
//! their events, blocks cached, freed or kept pending, and the close of the last handle.

use super::{HostAllocError, Inner, Pending, State, Use, is_oom, micros};
use crate::device::{Device, DeviceError, Guarded, HostPtr, StreamId};
use crate::sync::{MutexGuard, lock};

impl<D: Device> Inner<D> {
    /// Whether the deliberate bug of `HostAllocator::set_broken_drop_waits` is on.
    fn broken_drop_waits(&self) -> bool {
        #[cfg(feature = "test-hooks")]
        return self.broken_drop_waits.load(crate::sync::atomic::Ordering::Relaxed);
        #[cfg(not(feature = "test-hooks"))]
        false
    }

    pub(crate) fn device(&self) -> &Guarded<D> {
        &self.device
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Has `u` completed? Never blocks.
    pub(crate) fn use_complete(&self, u: &Use) -> Result<bool, DeviceError> {
        match u.event {
            Some(e) => self.device.query_event(e),
            None => Ok(self.lock().synced >= u.after),
        }
    }

    /// [`Inner::use_complete`] under the lock already held.
    fn use_done(&self, st: &State, u: &Use) -> Result<bool, DeviceError> {
        match u.event {
            Some(e) => self.device.query_event(e),
            None => Ok(st.synced >= u.after),
        }
    }

    /// Moves pending blocks whose uses all completed to the free lists.
    pub(super) fn process_events(&self, st: &mut State) -> Result<(), DeviceError> {
        // BROKEN (`capture_calls_unguarded`, with `Guarded`'s check): polled all the same.
        if !st.pending.is_empty() && self.capture_forbids_waits_and_frees() {
            return Ok(()); // no event may be polled during a capture: later
        }
        let mut i = 0;
        while i < st.pending.len() {
            // A block a closed allocator's drain waits for is the drain's to settle.
            if st.pending[i].settling {
                i += 1;
                continue;
            }
            let mut done = true;
            for u in &st.pending[i].uses {
                if !self.use_done(st, u)? {
                    done = false;
                    break;
                }
            }
            if !done {
                i += 1;
                continue;
            }
            let p = st.pending.remove(i).expect("index checked");
            st.events.extend(p.uses.iter().filter_map(|u| u.event));
            st.stats.pending_bytes -= p.size;
            st.stats.active.decrease(1);
            st.stats.active_bytes.decrease(p.size);
            self.cache_or_free(st, p.ptr, p.size);
        }
        if st.over_cached && !cfg!(tidepool_broken = "over_cached_kept") {
            // (Not during a capture: returned above, or nothing was pending.)
            self.free_over_cached(st);
        }
        Ok(())
    }

    /// Frees the cached blocks above the cached size, kept while a capture forbade their
    /// free; once no capture is underway.
    #[cold]
    fn free_over_cached(&self, st: &mut State) {
        if self.capture_forbids_waits_and_frees() {
            return;
        }
        st.over_cached = false;
        let above = self.config.max_cached_size.saturating_add(1);
        let sizes: Vec<u64> = st.free.range(above..).map(|(&s, _)| s).collect();
        for size in sizes {
            for ptr in st.free.remove(&size).unwrap_or_default() {
                // A refused free leaves the block cached; `empty_cache` tries again.
                let _ = self.release_block(st, ptr, size);
            }
        }
    }

    /// A block no buffer holds and no copy uses any more: into the free lists, or, above the
    /// configured `max_cached_size`, back to the device (kept cached where that fails, or while
    /// a capture forbids the free; `empty_cache` tries again).
    pub(super) fn cache_or_free(&self, st: &mut State, ptr: HostPtr, size: u64) {
        st.stats.cached_bytes += size;
        // BROKEN (`pinned_cache_unbounded`): every block is cached, whatever its size.
        let fits = self.config.caches(size) || cfg!(tidepool_broken = "pinned_cache_unbounded");
        if fits || self.capture_forbids_waits_and_frees() {
            st.over_cached |= !fits;
            st.free.entry(size).or_default().push(ptr);
            return;
        }
        let _ = self.release_block(st, ptr, size);
    }

    /// Returns a free block (out of the free lists, counted in `cached_bytes`) to the device;
    /// on an error it goes back to the free lists.
    fn release_block(&self, st: &mut State, ptr: HostPtr, size: u64) -> Result<(), DeviceError> {
        let start = std::time::Instant::now();
        // SAFETY: a free block belongs to no buffer (no slice into it exists) and every use
        // recorded on it completed (it left `pending` only then); it came from this device's
        // `host_alloc` and leaves the allocator's tables just below.
        match unsafe { self.device.host_free(ptr) } {
            Ok(()) => {
                st.stats.host_free_time.record(micros(start));
                st.blocks.remove(&ptr.addr());
                st.stats.cached_bytes -= size;
                st.stats.num_host_free += 1;
                st.stats.segment.decrease(1);
                st.stats.reserved_bytes.decrease(size);
                Ok(())
            }
            Err(e) => {
                st.free.entry(size).or_default().push(ptr);
                Err(e)
            }
        }
    }

    /// A new zeroed pinned block of `size` bytes, handed out to a buffer of `requested` bytes;
    /// on failure frees the cache and retries once. Made with no lock held when `held` is `None`
    /// (the state is locked only to free the cache and to count the block), else under the lock
    /// the caller holds.
    pub(super) fn new_block(
        &self,
        mut held: Option<&mut State>,
        requested: u64,
        size: u64,
    ) -> Result<HostPtr, HostAllocError> {
        let mut with_state = |f: &mut dyn FnMut(&mut State)| match held.as_deref_mut() {
            Some(st) => f(st),
            None => f(&mut self.lock()),
        };
        let mut result = self.timed_host_alloc(size);
        if let Err(e) = &result
            && is_oom(e)
            && !self.capture_forbids_waits_and_frees()
            && self.could_hold(size)
        {
            let mut freed = false;
            with_state(&mut |st| {
                if st.stats.cached_bytes > 0 {
                    st.stats.num_alloc_retries += 1;
                    // Errors freeing leave those blocks cached; the retry says whether it was
                    // enough.
                    let _ = self.release_free(st);
                    freed = true;
                }
            });
            if freed {
                result = self.timed_host_alloc(size);
            }
        }
        let (ptr, micros) = match result {
            Ok(done) => done,
            Err(error) if is_oom(&error) => {
                let mut reserved = 0;
                // Counted by `HostAllocator::alloc` once the peers' caches did not rescue it
                // (BROKEN, `rescued_oom_counted`: here, at each attempt).
                with_state(&mut |st| {
                    if cfg!(tidepool_broken = "rescued_oom_counted") {
                        st.stats.num_ooms += 1;
                    }
                    reserved = st.stats.reserved_bytes.current;
                });
                return Err(HostAllocError::OutOfMemory {
                    requested,
                    class: size,
                    reserved,
                    error,
                });
            }
            Err(e) => return Err(HostAllocError::Device(e)),
        };
        // SAFETY: `ptr` is a fresh pinned allocation of `size` bytes (what `host_alloc` returns),
        // not yet handed to anyone (not even in the allocator's tables) and not used by any
        // copy; zeroing initialises it, so slices of it are valid `u8`s from now on.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, size as usize) };
        with_state(&mut |st| {
            st.stats.host_alloc_time.record(micros);
            st.blocks.insert(ptr.addr(), size);
            st.stats.num_host_alloc += 1;
            st.stats.segment.increase(1);
            st.stats.reserved_bytes.increase(size);
            // Handed out in the section that counts it reserved: a reader between two sections
            // (`stats`, `check_invariants`, on another thread) would see a block neither
            // cached nor allocated. BROKEN (`pinned_handout_apart`): the caller counts it, in a
            // section of its own.
            if !cfg!(tidepool_broken = "pinned_handout_apart") {
                count_hand_out(st, requested, size);
            }
        });
        Ok(ptr)
    }

    /// Whether a block of `size` bytes fits in the most pinned memory the device could ever
    /// hold ([`Device::host_capacity`]; unknown: yes). A larger one never fits, so an
    /// out-of-memory for it frees no cache, neither this allocator's nor its peers': it used
    /// to free both, so one oversized request (an eager upload, which then falls back to a
    /// plain copy) emptied every pinned cache of the device for nothing.
    /// (BROKEN, `pinned_oversize_evicts`: every block may fit.)
    pub(super) fn could_hold(&self, size: u64) -> bool {
        cfg!(tidepool_broken = "pinned_oversize_evicts")
            || self.device.host_capacity().is_none_or(|cap| size <= cap)
    }

    /// `Device::host_alloc`, with the microseconds it took when it succeeded.
    pub(super) fn timed_host_alloc(&self, size: u64) -> Result<(HostPtr, u64), DeviceError> {
        let start = std::time::Instant::now();
        self.device.host_alloc(size).map(|ptr| (ptr, micros(start)))
    }

    /// Frees every free block; the first error is returned, the failed block stays cached.
    pub(super) fn release_free(&self, st: &mut State) -> Result<(), DeviceError> {
        let mut first_err = None;
        for (size, blocks) in std::mem::take(&mut st.free) {
            for ptr in blocks {
                if let Err(e) = self.release_block(st, ptr, size) {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Synchronises the device, so every use whose event could not be recorded before now is
    /// complete. A host sync.
    pub(crate) fn synchronize(&self) -> Result<(), DeviceError> {
        let ticket = {
            let mut st = self.lock();
            st.next_sync += 1;
            st.next_sync - 1
        };
        self.device.synchronize()?;
        let mut st = self.lock();
        st.synced = st.synced.max(ticket);
        st.stats.num_host_syncs += 1;
        Ok(())
    }

    /// Blocks until `u` completed.
    pub(crate) fn wait_use(&self, u: &Use) -> Result<(), DeviceError> {
        match u.event {
            Some(e) => {
                if !self.device.query_event(e)? {
                    self.device.synchronize_event(e)?;
                    self.lock().stats.num_host_syncs += 1;
                }
                Ok(())
            }
            None if self.lock().synced >= u.after => Ok(()),
            None => self.synchronize(),
        }
    }

    /// Makes `stream`'s later work wait on the device for `u` (a host sync when `u` has no
    /// event).
    pub(crate) fn order_after(&self, stream: StreamId, u: &Use) -> Result<(), DeviceError> {
        match u.event {
            Some(e) => self.device.wait_event(stream, e),
            None => self.wait_use(u),
        }
    }

    /// Records the use of a block by work just enqueued on `stream`. On an error the use is
    /// still returned, without an event (complete after a later device synchronisation).
    pub(crate) fn record_use(
        &self,
        stream: StreamId,
        writes_host: bool,
    ) -> (Use, Result<(), DeviceError>) {
        let pooled = self.lock().events.pop();
        let event = match pooled {
            Some(e) => Ok(e),
            None => self.device.create_event(),
        };
        let recorded = event.and_then(|e| match self.device.record_event(e, stream) {
            Ok(()) => Ok(e),
            Err(err) => {
                self.lock().events.push(e);
                Err(err)
            }
        });
        match recorded {
            Ok(e) => (Use { stream, event: Some(e), after: 0, writes_host }, Ok(())),
            Err(err) => {
                let after = self.lock().next_sync;
                (Use { stream, event: None, after, writes_host }, Err(err))
            }
        }
    }

    /// Returns events of uses known complete (or superseded) to the pool.
    pub(crate) fn recycle(&self, uses: impl IntoIterator<Item = Use>) {
        let mut st = self.lock();
        st.events.extend(uses.into_iter().filter_map(|u| u.event));
        self.destroy_closed_events(&mut st);
    }

    /// A closed allocator keeps no pooled events: only its live buffers record copies, and
    /// one that needs an event makes it (it comes back here as it is superseded or its block
    /// is freed). Otherwise a `mem::forget`ten buffer, which keeps the allocator's core alive,
    /// kept every event the allocator ever pooled, a device resource each. Not during a
    /// capture, as no block is freed then (the next drain does it); an event the device
    /// refuses to destroy stays pooled, for a later drain or the core's drop.
    /// (BROKEN, `closed_keeps_pinned_events`: kept until the last buffer goes.)
    fn destroy_closed_events(&self, st: &mut State) {
        if cfg!(tidepool_broken = "closed_keeps_pinned_events")
            || !st.closed
            || st.events.is_empty()
            || self.capture_forbids_waits_and_frees()
        {
            return;
        }
        let refused: Vec<_> = std::mem::take(&mut st.events)
            .into_iter()
            .filter(|&e| self.device.destroy_event(e).is_err())
            .collect();
        st.events = refused;
    }

    /// A buffer gives its block back, with the uses recorded on it.
    pub(crate) fn give_back(&self, ptr: HostPtr, requested: u64, size: u64, uses: Vec<Use>) {
        let mut guard = self.lock();
        let st = &mut *guard;
        #[cfg(feature = "test-hooks")]
        let uses = if self.broken_skip_events.load(crate::sync::atomic::Ordering::Relaxed) {
            st.events.extend(uses.iter().filter_map(|u| u.event));
            Vec::new()
        } else {
            uses
        };
        let s = &mut st.stats;
        s.allocation.decrease(1);
        s.allocated_bytes.decrease(size);
        s.requested_bytes.decrease(requested);
        if uses.is_empty() {
            s.active.decrease(1);
            s.active_bytes.decrease(size);
            self.cache_or_free(st, ptr, size);
        } else {
            s.pending_bytes += size;
            st.pending.push_back(Pending { ptr, size, uses, settling: false });
        }
        if st.closed {
            drop(guard);
            self.drain_closed();
        }
    }

    /// A dropped buffer that work captured into a CUDA graph copies to or from: its block is
    /// kept for good, neither reused nor freed (a replay may copy at any time, and nothing can
    /// tell when the graph's last one ran), as PyTorch keeps pinned memory used in a capture.
    /// Its other uses' events go back to the pool.
    pub(crate) fn retire(&self, ptr: HostPtr, requested: u64, size: u64, uses: Vec<Use>) {
        if cfg!(tidepool_broken = "captured_recycled") {
            // BROKEN: the block goes back to the cache, reusable at once.
            self.recycle(uses);
            return self.give_back(ptr, requested, size, Vec::new());
        }
        self.recycle(uses);
        let mut st = self.lock();
        let s = &mut st.stats;
        s.allocation.decrease(1);
        s.allocated_bytes.decrease(size);
        s.requested_bytes.decrease(requested);
        s.captured_bytes += size;
        st.retired.push((ptr, size));
    }

    /// The last handle is gone (only buffers hold the allocator): nothing is cached any more.
    /// The freed blocks waiting on copies are waited for (host syncs, counted) and every free
    /// block goes back to the device; a buffer freed later goes back the same way
    /// ([`Inner::give_back`]). Without it one `mem::forget`ten buffer kept the whole pinned
    /// cache, page-locked, until the process ended.
    pub(super) fn close(&self) {
        if cfg!(tidepool_broken = "closed_keeps_cache") {
            return; // BROKEN: the cache stays until the last buffer goes
        }
        {
            // (Under the lock, as a clone's reopening: a handle cloned from a buffer since the
            // count reached 0 keeps the allocator open.)
            let mut st = self.lock();
            if self.handles.load(crate::sync::atomic::Ordering::Acquire) != 0 {
                return;
            }
            st.closed = true;
        }
        self.drain_closed();
    }

    /// Waits for the pending blocks' copies and frees every free block (a closed allocator).
    fn drain_closed(&self) {
        // BROKEN (`pinned_drain_apart`): the list taken in one section and each block counted
        // out of `pending_bytes` in another, after its wait: a reader between them (`stats`,
        // `check_invariants` through a live buffer's handle) saw it counted pending on no list.
        #[cfg(tidepool_broken = "pinned_drain_apart")]
        {
            let pending = std::mem::take(&mut self.lock().pending);
            pending.into_iter().for_each(|p| self.settle(p));
        }
        // The blocks stay on the list, counted pending, while their uses are waited for with
        // no lock held; each leaves it in the section that counts it out. Marked, so that no
        // other drain or poll takes them (nor pools their events) meanwhile.
        #[cfg(not(tidepool_broken = "pinned_drain_apart"))]
        {
            let mut st = self.lock();
            let taken: Vec<(HostPtr, Vec<Use>)> = (st.pending.iter_mut())
                .filter(|p| !p.settling)
                .map(|p| {
                    p.settling = true;
                    (p.ptr, p.uses.clone())
                })
                .collect();
            drop(st);
            for (ptr, uses) in taken {
                let waited = self.wait_uses(&uses);
                let mut st = self.lock();
                let i = st.pending.iter().position(|p| p.ptr == ptr);
                let i = i.expect("a block marked settling leaves the list only here");
                match waited {
                    true => {
                        let p = st.pending.remove(i).expect("index found");
                        self.settled(&mut st, p);
                    }
                    // Left pending, for a later drain.
                    false => st.pending[i].settling = false,
                }
            }
        }
        let mut st = self.lock();
        if st.closed && !self.capture_forbids_waits_and_frees() {
            let _ = self.release_free(&mut st);
        }
        self.destroy_closed_events(&mut st);
    }

    /// Waits for every copy recorded on a freed block, then makes it free. A block whose
    /// copies cannot be waited for (a device error, or a capture underway) is waited for by a
    /// device synchronisation; if that fails too it stays pending, for a later drain (or, when
    /// the allocator goes, leaked rather than freed under a copy).
    fn settle(&self, p: Pending) {
        let waited = self.wait_uses(&p.uses);
        let mut st = self.lock();
        if waited {
            self.settled(&mut st, p);
        } else if cfg!(tidepool_broken = "settle_drops_pending") {
            // BROKEN: the block leaves the pending list and is never freed.
            st.events.extend(p.uses.iter().filter_map(|u| u.event));
        } else {
            st.pending.push_back(p);
        }
    }

    /// Waits for every use in `uses` (no lock held); where one cannot be waited for (a device
    /// error, or a capture underway), for a device synchronisation. Whether that succeeded.
    fn wait_uses(&self, uses: &[Use]) -> bool {
        uses.iter().all(|u| self.wait_use(u).is_ok())
            || !self.broken_drop_waits() && self.synchronize().is_ok()
    }

    /// A pending block whose uses were all waited for, off the pending list: free.
    fn settled(&self, st: &mut State, p: Pending) {
        st.events.extend(p.uses.iter().filter_map(|u| u.event));
        st.stats.pending_bytes -= p.size;
        // No longer active, as `process_events` has it. (BROKEN `settle_keeps_active`:
        // counted active for good.)
        if !cfg!(tidepool_broken = "settle_keeps_active") {
            st.stats.active.decrease(1);
            st.stats.active_bytes.decrease(p.size);
        }
        self.cache_or_free(st, p.ptr, p.size);
    }

    /// Whether a capture is underway, so no event may be polled nor waited for, and no pinned
    /// memory freed (`cuMemFreeHost` synchronises). BROKEN (`capture_calls_unguarded`): never.
    pub(super) fn capture_forbids_waits_and_frees(&self) -> bool {
        !cfg!(tidepool_broken = "capture_calls_unguarded") && self.device.capture_underway()
    }
}

/// What a pinned allocator does for another of its device that ran out of pinned memory
/// (`src/peers.rs`): frees its free blocks whose copies completed (no wait).
impl<D: Device> crate::peers::Peer for Inner<D> {
    fn release_for_peer(&self) -> bool {
        if cfg!(tidepool_broken = "peers_kept") {
            return false; // BROKEN: the peers keep their caches
        }
        if self.capture_forbids_waits_and_frees() {
            return false; // nothing is freed while a capture is underway
        }
        let mut st = self.lock();
        let before = st.stats.reserved_bytes.current;
        let _ = self.process_events(&mut st);
        let _ = self.release_free(&mut st);
        st.stats.reserved_bytes.current < before
    }
}

impl<D: Device> Drop for Inner<D> {
    /// Runs when the last handle and the last buffer are gone: waits for pending blocks, frees
    /// every block and destroys the events. A block whose copies cannot be waited for (a device
    /// error) is waited for by a device synchronisation, and leaked rather than freed under a
    /// copy only if that fails too. While a capture is underway nothing can be waited for nor
    /// freed (CUDA forbids it): the blocks are leaked, the one case where pinned memory is.
    fn drop(&mut self) {
        let pending = std::mem::take(&mut self.lock().pending);
        for p in pending {
            self.settle(p);
        }
        let mut st = self.lock();
        if self.capture_forbids_waits_and_frees() {
            return;
        }
        let _ = self.release_free(&mut st);
        for e in std::mem::take(&mut st.events) {
            let _ = self.device.destroy_event(e);
        }
    }
}

/// Counts a block of `size` bytes handed out to a new buffer of `requested` bytes.
pub(super) fn count_hand_out(st: &mut State, requested: u64, size: u64) {
    let s = &mut st.stats;
    s.allocation.increase(1);
    s.allocated_bytes.increase(size);
    s.requested_bytes.increase(requested);
    s.active.increase(1);
    s.active_bytes.increase(size);
}

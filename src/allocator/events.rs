//! Stream order by events: recording an event on every other stream a freed block was used on,
//! polling them oldest first per stream, blocking on them in the OOM ladder, and making one stream
//! wait for others on the device.

use super::history::Action;
use super::*;

impl<D: Device> Shared<D> {
    /// Notes that `buffer` (of this allocator) is used on `stream` too: its free will wait for
    /// the work enqueued on `stream` up to that moment.
    pub(super) fn record_use(
        &self,
        buffer: &Buffer<D>,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        self.stream_exists(stream)?;
        if stream == buffer.stream {
            return Ok(());
        }
        buffer.mark_used_elsewhere();
        if let Some(tag) = buffer.scope_tag() {
            tag.used_on(stream);
        }
        let Some(block) = buffer.block() else { return Ok(()) };
        let mut st = self.lock_state();
        let uses = st.stream_uses.entry(block).or_default();
        if !uses.contains(&stream) {
            uses.push(stream);
        }
        Ok(())
    }

    /// The other streams pool block `block` was used on ([`Shared::record_use`]), a copy.
    pub(super) fn block_uses(&self, block: BlockId) -> Vec<StreamId> {
        self.lock_state().stream_uses.get(&block).cloned().unwrap_or_default()
    }

    /// Work about to be enqueued on `stream` will `access` `buffer` (of this allocator): makes
    /// `stream` wait, on the device, for the buffer's last write on another stream (its owner's
    /// work, until another stream wrote it) and, for a write, for the reads on other streams
    /// since; then records the use, so the block is not reused before it completed. What
    /// cudarc's `DevicePtr` asks of a device slice; see `Buffer::use_on`.
    pub(super) fn use_on(
        &self,
        buffer: &Buffer<D>,
        stream: StreamId,
        access: AccessKind,
    ) -> Result<(), AllocError> {
        self.stream_exists(stream)?;
        if self.broken(Broken::UseOn) || buffer.is_empty() {
            return Ok(());
        }
        if stream == buffer.stream && !buffer.used_elsewhere() {
            return Ok(()); // only ever used on its own stream: stream order is enough
        }
        let mut st = self.lock_state();
        let key = buffer.ptr.0;
        let (writer, readers) = match st.buffer_uses.get(&key) {
            Some(u) => (u.writer, u.readers.clone()),
            None => (buffer.stream, Vec::new()),
        };
        let mut after = Vec::new();
        if writer != stream {
            after.push(writer);
        }
        if access == AccessKind::Write {
            after.extend(readers.iter().filter(|&&r| r != stream && r != writer));
        }
        for other in after {
            let waited = match self.same_capture(other, stream) {
                true => self.order_in_capture(&mut st, other, stream),
                false => match self.mark(&mut st, other) {
                    Mark::Event(event) => {
                        let mut ok = self.device.wait_event(stream, event).is_ok();
                        if !ok {
                            // The device refused the wait: the host waits for `other`'s work
                            // instead, a host sync counted as every other. (BROKEN,
                            // `use_on_sync_uncounted`: not counted in `num_host_syncs`.)
                            ok = match cfg!(tidepool_broken = "use_on_sync_uncounted") {
                                true => self.device.synchronize_event(event).is_ok(),
                                false => self.sync_event(&mut st, event).is_ok(),
                            };
                        }
                        st.free_events.push(event);
                        ok
                    }
                    Mark::Drained => true,
                    Mark::Failed => false,
                },
            };
            if !waited {
                self.host_wait(&mut st)?;
            }
        }
        let u = st
            .buffer_uses
            .entry(key)
            .or_insert_with(|| UseState { writer: buffer.stream, readers: Vec::new() });
        match access {
            AccessKind::Write => {
                u.writer = stream;
                u.readers.clear();
            }
            AccessKind::Read if !u.readers.contains(&stream) => u.readers.push(stream),
            AccessKind::Read => {}
        }
        drop(st);
        self.record_use(buffer, stream)
    }

    /// Whether `a` and `b` are streams of one capture underway (one began it, or both joined
    /// it): ordering one after the other is then an edge of the graph, which no host wait and
    /// no stream outside the capture takes part in.
    fn same_capture(&self, a: StreamId, b: StreamId) -> bool {
        self.device.capture_underway()
            && self.device.capture_of(a).is_some_and(|o| self.device.capture_of(b) == Some(o))
    }

    /// Orders `stream`'s later work after `other`'s so far, both in one capture: an event
    /// recorded on `other` (a node of the capture) that `stream` waits on. `false` if the device
    /// refused either.
    fn order_in_capture(&self, st: &mut State, other: StreamId, stream: StreamId) -> bool {
        if self.broken(Broken::CaptureUseOnUnordered) {
            return true; // BROKEN: the use is recorded, never ordered
        }
        let Ok(event) = self.event(st) else { return false };
        let ok = self.device.record_event_in_capture(event, other).is_ok()
            && self.device.wait_event(stream, event).is_ok();
        st.free_events.push(event);
        ok
    }

    /// Records an event on `stream` now, marking the work enqueued on it so far. See [`Mark`].
    pub(super) fn mark(&self, st: &mut State, stream: StreamId) -> Mark {
        let drained = |e: &DeviceError| {
            self.broken(Broken::EventErrors)
                || (matches!(e, DeviceError::UnknownStream(_)) && self.gone_drained(stream))
        };
        let event = match self.event(st) {
            Ok(event) => event,
            Err(AllocError::Device(e)) if drained(&e) => return Mark::Drained,
            Err(_) => return Mark::Failed,
        };
        match self.device.record_event(event, stream) {
            Ok(()) => Mark::Event(event),
            Err(e) => {
                st.free_events.push(event);
                if drained(&e) { Mark::Drained } else { Mark::Failed }
            }
        }
    }

    /// Whether `stream`, which the device no longer knows, was destroyed through this
    /// allocator's family, whose `destroy_stream` returned once the device had drained it: then
    /// nothing of its work is left. A stream the device forgot otherwise (another allocator or
    /// the application destroying it, maybe on another thread right now: CUDA's
    /// `cuStreamDestroy` returns before the stream's work completes) may still run work, which
    /// only a wait for the whole device covers.
    pub(super) fn gone_drained(&self, stream: StreamId) -> bool {
        self.broken(Broken::GoneStreamDrained) // BROKEN: any stream the device forgot
            || self.family.destroyed_for(stream, self.role.id)
    }

    /// Blocks the host until every stream is idle: the wait for work no event could mark.
    /// Counted in `num_host_syncs` where the device waited ([`count_host_wait`]).
    pub(super) fn host_wait(&self, st: &mut State) -> Result<(), DeviceError> {
        count_host_wait(&mut st.counters.host_syncs, self.device.synchronize())
    }

    /// Blocks the host until `event` completed. Counted in `num_host_syncs` where the device
    /// waited ([`count_host_wait`]).
    pub(super) fn sync_event(&self, st: &mut State, event: EventId) -> Result<(), DeviceError> {
        count_host_wait(&mut st.counters.host_syncs, self.device.synchronize_event(event))
    }

    /// Waits on the host for each of `events` (a counted sync each), which go back to the
    /// free list; whether any wait failed (then only a [`Shared::host_wait`] shows the work
    /// done).
    pub(super) fn wait_now(&self, st: &mut State, events: &mut Vec<(StreamId, EventId)>) -> bool {
        let mut failed = false;
        for (_, event) in events.drain(..) {
            failed |= self.sync_event(st, event).is_err();
            st.free_events.push(event);
        }
        failed
    }

    /// An event from the pool, or a new one.
    pub(super) fn event(&self, st: &mut State) -> Result<EventId, AllocError> {
        match st.free_events.pop() {
            Some(e) => Ok(e),
            None => Ok(self.device.create_event()?),
        }
    }

    /// Polls pending events without blocking, oldest first per stream; frees blocks whose
    /// events all completed. A failing query counts as "not yet".
    pub(super) fn process_events(&self, st: &mut State) {
        if st.pending.is_empty() && !Self::awaits_host_wait(st) {
            return; // nothing to poll (and no device call to ask about captures)
        }
        if self.device.capture_underway() {
            return; // CUDA refuses event queries during a capture: later
        }
        if Self::awaits_host_wait(st) {
            self.release_parked(st);
        }
        let streams: Vec<StreamId> = st.pending.keys().copied().collect();
        for s in streams {
            while let Some(front) = st.pending.get(&s).and_then(VecDeque::front) {
                if !self.device.query_event(front.event).unwrap_or(false) {
                    break;
                }
                let done =
                    st.pending.get_mut(&s).and_then(VecDeque::pop_front).expect("front exists");
                Self::event_done(st, done);
            }
            if st.pending.get(&s).is_some_and(VecDeque::is_empty) {
                st.pending.remove(&s);
            }
        }
    }

    /// Blocks until every pending event completed, freeing their blocks. A host sync per event.
    pub(super) fn sync_events(&self, st: &mut State) -> Result<(), AllocError> {
        st.counters.sync_all += 1;
        while let Some((&s, _)) = st.pending.iter().next() {
            while let Some(front) = st.pending.get(&s).and_then(VecDeque::front) {
                self.sync_event(st, front.event)?;
                let done =
                    st.pending.get_mut(&s).and_then(VecDeque::pop_front).expect("front exists");
                Self::event_done(st, done);
            }
            st.pending.remove(&s);
        }
        if Self::awaits_host_wait(st) && !self.device.capture_underway() {
            self.release_parked(st);
        }
        Ok(())
    }

    /// Whether memory waits for a host wait: parked blocks, poisoned regions let go of.
    fn awaits_host_wait(st: &State) -> bool {
        // (The broken build `cfg(tidepool_broken = "poison_kept")` keeps poisoned regions for
        // good, as before stop 46: their segments outlived the allocator.)
        !st.parked.is_empty() || (!st.poisoned.is_empty() && !cfg!(tidepool_broken = "poison_kept"))
    }

    /// Frees the parked blocks (their free's host wait was refused during a capture, or
    /// failed) and returns the poisoned regions let go of (a slice's reuse that nothing could
    /// order) after a host wait, which no capture refuses now: every use of that memory,
    /// ordered or not, is done then. If the device fails it, they stay where they are.
    pub(super) fn release_parked(&self, st: &mut State) {
        if self.host_wait(st).is_err() {
            return;
        }
        for block in std::mem::take(&mut st.parked) {
            Self::pending_block_done(st, block);
        }
        if !cfg!(tidepool_broken = "poison_kept") {
            for r in std::mem::take(&mut st.poisoned) {
                self.return_region(st, r);
            }
        }
    }

    pub(super) fn event_done(st: &mut State, done: PendingEvent) {
        st.free_events.push(done.event);
        let n = st.pending_count.get_mut(&done.block).expect("pending block has a count");
        *n -= 1;
        if *n == 0 {
            st.pending_count.remove(&done.block);
            Self::pending_block_done(st, done.block);
        }
    }

    /// Pending block `block` (marked so in the pool) waits for `events`, each recorded on its
    /// stream: the last to complete frees it (`event_done`). `events` is not empty.
    pub(super) fn pend_on(st: &mut State, block: BlockId, events: Vec<(StreamId, EventId)>) {
        debug_assert!(!events.is_empty(), "a count of 0 would pend the block for good");
        st.pending_count.insert(block, events.len());
        for (s, event) in events {
            st.pending.entry(s).or_default().push_back(PendingEvent { event, block });
        }
    }

    /// A pending block's stream-ordered uses are complete: it joins the free pool.
    pub(super) fn pending_block_done(st: &mut State, block: BlockId) {
        let b = st.pool.block(block);
        let (addr, size, requested) = (DeviceAddr(b.addr), b.size, b.requested);
        let key = st.pool.segment(b.segment).key;
        st.pool.free(block);
        st.base.pending_done(quadrant(key.kind, key.residency), size, requested);
        st.note(Action::FreeCompleted, addr, requested, key.stream);
    }

    /// Makes `stream`'s later work wait, on the device, for the work enqueued so far on each of
    /// `others` (a freed planned buffer that was used on other streams). No host sync, unless
    /// the device refuses an event or a wait: then the host waits instead. `false` only if even
    /// that failed: nothing orders the memory's reuse, and the caller must not reuse it.
    #[must_use]
    pub(super) fn order_after(&self, stream: StreamId, others: &[StreamId]) -> bool {
        if others.is_empty() || self.broken_skip_events.load(Ordering::Relaxed) {
            return true;
        }
        let mut st = self.lock_state();
        let mut ordered = true;
        for &other in others {
            match self.mark(&mut st, other) {
                Mark::Event(event) => {
                    if self.device.wait_event(stream, event).is_err() {
                        // The owner stream is gone (or refuses to wait): whoever reuses the
                        // memory next may be any stream, so the other stream's work must be
                        // done now.
                        if self.sync_event(&mut st, event).is_err() {
                            ordered &= self.host_wait(&mut st).is_ok();
                        }
                    }
                    st.free_events.push(event);
                }
                // A stream destroyed through this allocator was drained.
                Mark::Drained => {}
                Mark::Failed => ordered &= self.host_wait(&mut st).is_ok(),
            }
        }
        ordered
    }
}

/// What recording an event on a stream gave ([`Shared::mark`]).
pub(super) enum Mark {
    /// The event, recorded after the stream's work so far.
    Event(EventId),
    /// The stream was destroyed through this allocator, which the device drained: nothing of
    /// it is left to wait for.
    Drained,
    /// The device refused (an event could not be made or recorded). The caller must not take
    /// this as "nothing to wait for": it waits on the host, or leaves the memory alone.
    Failed,
}

/// Counts in `syncs` (`num_host_syncs`) a host wait whose answer from the device is `waited`,
/// and returns that answer: only a wait the device performed counts. One it refused (during a
/// capture, which allows none; on a failing device) kept the host waiting for nothing. The one
/// rule for every host wait of the allocator ([`Shared::sync_event`], [`Shared::host_wait`], a
/// region's settle, the graphs' holds).
pub(super) fn count_host_wait(
    syncs: &mut u64,
    waited: Result<(), DeviceError>,
) -> Result<(), DeviceError> {
    // BROKEN (`refused_syncs_counted`, and `wait_counted_in_capture`, whose refused waits are
    // this rule's first case): a wait the device refused is counted too.
    let refused_counted = cfg!(tidepool_broken = "refused_syncs_counted")
        || cfg!(tidepool_broken = "wait_counted_in_capture");
    *syncs += u64::from(waited.is_ok() || refused_counted);
    waited
}

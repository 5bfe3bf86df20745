//! Stream order by events: recording an event on every other stream a freed block was used on,
//! polling them oldest first per stream, blocking on them in the OOM ladder, and making one stream
//! wait for others on the device.

use super::history::Action;
use super::*;

impl<D: Device> Shared<D> {
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
        while let Some((&s, _)) = st.pending.iter().next() {
            while let Some(front) = st.pending.get(&s).and_then(VecDeque::front) {
                st.counters.host_syncs += 1;
                self.device.synchronize_event(front.event)?;
                let done =
                    st.pending.get_mut(&s).and_then(VecDeque::pop_front).expect("front exists");
                Self::event_done(st, done);
            }
            st.pending.remove(&s);
        }
        Ok(())
    }

    pub(super) fn event_done(st: &mut State, done: PendingEvent) {
        st.free_events.push(done.event);
        let n = st.pending_count.get_mut(&done.block).expect("pending block has a count");
        *n -= 1;
        if *n == 0 {
            st.pending_count.remove(&done.block);
            let b = st.pool.block(done.block);
            let (addr, size, requested) = (DeviceAddr(b.addr), b.size, b.requested);
            let key = st.pool.segment(b.segment).key;
            st.pool.free(done.block);
            st.base.pending_done(quadrant(key.kind, key.residency), size, requested);
            st.note(Action::FreeCompleted, addr, requested, key.stream);
        }
    }

    /// Makes `stream`'s later work wait, on the device, for the work enqueued so far on each of
    /// `others` (a freed planned buffer that was used on other streams). No host sync.
    pub(super) fn order_after(&self, stream: StreamId, others: &[StreamId]) {
        if others.is_empty() || self.broken_skip_events.load(Ordering::Relaxed) {
            return;
        }
        let mut st = self.lock_state();
        for &other in others {
            let Ok(event) = self.event(&mut st) else {
                // No event to order with: wait for the other stream's work on the host.
                let _ = self.device.synchronize();
                st.counters.host_syncs += 1;
                continue;
            };
            // A stream that is gone was drained: nothing of it can still use the memory.
            if self.device.record_event(event, other).is_ok()
                && self.device.wait_event(stream, event).is_err()
            {
                // The owner stream is gone (or refuses to wait): whoever reuses the memory next
                // may be any stream, so the other stream's work must be done now.
                let _ = self.device.synchronize_event(event);
                st.counters.host_syncs += 1;
            }
            st.free_events.push(event);
        }
    }
}

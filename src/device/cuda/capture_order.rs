//! Fork and join of the captures underway on a [`CudaDevice`](super::CudaDevice), kept from its
//! own `begin_capture`, `end_capture`, `record_event` and `wait_event` (no driver call): which
//! streams are captured and by which capture, and what each one's later captured work is
//! ordered after. Pure bookkeeping, tested without a GPU.
//!
//! ```text
//!   begin(s)        captures get a new number c; members[s] = Branch{origin s, c, records 0, clock {}}
//!   record(t)       t captured: records += 1; the event = {c, origin, clock[t] ∪ {t: records}}
//!   wait(u, event)  live event (its capture c still underway): u outside ⇒ joins (Branch from
//!                   the event's clock); u inside ⇒ clock[u] ∪= event's clock
//!   mark(t)         {c, t, records + 1}: the next event recorded on t covers it
//!   ordered_after(u, mark)  same capture, and u is the mark's stream or clock[u][t] ≥ position
//!   end(s)          every member of s's capture leaves
//! ```
//!
//! An event remembers the number of its capture, so an event recorded in an earlier capture
//! begun on the same stream is no node of a later one (it counts as complete once its capture
//! is over). Only order seen here counts: a join made through raw cudarc calls on the device's
//! streams is unknown, so such a stream is not counted as joined, and nothing is counted as
//! ordered that is not (a missed order only keeps a block held longer).

use crate::device::CaptureMark;
use crate::device::StreamId;
use crate::device::clock::Clock;
use std::collections::HashMap;

/// One capturing stream.
struct Branch {
    /// The stream its capture began on.
    origin: u32,
    /// Its capture's number.
    capture: u64,
    /// Events recorded on it in the capture so far.
    records: u64,
    /// What its later work is ordered after (event records of other branches).
    clock: Clock,
}

/// An event recorded on a capturing stream: a node of that capture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct CapturedEvent {
    capture: u64,
    /// The stream the capture began on.
    pub(super) origin: u32,
    clock: Clock,
}

/// The captures underway, by stream. See the module docs.
#[derive(Default)]
pub(super) struct CaptureOrder {
    /// Captures begun so far (the last one's number).
    begun: u64,
    members: HashMap<u32, Branch>,
}

impl CaptureOrder {
    /// Whether any capture is underway.
    pub(super) fn any(&self) -> bool {
        !self.members.is_empty()
    }

    /// The stream `stream`'s capture began on, if it is capturing.
    pub(super) fn origin_of(&self, stream: u32) -> Option<u32> {
        self.members.get(&stream).map(|b| b.origin)
    }

    /// Whether a capture began on `stream` and is underway.
    pub(super) fn began_on(&self, stream: u32) -> bool {
        self.origin_of(stream) == Some(stream)
    }

    /// Starts a capture on `stream` (not capturing).
    pub(super) fn begin(&mut self, stream: u32) {
        debug_assert!(!self.members.contains_key(&stream));
        self.begun += 1;
        let b = Branch { origin: stream, capture: self.begun, records: 0, clock: Clock::default() };
        self.members.insert(stream, b);
    }

    /// Ends the capture begun on `origin`: its streams leave it.
    pub(super) fn end(&mut self, origin: u32) {
        self.members.retain(|_, b| b.origin != origin);
    }

    /// Whether `event`'s capture is still underway.
    pub(super) fn live(&self, event: &CapturedEvent) -> bool {
        self.members.get(&event.origin).is_some_and(|b| b.capture == event.capture)
    }

    /// An event is recorded on `stream`: the capture node it is, if `stream` is capturing.
    pub(super) fn record(&mut self, stream: u32) -> Option<CapturedEvent> {
        let b = self.members.get_mut(&stream)?;
        b.records += 1;
        let mut clock = b.clock.clone();
        clock.raise(stream, b.records);
        Some(CapturedEvent { capture: b.capture, origin: b.origin, clock })
    }

    /// `stream` waited on `event`, a node of a live capture: it joins that capture, or orders
    /// its branch after the event. (The caller refuses a wait across captures.)
    pub(super) fn wait(&mut self, stream: u32, event: &CapturedEvent) {
        let b = self.members.entry(stream).or_insert_with(|| Branch {
            origin: event.origin,
            capture: event.capture,
            records: 0,
            clock: Clock::default(),
        });
        debug_assert_eq!(b.capture, event.capture, "a wait across captures");
        b.clock.join(&event.clock);
    }

    /// [`Device::capture_mark`](crate::Device::capture_mark) of `stream`.
    pub(super) fn mark(&self, stream: u32) -> Option<CaptureMark> {
        let b = self.members.get(&stream)?;
        Some(CaptureMark { capture: b.capture, stream: StreamId(stream), position: b.records + 1 })
    }

    /// [`Device::capture_ordered_after`](crate::Device::capture_ordered_after).
    pub(super) fn ordered_after(&self, stream: u32, mark: CaptureMark) -> bool {
        self.members.get(&stream).is_some_and(|b| {
            b.capture == mark.capture
                && (stream == mark.stream.0 || b.clock.get(mark.stream.0) >= mark.position)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joins_order_and_marks() {
        let mut o = CaptureOrder::default();
        assert!(!o.any());
        o.begin(1);
        assert!(o.began_on(1) && o.any());
        let before_fork = o.mark(1).unwrap();
        assert_eq!(before_fork.position, 1);
        let fork = o.record(1).unwrap();
        assert_eq!(o.record(2), None, "2 is not capturing");
        o.wait(2, &fork); // 2 joins
        assert_eq!((o.origin_of(2), o.began_on(2)), (Some(1), false));
        let m2 = o.mark(2).unwrap();
        assert_eq!((m2.stream, m2.position), (StreamId(2), 1));
        assert!(o.ordered_after(2, m2), "its own mark");
        assert!(!o.ordered_after(1, m2), "1 never waited on 2");
        assert!(o.ordered_after(2, before_fork), "2 joined after 1's work up to the fork");
        assert!(!o.ordered_after(2, o.mark(1).unwrap()), "1's work after the fork");
        let early = o.record(2).unwrap(); // covers m2 (position 1)
        let m2b = o.mark(2).unwrap(); // position 2: work after `early`
        o.wait(3, &early); // 3 joins through 2
        assert!(o.ordered_after(3, m2) && !o.ordered_after(3, m2b));
        let via3 = o.record(3).unwrap();
        o.wait(1, &via3);
        assert!(o.ordered_after(1, m2), "through 3");
        assert!(!o.ordered_after(1, m2b), "2's work after `early` is not ordered before 1");
        let late = o.record(2).unwrap();
        o.wait(1, &late);
        assert!(o.ordered_after(1, m2b));
        assert!(o.live(&fork));
        o.end(1);
        assert!(!o.any() && !o.live(&fork));
        assert!(!o.ordered_after(1, m2), "the capture ended");
    }

    /// The stale mark: an event recorded in an earlier capture begun on the same stream is no
    /// node of a later one, and marks of the earlier capture order nothing in it.
    #[test]
    fn an_earlier_captures_event_is_no_node_of_a_later_one() {
        let mut o = CaptureOrder::default();
        o.begin(1);
        let old = o.record(1).unwrap();
        let old_mark = o.mark(1).unwrap();
        o.end(1);
        o.begin(1);
        assert!(!o.live(&old), "same origin stream, another capture");
        let new = o.record(1).unwrap();
        assert!(o.live(&new));
        assert!(!o.ordered_after(1, old_mark));
    }
}

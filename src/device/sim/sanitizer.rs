//! The stream-order sanitizer: finds memory used or handed out on a stream that is not ordered
//! after another stream's unfinished work on it.
//!
//! Every operation a stream enqueues gets a *position* (1, 2, 3, … per stream). Work W at position
//! `n` of stream A is finished once A's worker has completed `n` operations; stream B is *ordered
//! after* W if B's vector clock says `clock[B][A] >= n` (B waited, maybe transitively, on an event
//! recorded on A after W), or if W has finished. Finished work is simply removed from `pending`, so
//! everything still in `pending` is unfinished by construction.
//!
//! ```text
//!   clocks : stream -> Clock{stream -> pos}   what the stream's *later* work is ordered after
//!   events : event  -> Clock                  the recording stream's clock at record time (+ itself)
//!   pending: start  -> [Pending{end, stream, pos, write}]  unfinished kernel accesses
//!   handed : start  -> Handed{end, stream}    ranges the allocator has handed out (disjoint)
//!
//!   record_event(e, A) at pos p : events[e] = clocks[A] ∪ {A: p}
//!   wait_event(B, e)            : clocks[B] = max(clocks[B], events[e])
//! ```
//!
//! Costs: `handout` and `reclaim` are O(log n) in the number of handed-out ranges (plus the number
//! of pending accesses they overlap, zero when no kernels run); `pending` only holds unfinished work
//! and `handed` only what is handed out now, so memory stays bounded.

use super::Violation;
use crate::device::clock::Clock;
use crate::device::{Access, AccessKind, DeviceAddr, StreamId};
use std::collections::{BTreeMap, HashMap};

/// One unfinished kernel access.
#[derive(Clone, Copy, Debug)]
struct Pending {
    end: u64,
    stream: u32,
    pos: u64,
    write: bool,
}

/// One handed-out range.
#[derive(Clone, Copy, Debug)]
struct Handed {
    end: u64,
    stream: u32,
}

/// The sanitizer's state; lives under the device lock.
pub(super) struct Sanitizer {
    enabled: bool,
    clocks: HashMap<u32, Clock>,
    events: HashMap<u64, Clock>,
    pending: BTreeMap<u64, Vec<Pending>>,
    /// Longest pending access; bounds how far left of a query an overlapping access can start.
    max_pending_len: u64,
    handed: BTreeMap<u64, Handed>,
    violations: Vec<Violation>,
}

impl Sanitizer {
    /// A sanitizer; a disabled one ignores every call.
    pub(super) fn new(enabled: bool) -> Sanitizer {
        Sanitizer {
            enabled,
            clocks: HashMap::new(),
            events: HashMap::new(),
            pending: BTreeMap::new(),
            max_pending_len: 0,
            handed: BTreeMap::new(),
            violations: Vec::new(),
        }
    }

    /// Every violation found so far.
    pub(super) fn violations(&self) -> &[Violation] {
        &self.violations
    }

    /// `event` was recorded on `stream` at position `pos`.
    pub(super) fn record(&mut self, event: u64, stream: u32, pos: u64) {
        if !self.enabled {
            return;
        }
        let mut clock = self.clocks.get(&stream).cloned().unwrap_or_default();
        clock.raise(stream, pos);
        self.events.insert(event, clock);
    }

    /// `stream`'s later work waits for `event`.
    pub(super) fn wait(&mut self, stream: u32, event: u64) {
        if !self.enabled {
            return;
        }
        if let Some(ev) = self.events.get(&event) {
            self.clocks.entry(stream).or_default().join(ev);
        }
    }

    /// `event` was destroyed.
    pub(super) fn forget_event(&mut self, event: u64) {
        self.events.remove(&event);
    }

    /// `stream` was destroyed after draining: nothing of it is pending any more.
    pub(super) fn forget_stream(&mut self, stream: u32) {
        if !self.enabled {
            return;
        }
        self.clocks.remove(&stream);
        for c in self.clocks.values_mut().chain(self.events.values_mut()) {
            c.forget(stream);
        }
    }

    /// Is `stream`'s next work ordered after pending access `p`?
    fn ordered(&self, stream: u32, p: &Pending) -> bool {
        p.stream == stream || self.clocks.get(&stream).is_some_and(|c| c.get(p.stream) >= p.pos)
    }

    /// Unfinished work on `[lo, hi)` that `stream` is not ordered after, merged per other stream
    /// into (other, first byte, end). With `write == false` only pending writes conflict.
    fn conflicts(&self, stream: u32, lo: u64, hi: u64, write: bool) -> Vec<(u32, u64, u64)> {
        let mut out: Vec<(u32, u64, u64)> = Vec::new();
        if self.pending.is_empty() || lo >= hi {
            return out;
        }
        let from = lo.saturating_sub(self.max_pending_len);
        for (&start, list) in self.pending.range(from..hi) {
            for p in list {
                if p.end <= lo || !(write || p.write) || self.ordered(stream, p) {
                    continue;
                }
                let (a, b) = (start.max(lo), p.end.min(hi));
                match out.iter_mut().find(|(s, _, _)| *s == p.stream) {
                    Some(o) => {
                        o.1 = o.1.min(a);
                        o.2 = o.2.max(b);
                    }
                    None => out.push((p.stream, a, b)),
                }
            }
        }
        out
    }

    pub(super) fn report(
        &mut self,
        found: &mut Vec<Violation>,
        lo: u64,
        hi: u64,
        stream: u32,
        other: Option<u32>,
        op: String,
    ) {
        let v = Violation {
            ptr: DeviceAddr(lo),
            bytes: hi - lo,
            stream: StreamId(stream),
            other: other.map(StreamId),
            op,
        };
        self.violations.push(v.clone());
        found.push(v);
    }

    /// Handed-out ranges overlapping `[lo, hi)`, as (start, entry), in address order.
    fn handed_overlaps(&self, lo: u64, hi: u64) -> Vec<(u64, Handed)> {
        let mut out = Vec::new();
        if let Some((&s, h)) = self.handed.range(..lo).next_back()
            && h.end > lo
        {
            out.push((s, *h));
        }
        out.extend(self.handed.range(lo..hi).map(|(&s, h)| (s, *h)));
        out
    }

    /// Is all of `[lo, hi)` handed out?
    #[cfg(test)]
    fn covered(&self, lo: u64, hi: u64) -> bool {
        self.covered_or_held(lo, hi, &[])
    }

    /// Is all of `[lo, hi)` handed out or inside one of `held`?
    fn covered_or_held(&self, lo: u64, hi: u64, held: &[(u64, u64)]) -> bool {
        let mut cur = lo;
        while cur < hi {
            let handed = match self.handed.range(..=cur).next_back() {
                Some((_, h)) if h.end > cur => Some(h.end),
                _ => None,
            };
            let graph = held.iter().filter(|&&(a, b)| a <= cur && cur < b).map(|&(_, b)| b).max();
            match handed.max(graph) {
                Some(end) => cur = end,
                None => return false,
            }
        }
        true
    }

    /// The allocator hands `[ptr, ptr + bytes)` to `stream`. Returns the violations found.
    pub(super) fn handout(&mut self, ptr: u64, bytes: u64, stream: u32) -> Vec<Violation> {
        let mut found = Vec::new();
        if !self.enabled || bytes == 0 {
            return found;
        }
        let (lo, hi) = (ptr, ptr.saturating_add(bytes));
        for (other, a, b) in self.conflicts(stream, lo, hi, true) {
            self.report(&mut found, a, b, stream, Some(other), "handout".into());
        }
        let overlaps = self.handed_overlaps(lo, hi);
        if let Some(&(_, first)) = overlaps.first() {
            // Handing out memory that is already out: two users own the same bytes.
            self.report(
                &mut found,
                lo,
                hi,
                stream,
                Some(first.stream),
                "handout of memory already handed out".into(),
            );
            self.cut(lo, hi, &overlaps);
        }
        self.handed.insert(lo, Handed { end: hi, stream });
        found
    }

    /// Removes `[lo, hi)` from the handed-out set, keeping the parts of `overlaps` outside it.
    fn cut(&mut self, lo: u64, hi: u64, overlaps: &[(u64, Handed)]) {
        for &(s, h) in overlaps {
            self.handed.remove(&s);
            if s < lo {
                self.handed.insert(s, Handed { end: lo, stream: h.stream });
            }
            if h.end > hi {
                self.handed.insert(hi, Handed { end: h.end, stream: h.stream });
            }
        }
    }

    /// The allocator took `[ptr, ptr + bytes)` back from its user (freed on `stream`). Work
    /// already enqueued on it stays pending; work launched later on it is a use after free.
    pub(super) fn reclaim(&mut self, ptr: u64, bytes: u64, stream: u32) -> Vec<Violation> {
        let mut found = Vec::new();
        if !self.enabled || bytes == 0 {
            return found;
        }
        let (lo, hi) = (ptr, ptr.saturating_add(bytes));
        // Fast path: the exact range that was handed out (what an allocator does).
        if self.handed.get(&lo).is_some_and(|h| h.end == hi) {
            self.handed.remove(&lo);
            return found;
        }
        let overlaps = self.handed_overlaps(lo, hi);
        let covered: u64 = overlaps.iter().map(|&(s, h)| h.end.min(hi) - s.max(lo)).sum();
        self.cut(lo, hi, &overlaps);
        if covered < hi - lo {
            self.report(
                &mut found,
                lo,
                hi,
                stream,
                None,
                "reclaim of memory not handed out".into(),
            );
        }
        found
    }

    /// A kernel `name` is enqueued on `stream` at position `pos`. `in_segment(lo, hi)` says
    /// whether a range lies inside one live segment; `held` lists ranges that count as handed
    /// out besides what is (a graph's memory, for its replays). Returns the violations found.
    pub(super) fn launch(
        &mut self,
        stream: u32,
        pos: u64,
        name: &str,
        accesses: &[Access],
        held: &[(u64, u64)],
        in_segment: impl Fn(u64, u64) -> bool,
    ) -> Vec<Violation> {
        let mut found = Vec::new();
        if !self.enabled {
            return found;
        }
        for a in accesses.iter().filter(|a| a.bytes > 0) {
            let (lo, hi) = (a.ptr.0, a.ptr.0.saturating_add(a.bytes));
            let write = a.kind == AccessKind::Write;
            if !self.covered_or_held(lo, hi, held) || !in_segment(lo, hi) {
                let op = format!("kernel {name} touches unallocated memory");
                self.report(&mut found, lo, hi, stream, None, op);
            }
            for (other, x, y) in self.conflicts(stream, lo, hi, write) {
                self.report(&mut found, x, y, stream, Some(other), format!("kernel {name}"));
            }
        }
        for a in accesses.iter().filter(|a| a.bytes > 0) {
            let p = Pending {
                end: a.ptr.0.saturating_add(a.bytes),
                stream,
                pos,
                write: a.kind == AccessKind::Write,
            };
            self.pending.entry(a.ptr.0).or_default().push(p);
            self.max_pending_len = self.max_pending_len.max(a.bytes);
        }
        found
    }

    /// The kernel at `pos` of `stream` with these `accesses` has finished.
    pub(super) fn complete(&mut self, stream: u32, pos: u64, accesses: &[Access]) {
        if !self.enabled {
            return;
        }
        for a in accesses.iter().filter(|a| a.bytes > 0) {
            if let Some(list) = self.pending.get_mut(&a.ptr.0) {
                list.retain(|p| !(p.stream == stream && p.pos == pos));
                if list.is_empty() {
                    self.pending.remove(&a.ptr.0);
                }
            }
        }
        if self.pending.is_empty() {
            self.max_pending_len = 0;
        }
    }

    /// Reports a violation found outside the sanitizer's own checks (memory that is not mapped,
    /// say); nothing when disabled.
    pub(super) fn flag(
        &mut self,
        lo: u64,
        hi: u64,
        stream: u32,
        other: Option<u32>,
        op: &str,
    ) -> Vec<Violation> {
        let mut found = Vec::new();
        if self.enabled {
            self.report(&mut found, lo, hi, stream, other, op.into());
        }
        found
    }

    /// `stream` is about to use (write, or read) memory whose physical pages are also mapped at
    /// `aliases`: unfinished work there that `stream` is not ordered after is a violation.
    pub(super) fn check_aliases(
        &mut self,
        stream: u32,
        aliases: &[(u64, u64)],
        write: bool,
        op: &str,
    ) -> Vec<Violation> {
        let mut found = Vec::new();
        if !self.enabled {
            return found;
        }
        for &(lo, hi) in aliases {
            for (other, a, b) in self.conflicts(stream, lo, hi, write) {
                self.report(&mut found, a, b, stream, Some(other), op.into());
            }
        }
        found
    }

    /// `stream` is handed memory whose physical pages are also mapped at `aliases`: any part of
    /// them still handed out there is the same memory owned twice.
    pub(super) fn alias_handed(&mut self, stream: u32, aliases: &[(u64, u64)]) -> Vec<Violation> {
        let mut found = Vec::new();
        if !self.enabled {
            return found;
        }
        for &(lo, hi) in aliases {
            if let Some(&(_, h)) = self.handed_overlaps(lo, hi).first() {
                let op = "handout of physical memory handed out at another address".to_string();
                self.report(&mut found, lo, hi, stream, Some(h.stream), op);
            }
        }
        found
    }

    /// `[lo, hi)` is unmapped now (a host-side act): any unfinished work on it, of any stream,
    /// and any part of it still handed out, is a violation. What was handed out is forgotten.
    pub(super) fn unmap(&mut self, lo: u64, hi: u64) -> Vec<Violation> {
        let mut found = Vec::new();
        if !self.enabled || lo >= hi {
            return found;
        }
        let from = lo.saturating_sub(self.max_pending_len);
        let mut busy: Vec<u32> = Vec::new();
        for (_, list) in self.pending.range(from..hi) {
            for p in list.iter().filter(|p| p.end > lo) {
                if !busy.contains(&p.stream) {
                    busy.push(p.stream);
                }
            }
        }
        for s in busy {
            let op = "unmap of memory that unfinished work uses".to_string();
            self.report(&mut found, lo, hi, s, Some(s), op);
        }
        let overlaps = self.handed_overlaps(lo, hi);
        if let Some(&(_, h)) = overlaps.first() {
            self.report(&mut found, lo, hi, h.stream, None, "unmap of memory handed out".into());
            self.cut(lo, hi, &overlaps);
        }
        found
    }

    /// A segment `[lo, hi)` was released (`cuMemFree`): any part of it still handed out is a
    /// violation (a live buffer over freed memory), reported as the span from the first to the
    /// last byte still out, with the stream of the first. What was handed out is forgotten.
    pub(super) fn release_segment(&mut self, lo: u64, hi: u64) -> Vec<Violation> {
        let mut found = Vec::new();
        if !self.enabled {
            return found;
        }
        let overlaps = self.handed_overlaps(lo, hi);
        // BROKEN (`release_forgets_handout`): forgotten without a report.
        if let (Some(&(first, h)), Some(&(_, last))) = (overlaps.first(), overlaps.last())
            && !cfg!(tidepool_broken = "release_forgets_handout")
        {
            let (a, b) = (first.max(lo), last.end.min(hi));
            let op = "release of memory handed out".to_string();
            self.report(&mut found, a, b, h.stream, None, op);
        }
        self.cut(lo, hi, &overlaps);
        found
    }

    /// Number of unfinished kernel accesses tracked (for tests of the memory bound).
    #[cfg(test)]
    pub(super) fn pending_len(&self) -> usize {
        self.pending.values().map(Vec::len).sum()
    }

    /// Number of handed-out ranges tracked (for tests of the memory bound).
    #[cfg(test)]
    pub(super) fn handed_len(&self) -> usize {
        self.handed.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acc(ptr: u64, bytes: u64, kind: AccessKind) -> Access {
        Access { ptr: DeviceAddr(ptr), bytes, kind }
    }

    #[test]
    fn handout_reclaim_split_and_cover() {
        let mut s = Sanitizer::new(true);
        assert!(s.handout(100, 100, 0).is_empty());
        assert!(s.covered(100, 200));
        assert!(!s.covered(99, 200));
        // Reclaim the middle: two remnants stay handed out.
        assert!(s.reclaim(140, 20, 0).is_empty());
        assert!(s.covered(100, 140) && s.covered(160, 200));
        assert!(!s.covered(139, 141));
        assert_eq!(s.handed_len(), 2);
        // Adjacent handouts cover together.
        assert!(s.handout(140, 20, 0).is_empty());
        assert!(s.covered(100, 200));
        // Double free and double handout are reported.
        assert!(s.reclaim(100, 100, 0).is_empty());
        assert_eq!(s.reclaim(100, 10, 1)[0].op, "reclaim of memory not handed out");
        assert!(s.handout(100, 10, 0).is_empty());
        let v = s.handout(105, 10, 1);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].op, "handout of memory already handed out");
        assert_eq!(v[0].other, Some(StreamId(0)));
        assert_eq!(s.handed_len(), 2); // [100,105) kept, [105,115) new
    }

    #[test]
    fn ordering_through_clocks_and_completion() {
        let mut s = Sanitizer::new(true);
        s.handout(0, 64, 1);
        assert!(s.launch(1, 1, "w", &[acc(0, 64, AccessKind::Write)], &[], |_, _| true).is_empty());
        // Stream 2 is not ordered after stream 1's write.
        let v = s.conflicts(2, 0, 64, false);
        assert_eq!(v, vec![(1, 0, 64)]);
        // Event recorded on 1 after the write, stream 3 waits, stream 2 waits on an event of 3.
        s.record(10, 1, 1);
        s.wait(3, 10);
        s.record(11, 3, 4);
        s.wait(2, 11);
        assert!(s.conflicts(2, 0, 64, true).is_empty(), "transitive order");
        // Completion removes the pending access for everyone.
        assert!(!s.conflicts(4, 0, 64, true).is_empty());
        s.complete(1, 1, &[acc(0, 64, AccessKind::Write)]);
        assert!(s.conflicts(4, 0, 64, true).is_empty());
        assert_eq!(s.pending_len(), 0);
        assert_eq!(s.max_pending_len, 0);
    }

    #[test]
    fn disabled_sanitizer_tracks_nothing() {
        let mut s = Sanitizer::new(false);
        assert!(s.handout(0, 64, 1).is_empty());
        assert!(
            s.launch(2, 1, "k", &[acc(0, 64, AccessKind::Write)], &[], |_, _| false).is_empty()
        );
        assert_eq!(s.handed_len(), 0);
        assert_eq!(s.pending_len(), 0);
        assert!(s.violations().is_empty());
    }
}

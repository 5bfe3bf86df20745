//! Memory history (PyTorch's `_record_memory_history`): a bounded ring of what the allocator did —
//! allocations, frees requested and completed, segments reserved and released, out-of-memory
//! errors — each with its size, address, stream, time and, optionally, the Rust stack of the call.
//!
//! ```text
//!   record_history(opts) ──▶ State.history = Some(ring of max_entries)
//!   slow path, under the lock: push(entry) ─▶ [oldest … newest]  (full: the oldest is dropped)
//!   dump_snapshot() ─▶ device_traces[0] = entries, oldest first   (stacks resolved only here)
//! ```
//!
//! Off by default and free when off: recording routes every operation through the slow path (the
//! stream caches and learned plans are bypassed while it is on, so every event is seen in order
//! under the one lock), and nothing on the hot path looks at it when it is off.

use crate::types::{DeviceAddr, StreamId};
use std::backtrace::Backtrace;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

/// How to record memory history ([`crate::Allocator::record_history`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HistoryOptions {
    /// How many entries the ring keeps (the oldest go first); 0 turns recording off.
    pub max_entries: usize,
    /// Capture the Rust stack of each allocation and free (resolved only when dumped).
    pub stacks: bool,
}

impl HistoryOptions {
    /// Record up to `max_entries` entries, without stacks.
    pub fn new(max_entries: usize) -> HistoryOptions {
        HistoryOptions { max_entries, stacks: false }
    }

    /// With (or without) the Rust stack of each call.
    pub fn with_stacks(mut self, on: bool) -> HistoryOptions {
        self.stacks = on;
        self
    }
}

impl Default for HistoryOptions {
    /// PyTorch's default: 100 000 entries; no stacks.
    fn default() -> Self {
        HistoryOptions::new(100_000)
    }
}

/// What happened, with PyTorch's action names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// A buffer was handed out (`alloc`).
    Alloc,
    /// Its user freed it (`free_requested`); the block may still wait for other streams.
    FreeRequested,
    /// The block is reusable: every stream that used it is done (`free_completed`).
    FreeCompleted,
    /// A segment was reserved from the device (`segment_alloc`).
    SegmentAlloc,
    /// A segment was returned to the device (`segment_free`).
    SegmentFree,
    /// Pages were mapped into an expandable range (`segment_map`).
    SegmentMap,
    /// Pages of an expandable range were unmapped (`segment_unmap`).
    SegmentUnmap,
    /// An allocation failed for lack of memory (`oom`); `size` is the request.
    Oom,
}

impl Action {
    /// PyTorch's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Oom => "oom",
        }
    }
}

/// One entry of the memory history.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TraceEntry {
    /// What happened.
    pub action: Action,
    /// The block's or segment's address (the device's free bytes for [`Action::Oom`]).
    pub addr: DeviceAddr,
    /// Bytes: what the user asked for (as PyTorch records it; the block may be rounded up), the
    /// segment's size, or the failed request.
    pub size: u64,
    /// The stream of the block or segment.
    pub stream: StreamId,
    /// Microseconds since recording started.
    pub time_us: u64,
    /// The Rust stack of the call, when stacks are recorded (captured lazily, resolved on dump).
    pub stack: Option<Arc<Backtrace>>,
}

/// The ring.
pub(crate) struct History {
    opts: HistoryOptions,
    start: Instant,
    entries: VecDeque<TraceEntry>,
}

impl History {
    pub fn new(opts: HistoryOptions) -> History {
        History { start: Instant::now(), entries: VecDeque::new(), opts }
    }

    /// Appends an entry, dropping the oldest when full.
    pub fn push(&mut self, action: Action, addr: DeviceAddr, size: u64, stream: StreamId) {
        if self.opts.max_entries == 0 {
            return;
        }
        if self.entries.len() == self.opts.max_entries {
            self.entries.pop_front();
        }
        let stack = self.opts.stacks.then(|| Arc::new(Backtrace::force_capture()));
        let time_us = self.start.elapsed().as_micros() as u64;
        self.entries.push_back(TraceEntry { action, addr, size, stream, time_us, stack });
    }

    pub fn entries(&self) -> impl Iterator<Item = &TraceEntry> {
        self.entries.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_the_newest_entries() {
        let mut h = History::new(HistoryOptions::new(3));
        for i in 0..5u64 {
            h.push(Action::Alloc, DeviceAddr(i * 512), 512, StreamId::DEFAULT);
        }
        let addrs: Vec<u64> = h.entries().map(|e| e.addr.0).collect();
        assert_eq!(addrs, vec![1024, 1536, 2048]);
        assert!(h.entries().all(|e| e.stack.is_none()));
        let mut off = History::new(HistoryOptions::new(0));
        off.push(Action::Oom, DeviceAddr(0), 1, StreamId::DEFAULT);
        assert_eq!(off.entries().count(), 0);
    }

    #[test]
    fn stacks_are_captured_when_asked() {
        let mut h = History::new(HistoryOptions::new(2).with_stacks(true));
        h.push(Action::Alloc, DeviceAddr(0), 512, StreamId::DEFAULT);
        let e = h.entries().next().unwrap();
        assert_eq!(e.action.name(), "alloc");
        assert!(e.stack.is_some());
    }
}

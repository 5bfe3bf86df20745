//! Memory history (PyTorch's `_record_memory_history`): a bounded ring of what the allocator did —
//! allocations, frees requested and completed, segments reserved and released, out-of-memory
//! errors — each with its size, address, stream, time, the user's metadata and, at the context
//! level asked for, the Rust stack of the call.
//!
//! One ring per allocator *family* — the general allocator and its private pools share it, as
//! PyTorch's one trace per device holds the allocations of every `MemPool` — each entry
//! tagged with the pool it was made in (`pool_id`, 0 for the general allocator).
//!
//! ```text
//!   record_history(opts) ──▶ Family.history.ring = Some(Arc<Mutex<ring of max_entries>>)
//!        (again: same ring, new options, unless clear_history)   and every allocator of the
//!        family (and each pool made later) gets a tap: State.history = (ring, its pool id)
//!   slow path, under the allocator's lock: tap ─▶ ring lock (a leaf) ─▶ push(entry)
//!        ─▶ [oldest … newest]  (full: the oldest is dropped; skip_actions: not kept)
//!   context State+: an allocation's stack kept by block address until its free completes
//!   record_annotation / a named scope's open and close ─▶ [START name, …, END name]
//!                      (as many as entries are kept, the oldest dropped first)
//!   dump_snapshot() ─▶ device_traces[0] = entries, oldest first; blocks' frames = their stacks
//!                      (stacks resolved only here); external_annotations = the marks
//! ```
//!
//! Off by default and free when off: recording routes every operation through the slow path (the
//! stream caches and learned plans are bypassed while it is on, so every event is seen in order
//! under the one lock), and nothing on the hot path looks at it when it is off.

use crate::sync::{Arc, Mutex, lock};
use crate::types::{DeviceAddr, StreamId};
use std::backtrace::Backtrace;
use std::collections::{HashMap, VecDeque};
use std::time::Instant;

/// Which calls keep their Rust stack: PyTorch's `context` argument of
/// `_record_memory_history`, level by level (each includes the ones before it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum HistoryContext {
    /// No stacks (`context=None`).
    #[default]
    None,
    /// The stack of each live block's allocation, in the snapshot's blocks only (`"state"`).
    State,
    /// Also on the history's allocation entries: `alloc`, `segment_alloc`, `segment_map`,
    /// `oom` (`"alloc"`).
    Alloc,
    /// Also on its free entries: `free_requested`, `free_completed`, `segment_free`,
    /// `segment_unmap` (`"all"`).
    All,
}

/// How to record memory history ([`crate::Allocator::record_history`]).
///
/// ```
/// use tidepool::{Action, HistoryContext, HistoryOptions};
/// let opts = HistoryOptions::new(10_000)
///     .with_context(HistoryContext::Alloc)
///     .with_skip_actions([Action::FreeRequested]);
/// assert_eq!(opts.context, HistoryContext::Alloc);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HistoryOptions {
    /// How many entries the ring keeps (the oldest go first); 0 turns recording off (and
    /// forgets the history).
    pub max_entries: usize,
    /// Which calls keep their Rust stack (resolved only when dumped).
    pub context: HistoryContext,
    /// Actions left out of the history (PyTorch's `skip_actions`).
    pub skip_actions: Vec<Action>,
    /// Start from an empty history when recording is already on (PyTorch's `clear_history`);
    /// otherwise the entries recorded so far stay, under the new options.
    pub clear_history: bool,
}

impl HistoryOptions {
    /// Record up to `max_entries` entries, without stacks.
    pub fn new(max_entries: usize) -> HistoryOptions {
        HistoryOptions {
            max_entries,
            context: HistoryContext::None,
            skip_actions: Vec::new(),
            clear_history: false,
        }
    }

    /// With (or without) the Rust stack of every call: [`HistoryContext::All`] (or `None`).
    pub fn with_stacks(self, on: bool) -> HistoryOptions {
        self.with_context(if on { HistoryContext::All } else { HistoryContext::None })
    }

    /// The calls that keep their Rust stack.
    pub fn with_context(mut self, context: HistoryContext) -> HistoryOptions {
        self.context = context;
        self
    }

    /// Leaves these actions out of the history.
    pub fn with_skip_actions(
        mut self,
        actions: impl IntoIterator<Item = Action>,
    ) -> HistoryOptions {
        self.skip_actions = actions.into_iter().collect();
        self
    }

    /// Starts from an empty history even when recording is already on.
    pub fn with_clear_history(mut self, on: bool) -> HistoryOptions {
        self.clear_history = on;
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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
    /// An allocation failed for lack of memory (`oom`); `size` is the request rounded up to
    /// its block size, as PyTorch records it.
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

    /// The context level from which its entry keeps a stack: allocations from `Alloc`, frees
    /// from `All` (PyTorch gathers a free's context only at `"all"`).
    fn stack_level(self) -> HistoryContext {
        match self {
            Action::Alloc | Action::SegmentAlloc | Action::SegmentMap | Action::Oom => {
                HistoryContext::Alloc
            }
            _ => HistoryContext::All,
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
    /// segment's size, or the failed request rounded up to its block size (PyTorch's
    /// `params.size()`).
    pub size: u64,
    /// The stream of the block or segment.
    pub stream: StreamId,
    /// Microseconds since the Unix epoch, as PyTorch's `time_us` (the system clock read when
    /// recording started, advanced by a monotonic clock: never going back within a history),
    /// so the histories of several devices and processes share one time line. An entry right
    /// after a range's end, or a range's start right after an entry, is stamped a microsecond
    /// later than the other where the clock gives both the same time, so that a reader merging
    /// entries and [`Annotation`]s by time orders them as they happened.
    pub time_us: u64,
    /// The Rust stack of the call, where the context level keeps it (captured lazily,
    /// resolved on dump).
    pub stack: Option<std::sync::Arc<Backtrace>>,
    /// The user's metadata when it happened ([`crate::Allocator::set_memory_metadata`]; empty
    /// when none was set).
    pub user_metadata: std::sync::Arc<str>,
    /// The pool it happened in: 0 for the general allocator, else the [`crate::MemPool::id`]
    /// of a private pool (a CUDA graph's included); PyTorch's `pool_id` is
    /// [`TraceEntry::pytorch_pool_id`].
    pub pool_id: u64,
    /// Whether that pool was made by a CUDA graph's capture given none.
    graph_pool: bool,
}

impl TraceEntry {
    /// The pool's id as PyTorch writes it (the dump's `pool_id`): `(0, 0)` for the general
    /// allocator, `(0, id)` for a [`crate::MemPool`] the user made, `(id, 0)` for the pool a
    /// CUDA graph's capture made when given none (PyTorch's graph-private pools).
    pub fn pytorch_pool_id(&self) -> (u64, u64) {
        super::private_pool::pytorch_pool_id(self.pool_id, self.graph_pool)
    }
}

/// One end of a named range of the program in the memory history (PyTorch's
/// `external_annotations` entries, which `torch.profiler.record_function` ranges make):
/// [`crate::Allocator::record_annotation`], and every named scope's open and close while
/// recording. `tidepool replay` reads the outermost ranges of a dump as scopes.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Annotation {
    /// The range's name.
    pub name: std::sync::Arc<str>,
    /// Its start (`START`) or its end (`END`).
    pub start: bool,
    /// Microseconds since the Unix epoch, on the entries' clock.
    pub time_us: u64,
}

/// The ring of a family, shared by its allocators' taps.
pub(crate) type Ring = Arc<Mutex<History>>;

/// What an allocator of the family records into: the family's ring, its own pool id and
/// whether a graph's capture made that pool.
pub(crate) struct Tap {
    ring: Ring,
    pool: u64,
    graph: bool,
}

impl Tap {
    pub fn new(ring: Ring, pool: u64, graph: bool) -> Tap {
        Tap { ring, pool, graph }
    }

    /// Appends an entry made by this allocator (the ring's lock is a leaf: taken under the
    /// allocator's own, never the other way round).
    pub fn push(&self, action: Action, addr: DeviceAddr, size: u64, stream: StreamId) {
        lock(&self.ring).push(action, addr, size, stream, (self.pool, self.graph));
    }

    pub fn ring(&self) -> &Ring {
        &self.ring
    }
}

/// The family's recording: its ring while recording, and the user's metadata (kept across
/// recordings, as PyTorch keeps it).
#[derive(Default)]
pub(crate) struct FamilyHistory {
    pub ring: Option<Ring>,
    pub user_metadata: std::sync::Arc<str>,
}

/// The ring.
pub(crate) struct History {
    opts: HistoryOptions,
    start: Instant,
    /// The system clock when recording started, in microseconds since the Unix epoch.
    epoch_us: u64,
    entries: VecDeque<TraceEntry>,
    /// The allocation stack of each live block, by address (context `State` and above), until
    /// its free completes: the snapshot's blocks show it. (Addresses are device memory, so
    /// the blocks of every pool of the family have distinct ones while live.)
    block_stacks: HashMap<u64, std::sync::Arc<Backtrace>>,
    /// Stamped on every entry ([`crate::Allocator::set_memory_metadata`]).
    user_metadata: std::sync::Arc<str>,
    /// Range marks, oldest first, as many as entries are kept.
    annotations: VecDeque<Annotation>,
    /// The last time stamped, the last entry's and the last range end's ([`History::stamp`]).
    last: [u64; 3],
    /// How many entries were ever kept, those dropped since included: the next entry's number
    /// (a dump cuts the history at the count an allocator's lock section read).
    pushed: u64,
}

/// What a history's time stamp is given to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stamped {
    Entry,
    Start,
    End,
}

impl History {
    pub fn new(opts: HistoryOptions, user_metadata: std::sync::Arc<str>) -> History {
        History {
            start: Instant::now(),
            epoch_us: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as u64),
            entries: VecDeque::new(),
            opts,
            block_stacks: HashMap::new(),
            user_metadata,
            annotations: VecDeque::new(),
            last: [0; 3],
            pushed: 0,
        }
    }

    /// Marks the start or the end of the range `name`, dropping the oldest mark when full.
    pub fn annotate(&mut self, name: std::sync::Arc<str>, start: bool) {
        if self.opts.max_entries == 0 {
            return;
        }
        if self.annotations.len() == self.opts.max_entries {
            self.annotations.pop_front();
        }
        let time_us = self.stamp(if start { Stamped::Start } else { Stamped::End });
        self.annotations.push_back(Annotation { name, start, time_us });
    }

    /// Microseconds since the Unix epoch on the history's clock (see [`TraceEntry::time_us`]).
    fn now_us(&self) -> u64 {
        self.epoch_us.saturating_add(self.start.elapsed().as_micros() as u64)
    }

    /// The time stamp of an entry or a range mark: the clock's, never before the last stamp,
    /// and later where a reader of the dump would otherwise misplace the two. Entries and
    /// marks are two lists, merged by time (`tidepool replay`, PyTorch's viewer): an entry at
    /// the time of a `START` reads as inside the range, at the time of an `END` as inside too.
    /// So every entry after an `END` is stamped later than it, and every `START` after an entry
    /// later than that entry. (In the same microsecond, the next scope's first allocation was
    /// read back as the last of the scope before, about one run in five on a loaded machine.)
    /// BROKEN (`history_ties`): the clock's reading alone.
    fn stamp(&mut self, what: Stamped) -> u64 {
        let now = self.now_us();
        if cfg!(tidepool_broken = "history_ties") {
            return now;
        }
        let [last, entry, end] = self.last;
        let after = match what {
            Stamped::Entry => end.saturating_add(1),
            Stamped::Start => entry.saturating_add(1),
            Stamped::End => 0,
        };
        let t = now.max(last).max(after);
        self.last = match what {
            Stamped::Entry => [t, t, end],
            Stamped::Start => [t, entry, end],
            Stamped::End => [t, entry, t],
        };
        t
    }

    pub fn annotations(&self) -> impl Iterator<Item = &Annotation> {
        self.annotations.iter()
    }

    /// Sets the metadata stamped on the entries made from now on.
    pub fn set_user_metadata(&mut self, metadata: std::sync::Arc<str>) {
        self.user_metadata = metadata;
    }

    /// Recording was asked for again: the entries stay (the oldest beyond the new bound go),
    /// the new options apply from here on.
    pub fn rearm(&mut self, opts: HistoryOptions) {
        while self.entries.len() > opts.max_entries {
            self.entries.pop_front();
        }
        while self.annotations.len() > opts.max_entries {
            self.annotations.pop_front();
        }
        if opts.context < HistoryContext::State {
            self.block_stacks.clear();
        }
        self.opts = opts;
    }

    /// Appends an entry, dropping the oldest when full. (Out of line: recording is rare, and
    /// inlined into every slow-path caller it would grow their stack frames.)
    #[inline(never)]
    pub fn push(
        &mut self,
        action: Action,
        addr: DeviceAddr,
        size: u64,
        stream: StreamId,
        (pool_id, graph_pool): (u64, bool),
    ) {
        let context = self.opts.context;
        let block = action == Action::Alloc && context >= HistoryContext::State;
        let kept = self.opts.max_entries != 0 && !self.opts.skip_actions.contains(&action);
        let entry_stack = kept && context >= action.stack_level();
        // Captured only where something keeps it: the block's state, or the entry.
        let stack = (block || entry_stack).then(|| std::sync::Arc::new(Backtrace::force_capture()));
        match action {
            Action::Alloc if block => {
                self.block_stacks.insert(addr.0, stack.clone().expect("captured"));
            }
            Action::FreeCompleted => {
                self.block_stacks.remove(&addr.0);
            }
            _ => {}
        }
        if !kept {
            return;
        }
        if self.entries.len() == self.opts.max_entries {
            self.entries.pop_front();
        }
        let stack = stack.filter(|_| entry_stack);
        let time_us = self.stamp(Stamped::Entry);
        let user_metadata = self.user_metadata.clone();
        self.entries.push_back(TraceEntry {
            action,
            addr,
            size,
            stream,
            time_us,
            stack,
            user_metadata,
            pool_id,
            graph_pool,
        });
        self.pushed += 1;
    }

    pub fn entries(&self) -> impl Iterator<Item = &TraceEntry> {
        self.entries.iter()
    }

    /// How many entries were ever kept: the number the next one will have.
    pub fn pushed(&self) -> u64 {
        self.pushed
    }

    /// The entries kept, oldest first, each with its number (0 for the first entry ever kept).
    pub fn numbered(&self) -> impl Iterator<Item = (u64, &TraceEntry)> {
        let first = self.pushed - self.entries.len() as u64;
        self.entries.iter().enumerate().map(move |(i, e)| (first + i as u64, e))
    }

    /// The allocation stacks of the live blocks, by address.
    pub fn block_stacks(&self) -> &HashMap<u64, std::sync::Arc<Backtrace>> {
        &self.block_stacks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_the_newest_entries() {
        let mut h = History::new(HistoryOptions::new(3), "".into());
        for i in 0..5u64 {
            h.push(Action::Alloc, DeviceAddr(i * 512), 512, StreamId::DEFAULT, (i, false));
        }
        let addrs: Vec<u64> = h.entries().map(|e| e.addr.0).collect();
        assert_eq!(addrs, vec![1024, 1536, 2048]);
        let pools: Vec<u64> = h.entries().map(|e| e.pool_id).collect();
        assert_eq!(pools, vec![2, 3, 4]);
        assert!(h.entries().all(|e| e.stack.is_none()));
        let mut off = History::new(HistoryOptions::new(0), "".into());
        off.push(Action::Oom, DeviceAddr(0), 1, StreamId::DEFAULT, (0, false));
        assert_eq!(off.entries().count(), 0);
    }

    /// Back to back, an entry, a range's end, an entry, a range's start, an entry fall in one
    /// microsecond most of the time: read back by time (a mark due before an entry at its own
    /// time only if it is a `START`), each entry must land on the side of the marks it was
    /// recorded on. Broken build `history_ties`.
    #[test]
    fn entries_and_range_marks_read_back_in_their_order() {
        let mut h = History::new(HistoryOptions::new(10_000), "".into());
        for i in 0..1000u64 {
            h.push(Action::Alloc, DeviceAddr(i * 512), 512, StreamId::DEFAULT, (0, false));
            h.annotate("r".into(), false);
            h.push(Action::FreeRequested, DeviceAddr(i * 512), 512, StreamId::DEFAULT, (0, false));
            h.annotate("r".into(), true);
            h.push(Action::FreeCompleted, DeviceAddr(i * 512), 512, StreamId::DEFAULT, (0, false));
        }
        let marks: Vec<(u64, bool)> = h.annotations().map(|a| (a.time_us, a.start)).collect();
        let entries: Vec<u64> = h.entries().map(|e| e.time_us).collect();
        assert!(entries.windows(2).all(|w| w[0] <= w[1]), "entries never go back");
        for (i, &(t, start)) in marks.iter().enumerate() {
            // Mark i is the END of round i / 2 (even i) or its START (odd i); the entry
            // recorded before it is number 3·(i/2) + (i%2), the one after it that + 1.
            let (prev, next) = (entries[3 * (i / 2) + i % 2], entries[3 * (i / 2) + i % 2 + 1]);
            match start {
                // An entry at a START's time reads as after it: the one before must be earlier.
                true => assert!(prev < t && t <= next, "START {i} at {t}: {prev}, {next}"),
                // An entry at an END's time reads as before it: the one after must be later.
                false => assert!(prev <= t && t < next, "END {i} at {t}: {prev}, {next}"),
            }
        }
    }

    #[test]
    fn stacks_are_captured_when_asked() {
        let mut h = History::new(HistoryOptions::new(2).with_stacks(true), "".into());
        h.push(Action::Alloc, DeviceAddr(0), 512, StreamId::DEFAULT, (0, false));
        let e = h.entries().next().unwrap();
        assert_eq!(e.action.name(), "alloc");
        assert!(e.stack.is_some());
    }
}

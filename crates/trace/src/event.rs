//! The trace model: a [`Trace`] is a flat, ordered list of [`Event`]s.
//!
//! ```text
//!  index:  0        1        2       3            4       5           ...
//!  event:  alloc#0  alloc#1  free#0  scope_enter  alloc#2 scope_exit  ...
//!          |--- lifetime of id 0 ---|
//! ```
//!
//! An id is allocated once and freed at most once; a [`Lifetime`] is the pair of event
//! indices (alloc, free), with the free index equal to `events.len()` ("end of trace") for
//! ids that are never freed. Scope markers carry the scope's position in
//! [`Trace::scope_names`] in [`Event::scope`] and the scope id of the input in [`Event::id`].
//! Readers only hand out traces that pass [`Trace::validate`].

use std::collections::{BTreeMap, HashMap};

use super::error::TraceError;
use super::snapshot::SnapshotInfo;
use super::validate::Validator;

/// What an event does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Allocate `bytes` bytes under a fresh `id`.
    Alloc,
    /// Free the buffer `id`.
    Free,
    /// Enter scope `scope` (a training step, a request).
    ScopeEnter,
    /// Leave scope `scope`.
    ScopeExit,
}

/// Residency class of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tag {
    /// Persistent: parameters, buffers, optimizer state.
    Param,
    /// Transient: activations, workspaces, gradients. Scope markers use this tag too.
    Act,
}

/// One trace record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The operation.
    pub op: Op,
    /// Buffer id for alloc/free; for scope markers, the scope id written in the input.
    pub id: u64,
    /// Requested bytes (on a free: the bytes of the buffer being freed, or 0 where the input
    /// did not write them; 0 on markers).
    pub bytes: u64,
    /// Stream (dense small ids; 0 is the default stream).
    pub stream: u32,
    /// Residency class ([`Tag::Act`] on markers).
    pub tag: Tag,
    /// For scope markers: index into [`Trace::scope_names`]; `None` for alloc/free.
    pub scope: Option<u32>,
}

impl Event {
    /// An allocation event.
    pub fn alloc(id: u64, bytes: u64, stream: u32, tag: Tag) -> Self {
        Event { op: Op::Alloc, id, bytes, stream, tag, scope: None }
    }

    /// A free event.
    pub fn free(id: u64, bytes: u64, stream: u32, tag: Tag) -> Self {
        Event { op: Op::Free, id, bytes, stream, tag, scope: None }
    }
}

/// A whole trace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trace {
    /// Name (the file stem for traces read from files).
    pub name: String,
    /// The events in order.
    pub events: Vec<Event>,
    /// Scope names; markers refer to them by index.
    pub scope_names: Vec<String>,
    /// Input records read but deliberately not turned into events, counted by kind: RMM
    /// `allocate failure` rows; PyTorch `segment_*`, `snapshot`, `oom`, `user_defined` entries
    /// and the free variant that is not used as the free (see [`crate::read`]).
    pub skipped: BTreeMap<String, u64>,
    /// Blocks allocated before the recording started, which the trace holds as allocations at
    /// its start (see [`PreWindow`]).
    pub pre_window: PreWindow,
    /// What a PyTorch snapshot says about this device beyond its allocations (`None` for the
    /// CSV formats).
    pub snapshot: Option<SnapshotInfo>,
}

/// Blocks whose allocation precedes the recording: a recording (a PyTorch history ring buffer,
/// an RMM log started late) can free, or hold at its end, a block it never saw allocated. Like
/// PyTorch's own viewer, readers place a synthetic alloc for each such block at the start of
/// the trace, so it counts as live from the start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PreWindow {
    /// Blocks freed in the recording that it never saw allocated.
    pub freed_blocks: u64,
    /// Their requested bytes.
    pub freed_bytes: u64,
    /// Blocks live at the end of the recording (a snapshot's `active_allocated` blocks, and its
    /// `active_pending_free` ones where `free_completed` is the free) that it never saw
    /// allocated: live throughout, tagged [`Tag::Param`] (persistent).
    pub live_blocks: u64,
    /// Their requested bytes.
    pub live_bytes: u64,
}

/// The lifetime of one allocated id, as event indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifetime {
    /// Buffer id.
    pub id: u64,
    /// Requested bytes.
    pub bytes: u64,
    /// Stream of the allocation.
    pub stream: u32,
    /// Residency class.
    pub tag: Tag,
    /// Index of the alloc event.
    pub alloc: usize,
    /// Index of the free event, or `events.len()` when the id is never freed.
    pub free: usize,
}

impl Lifetime {
    /// Whether the trace frees this id.
    pub fn is_freed(&self, trace: &Trace) -> bool {
        self.free < trace.events.len()
    }
}

impl Trace {
    /// Checks the invariants every reader guarantees: each id allocated once and before it
    /// is freed, freed at most once, no free of an unknown id, scope markers balanced.
    /// Errors name the event index as a [`super::Location::Line`] of `index + 2`
    /// (as if the trace were written as tidepool CSV with its header on line 1).
    pub fn validate(&self) -> Result<(), TraceError> {
        let mut v = Validator::new();
        for (i, e) in self.events.iter().enumerate() {
            let line = i as u64 + 2;
            v.check(e).map_err(|k| TraceError::at_line(line, k))?;
        }
        v.finish().map_err(|k| TraceError::at_line(self.events.len() as u64 + 2, k))
    }

    /// Number of input records skipped, all kinds together.
    pub fn skipped_records(&self) -> u64 {
        self.skipped.values().fold(0u64, |a, &b| a.saturating_add(b))
    }

    /// Counts one skipped input record of `kind`.
    pub(crate) fn skip(&mut self, kind: &str) {
        match self.skipped.get_mut(kind) {
            Some(n) => *n = n.saturating_add(1),
            None => _ = self.skipped.insert(kind.to_string(), 1),
        }
    }

    /// Number of alloc events.
    pub fn num_allocs(&self) -> usize {
        self.events.iter().filter(|e| e.op == Op::Alloc).count()
    }

    /// Live requested bytes after each event (saturating at `u64::MAX`).
    pub fn live_bytes_timeline(&self) -> Vec<u64> {
        self.live_after_each().map(|live| u64::try_from(live).unwrap_or(u64::MAX)).collect()
    }

    /// Live requested bytes after each event. A free takes away its allocation's bytes, which
    /// a free written with 0 bytes (which [`crate::Validator`] accepts) does not carry.
    fn live_after_each(&self) -> impl Iterator<Item = u128> + '_ {
        let mut live: u128 = 0;
        let mut bytes_of: HashMap<u64, u64> = HashMap::new();
        self.events.iter().map(move |e| {
            match e.op {
                Op::Alloc => {
                    bytes_of.insert(e.id, e.bytes);
                    live += u128::from(e.bytes);
                }
                Op::Free => {
                    let bytes = bytes_of.remove(&e.id).unwrap_or(e.bytes);
                    // BROKEN (`zero_free_kept`): the free's own bytes, 0 or not.
                    let bytes =
                        if cfg!(tidepool_broken = "zero_free_kept") { e.bytes } else { bytes };
                    live = live.saturating_sub(u128::from(bytes));
                }
                _ => {}
            }
            live
        })
    }

    /// The peak of live requested bytes in each step: from the start, or the previous exit of
    /// an outermost scope, up to and including the next — the windows in which the replayer
    /// counts device calls per step (events after the last exit belong to none). A scope
    /// nested in another (`fwd` inside `step`) is part of its step. Empty for a trace without
    /// scopes. Where a step's peak is no higher than the steps' before it, memory that fitted
    /// those steps could fit it: a map or malloc there is placement's, not the workload's.
    pub fn step_peak_live_bytes(&self) -> Vec<u64> {
        let mut peak = 0;
        let mut out = Vec::new();
        let ends = self.step_ends();
        for ((live, end), _) in self.live_bytes_timeline().into_iter().zip(ends).zip(&self.events) {
            peak = peak.max(live);
            if end {
                out.push(peak);
                peak = live;
            }
        }
        out
    }

    /// For each event, whether it ends a step: a `ScopeExit` that closes an outermost scope
    /// (one entered while no other was open). The replayer's per-step figures and
    /// [`Trace::step_peak_live_bytes`] share these windows.
    pub fn step_ends(&self) -> Vec<bool> {
        let mut depth = 0usize;
        self.events
            .iter()
            .map(|e| match e.op {
                Op::ScopeEnter => {
                    depth += 1;
                    false
                }
                Op::ScopeExit => {
                    depth = depth.saturating_sub(1);
                    // BROKEN (`scoped_nested_drops_outer`): every exit ended a step.
                    depth == 0 || cfg!(tidepool_broken = "scoped_nested_drops_outer")
                }
                Op::Alloc | Op::Free => false,
            })
            .collect()
    }

    /// The highest sum of live requested bytes at any point: the lower bound on the memory
    /// any allocator needs (saturating at `u64::MAX`).
    pub fn peak_live_bytes(&self) -> u64 {
        let peak = self.live_after_each().max().unwrap_or(0);
        u64::try_from(peak).unwrap_or(u64::MAX)
    }

    /// Lifetimes of all allocated ids, in allocation order.
    pub fn lifetimes(&self) -> Vec<Lifetime> {
        let end = self.events.len();
        let mut out = Vec::new();
        let mut slot_of: HashMap<u64, usize> = HashMap::new();
        for (i, e) in self.events.iter().enumerate() {
            match e.op {
                Op::Alloc => {
                    slot_of.insert(e.id, out.len());
                    out.push(Lifetime {
                        id: e.id,
                        bytes: e.bytes,
                        stream: e.stream,
                        tag: e.tag,
                        alloc: i,
                        free: end,
                    });
                }
                Op::Free => {
                    if let Some(slot) = slot_of.remove(&e.id) {
                        out[slot].free = i;
                    }
                }
                _ => {}
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Trace {
        Trace {
            name: "t".into(),
            events: vec![
                Event::alloc(1, 100, 0, Tag::Param),
                Event::alloc(2, 50, 0, Tag::Act),
                Event::free(2, 50, 0, Tag::Act),
                Event::alloc(3, 120, 0, Tag::Act),
            ],
            scope_names: vec![],
            ..Trace::default()
        }
    }

    #[test]
    fn peak_and_lifetimes() {
        let t = small();
        assert_eq!(t.peak_live_bytes(), 220);
        assert_eq!(t.num_allocs(), 3);
        assert_eq!(t.live_bytes_timeline(), vec![100, 150, 100, 220]);
        let l = t.lifetimes();
        assert_eq!(l.len(), 3);
        assert_eq!((l[0].id, l[0].alloc, l[0].free), (1, 0, 4));
        assert_eq!((l[1].id, l[1].alloc, l[1].free), (2, 1, 2));
        assert_eq!((l[2].id, l[2].alloc, l[2].free), (3, 3, 4));
        assert!(l[1].is_freed(&t));
        assert!(!l[0].is_freed(&t));
        t.validate().unwrap();
    }

    #[test]
    fn validate_reports_event_line() {
        let mut t = small();
        t.events.push(Event::free(9, 1, 0, Tag::Act));
        let e = t.validate().unwrap_err();
        assert_eq!(e.to_string(), "line 6: free of unknown id 9");
    }

    #[test]
    fn huge_sizes_saturate() {
        let t = Trace {
            events: vec![
                Event::alloc(1, u64::MAX, 0, Tag::Act),
                Event::alloc(2, u64::MAX, 0, Tag::Act),
            ],
            ..Trace::default()
        };
        assert_eq!(t.peak_live_bytes(), u64::MAX);
    }
}

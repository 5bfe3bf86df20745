//! A trace rewritten for fast replay: every id becomes a dense slot index (0..n), so policy
//! loops index a `Vec` instead of hashing ids. Built once per replay, before timing starts.

use std::collections::HashMap;

use crate::event::{Op, Trace};

/// One event with its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Allocate `bytes` into `slot`.
    Alloc {
        /// Dense slot of the buffer.
        slot: usize,
        /// Requested bytes.
        bytes: u64,
    },
    /// Free `slot`.
    Free {
        /// Dense slot of the buffer.
        slot: usize,
    },
    /// A scope marker (no-op for the baselines).
    Marker,
}

/// The slotted trace.
#[derive(Debug, Clone)]
pub struct Slotted {
    /// One step per event.
    pub steps: Vec<Step>,
    /// Number of slots (= allocations).
    pub slots: usize,
}

impl Slotted {
    /// Rewrites a validated trace (a free of an unknown id becomes a marker).
    pub fn new(trace: &Trace) -> Self {
        let mut slot_of: HashMap<u64, usize> = HashMap::new();
        let mut slots = 0;
        let steps = trace
            .events
            .iter()
            .map(|e| match e.op {
                Op::Alloc => {
                    slot_of.insert(e.id, slots);
                    slots += 1;
                    Step::Alloc { slot: slots - 1, bytes: e.bytes }
                }
                Op::Free => match slot_of.remove(&e.id) {
                    Some(slot) => Step::Free { slot },
                    None => Step::Marker,
                },
                Op::ScopeEnter | Op::ScopeExit => Step::Marker,
            })
            .collect();
        Slotted { steps, slots }
    }
}

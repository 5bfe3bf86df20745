//! Per-stream owner handles: what a [`Buffer`](super::Buffer) holds to reach its allocator.
//!
//! ```text
//!  Allocator ─┬─ shared: Arc<Shared>
//!             └─ owners: Arc<OwnerTable> ── slots: [once(stream 0)] [once(stream 1)] …  other
//!                                                   │ Arc<Owner>, 128-byte aligned
//!  Buffer ── owner: Arc<Owner> ── shared: Arc<Shared>
//! ```
//!
//! Every buffer keeps the allocator alive. Were that one `Arc<Shared>`, each allocation and free
//! would increment and decrement one reference count shared by all threads, and two threads on
//! separate streams would fight over its cache line on every pair. Instead a buffer clones its
//! stream's `Owner`, whose count sits alone on its own lines: separate streams touch separate
//! counts. The table belongs to the allocator handles, not to `Shared`, so there is no cycle:
//! when the last handle goes, the table goes, and the last buffer's owner drops `Shared`.

use super::Shared;
use super::fast_cache::FAST_STREAMS;
use crate::device::{Device, StreamId};
use crate::sync::{Arc, OnceSlot};
use crossbeam_utils::CachePadded;
use std::ops::Deref;

/// A stream's handle on the allocator's shared state, padded (crossbeam's `CachePadded`) so that
/// its reference count, which buffers of that stream touch, has a cache line of its own.
pub(crate) struct Owner<D: Device> {
    shared: CachePadded<Arc<Shared<D>>>,
}

impl<D: Device> Deref for Owner<D> {
    type Target = Shared<D>;
    fn deref(&self) -> &Shared<D> {
        &self.shared
    }
}

impl<D: Device> Owner<D> {
    fn new(shared: &Arc<Shared<D>>) -> Arc<Owner<D>> {
        Arc::new(Owner { shared: CachePadded::new(shared.clone()) })
    }
}

/// One owner per stream with a fast path, and one for every other stream.
pub(crate) struct OwnerTable<D: Device> {
    shared: Arc<Shared<D>>,
    slots: Box<[OnceSlot<Arc<Owner<D>>>]>,
    other: Arc<Owner<D>>,
}

impl<D: Device> OwnerTable<D> {
    pub fn new(shared: &Arc<Shared<D>>) -> OwnerTable<D> {
        OwnerTable {
            shared: shared.clone(),
            slots: (0..FAST_STREAMS).map(|_| OnceSlot::new()).collect(),
            other: Owner::new(shared),
        }
    }

    /// A new hold on the allocator for a buffer of `stream`.
    pub fn owner(&self, stream: StreamId) -> Arc<Owner<D>> {
        let Some(slot) = self.slots.get(stream.0 as usize) else { return self.other.clone() };
        // `get` yields a reference under std and a clone under loom; `clone` serves both.
        if let Some(o) = slot.get() {
            return o.clone();
        }
        slot.set(Owner::new(&self.shared));
        slot.get().expect("just set").clone()
    }
}

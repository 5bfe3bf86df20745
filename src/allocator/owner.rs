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
//!
//! **No count on the hit path.** Even an uncontended count costs an atomic RMW per allocation
//! and per free. So a buffer freed into a stream cache leaves its strong reference there (the
//! lane counts them, `owner_refs`, under its lock) and a hit takes one over ([`OwnerTable::
//! hit_owner`]) instead of cloning: a hit and its free touch no reference count. That is sound
//! because every buffer of a stream below [`FAST_STREAMS`] holds the *same* `Arc<Owner>` (its
//! slot's, set once), and only those streams have caches. The references kept in lanes would
//! keep `Shared` alive for ever, so when the last handle goes the table, under the global lock,
//! closes every lane's stash and releases what it held; a buffer freed later (or into a lane
//! made later) keeps its reference and lets go of it as before.
//!
//! ```text
//!  free (lane lock): push block; stash open? refs += 1, forget the buffer's Arc : drop it
//!  hit  (lane lock): pop block;  refs > 0?   refs −= 1, Arc::from_raw(slot)     : slot.clone()
//!  last handle (global lock, then each lane lock): close stash; release its refs
//! ```

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

impl<D: Device> Drop for OwnerTable<D> {
    /// The last handle is gone: the references stream caches keep are released (see the
    /// module docs), so the last buffer lets go of the allocator.
    fn drop(&mut self) {
        let sh = &self.shared;
        let mut st = sh.lock_state();
        st.stash_closed = true;
        for cache in sh.caches.all().iter() {
            let n = cache.close_stash();
            if n == 0 {
                continue;
            }
            let slot = self.slots.get(cache.stream().0 as usize).and_then(|s| s.get());
            // (`get` yields a reference under std, a clone under loom.)
            #[allow(clippy::needless_borrow)]
            let slot: &Arc<Owner<D>> = &slot.expect("a kept reference has its owner");
            for _ in 0..n {
                // SAFETY: the lane kept `n` strong references of this very `Arc` (the one owner
                // of its stream, see the module docs) and gave them up; the slot holds another,
                // so none of these is the last.
                unsafe { Arc::decrement_strong_count(Arc::as_ptr(slot)) };
            }
        }
    }
}

impl<D: Device> OwnerTable<D> {
    /// The hold on the allocator for a buffer handed out by a stream-cache hit: the reference
    /// the hit took over from the lane (`stashed`), or a new one.
    #[inline(always)]
    pub fn hit_owner(&self, stream: StreamId, stashed: bool) -> Arc<Owner<D>> {
        if stashed && let Some(slot) = self.slots.get(stream.0 as usize).and_then(|s| s.get()) {
            #[allow(clippy::needless_borrow)]
            let slot: &Arc<Owner<D>> = &slot; // a reference under std, a clone under loom
            // SAFETY: a lane of `stream` kept a strong reference of its one owner, this slot's
            // `Arc`, and handed it to this hit (it is not counted there any more): the new
            // handle owns it.
            return unsafe { Arc::from_raw(Arc::as_ptr(slot)) };
        }
        debug_assert!(!stashed, "a kept reference has its owner");
        self.owner_cold(stream)
    }

    #[cold]
    #[inline(never)]
    fn owner_cold(&self, stream: StreamId) -> Arc<Owner<D>> {
        self.owner(stream)
    }

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

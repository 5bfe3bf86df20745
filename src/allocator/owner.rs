//! Per-lane owner handles: what a [`Buffer`](super::Buffer) holds to reach its allocator, and
//! the stream-cache lane its hits come from and its free goes to.
//!
//! ```text
//!  Allocator ─┬─ shared: Arc<Shared>
//!             └─ owners: Arc<OwnerTable> ── slots: [s0 lane0] [s0 lane1] [s1 lane0] …   other
//!                                                   │ once-set Arc<Owner>, 128-byte aligned
//!  Buffer ── owner: Arc<Owner> ─┬─ shared: Arc<Shared>
//!                               ├─ lane: the stream cache (StreamCache) of this slot
//!                               └─ family (captures), observes (sanitizer hooks on)
//! ```
//!
//! **One lane lookup per operation.** A hit finds this thread's slot of its stream (a
//! thread-local and an index) and reaches the lane through the owner; the buffer it hands out
//! holds that owner, so its free goes straight to the same lane with no lookup at all.
//! Frees therefore return a block to the allocating thread's lane, as mimalloc returns a block
//! to its page's owner: a producer thread's lane gets back what a consumer thread frees, and
//! reuse stays sound because a lane belongs to one stream. A small block a thread takes from
//! its stream's *other* lane (its own was empty) gets a buffer holding the thread's own lane
//! owner (`Allocator::moved_owner`: the hold the other lane kept is let go, a new one
//! cloned), so the block moves to the taker's lane; holding the other lane's owner, it would go
//! back there and every later pair of the thread would miss its own lane.
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
//! because every buffer freed into a lane with its reference holds that lane's `Arc<Owner>` (its
//! slot's, set once, and kept when the lane is re-tagged for another stream of the slot; a free
//! stashes only into its owner's own lane), and only slotted lanes have such owners
//! ([`FAST_STREAMS`] slots; a stream's lanes take the first free of its four choices,
//! see `CacheTable`). The references kept in lanes would
//! keep `Shared` alive for ever, so when the last handle goes the table, under the global lock,
//! closes every lane's stash and releases what it held; a buffer freed later (or into a lane
//! made later) keeps its reference and lets go of it as before. The allocator is then closed
//! (`closed.rs`): its cached memory goes back to the device, and each buffer's as it goes.
//!
//! ```text
//!  free (lane lock): push block (an open lane has an open stash); refs += 1, forget the Arc
//!  hit  (lane lock): pop block;  refs > 0?   refs −= 1, Arc::from_raw(slot)     : slot.clone()
//!  last handle (global lock, then each lane lock): close stash and lane (room 0, so later
//!  frees go to the pool with their own refs); release its refs
//! ```

use super::Shared;
use super::fast_cache::{FAST_STREAMS, StreamCache};
use super::lane_table::{LANES, slot_choices, slot_index, thread_lane};
use super::private_pool::Family;
use crate::device::{Device, StreamId};
use crate::sync::{Arc, OnceSlot, SlotRef};
use crossbeam_utils::CachePadded;
use std::ops::Deref;

/// A lane's handle on the allocator's shared state, padded (crossbeam's `CachePadded`) so that
/// its reference count, which buffers of that lane touch off the hit path, has a cache line of
/// its own and its read-mostly fields another.
pub(crate) struct Owner<D: Device>(CachePadded<OwnerCells<D>>);

pub(crate) struct OwnerCells<D: Device> {
    shared: Arc<Shared<D>>,
    /// The lane its buffers' frees go to (`None`: the `other` owner, no lane).
    lane: Option<Arc<StreamCache>>,
    /// `lane` where the device's sanitizer hooks do nothing, else `None`: the inlined hit and
    /// free test one word for both (the rest of the path tells the sanitizer).
    quiet_lane: Option<Arc<StreamCache>>,
    /// The allocator family's shared parts (captures that may hold a free back).
    pub(crate) family: Arc<Family<D>>,
    /// Whether the device's sanitizer hooks do anything (`Device::observes_handouts`, fixed).
    pub(crate) observes: bool,
}

impl<D: Device> Deref for Owner<D> {
    type Target = Shared<D>;
    #[inline(always)]
    fn deref(&self) -> &Shared<D> {
        &self.0.shared
    }
}

impl<D: Device> Owner<D> {
    fn new(shared: &Arc<Shared<D>>, lane: Option<Arc<StreamCache>>) -> Arc<Owner<D>> {
        let observes = shared.device.observes_handouts();
        Arc::new(Owner(CachePadded::new(OwnerCells {
            shared: shared.clone(),
            quiet_lane: if observes { None } else { lane.clone() },
            lane,
            family: shared.family.clone(),
            observes,
        })))
    }

    /// The lane its buffers' frees go to (`None` for streams without a fast path).
    #[inline(always)]
    pub(crate) fn lane(&self) -> Option<&StreamCache> {
        self.0.lane.as_deref()
    }

    /// [`Owner::lane`] where the sanitizer hooks do nothing (`None` where they do).
    #[inline(always)]
    pub(crate) fn quiet_lane(&self) -> Option<&StreamCache> {
        self.0.quiet_lane.as_deref()
    }

    /// The read-mostly fields.
    #[inline(always)]
    pub(crate) fn cells(&self) -> &OwnerCells<D> {
        &self.0
    }
}

/// Owner slots: one per lane of every stream with a fast path.
const SLOTS: usize = FAST_STREAMS * LANES;
// A lane index is masked with `LANES - 1`.
const _: () = assert!(LANES.is_power_of_two());

/// One owner per lane of every stream with a fast path, and one for every other stream.
pub(crate) struct OwnerTable<D: Device> {
    shared: Arc<Shared<D>>,
    /// `FAST_STREAMS × LANES` slots, lane `l` of slot `k` at `k · LANES + l` (as the caches',
    /// [`slot_index`]; a stream's owners sit in the slot its lanes took): a fixed size, so a
    /// lookup needs no bounds check. A slot's owner stays with its lane when the lane is
    /// re-tagged for another stream.
    slots: Box<[OnceSlot<Arc<Owner<D>>>; SLOTS]>,
    other: Arc<Owner<D>>,
}

impl<D: Device> Drop for OwnerTable<D> {
    /// The last handle is gone: the references stream caches keep are released (see the
    /// module docs), so the last buffer lets go of the allocator; and the allocator closes:
    /// nothing can allocate from it again, so its cached memory goes back to the device now,
    /// and a buffer freed later returns its memory as it goes (`Shared::release_closed`).
    fn drop(&mut self) {
        let sh = &self.shared;
        // The plans' lock comes before the global lock: idle regions first.
        if !cfg!(tidepool_broken = "closed_keeps_cache") {
            let _ = sh.release_idle_regions();
        }
        let mut st = sh.lock_state();
        st.stash_closed = true;
        for cache in sh.caches.all().iter() {
            let n = cache.close_stash();
            if n == 0 {
                continue;
            }
            // The owner whose lane it is: one of its stream's slots' (a lane keeps its slot
            // when it is re-tagged, for a stream with that slot among its choices).
            let slots = &self.slots;
            let owner = slot_choices(cache.stream())
                .into_iter()
                .flat_map(|slot| (0..LANES).map(move |l| slot_index(slot, l)))
                .filter_map(|i| slots[i].get())
                .find(|o| o.lane().is_some_and(|l| std::ptr::eq(l, &**cache)));
            // (`get` yields a reference under std, a clone under loom.)
            #[allow(clippy::needless_borrow)]
            let owner: &Arc<Owner<D>> = &owner.expect("a kept reference has its owner");
            for _ in 0..n {
                // SAFETY: the lane kept `n` strong references of this very `Arc` (its owner's,
                // see the module docs) and gave them up; the slot holds another, so none of
                // these is the last.
                unsafe { Arc::decrement_strong_count(Arc::as_ptr(owner)) };
            }
        }
        sh.close(&mut st);
    }
}

impl<D: Device> OwnerTable<D> {
    pub fn new(shared: &Arc<Shared<D>>) -> OwnerTable<D> {
        OwnerTable {
            shared: shared.clone(),
            slots: (0..SLOTS)
                .map(|_| OnceSlot::new())
                .collect::<Vec<_>>()
                .try_into()
                .unwrap_or_else(|_| unreachable!("SLOTS slots")),
            other: Owner::new(shared, None),
        }
    }

    /// The owner of this thread's lane of `stream`'s slot (the hit path's one lookup), once a
    /// buffer of it was handed out (`None` before). Its lane may serve another stream: the
    /// hit's pop compares under the lane's lock.
    #[inline(always)]
    pub fn lane_owner(&self, stream: StreamId) -> Option<SlotRef<'_, Arc<Owner<D>>>> {
        self.owner_slot(stream, thread_lane())
    }

    /// The owner of lane `lane` of `stream`, if made: its first choice's where that lane
    /// serves `stream`, else the first later choice's whose lane does, else its second
    /// choice's (whose lane serves another stream: the hit's pop compares under the lane's
    /// lock).
    #[inline(always)]
    pub fn owner_slot(&self, stream: StreamId, lane: usize) -> Option<SlotRef<'_, Arc<Owner<D>>>> {
        // (Its first choice: `slot_index` takes the id modulo the slots.)
        if let Some(o) = self.serving(stream.0 as usize, stream, lane) {
            return Some(o);
        }
        self.owner_slot_second(stream, lane)
    }

    /// The owner of `slot`'s `lane`, if that lane serves `stream` now.
    #[inline(always)]
    fn serving(
        &self,
        slot: usize,
        stream: StreamId,
        lane: usize,
    ) -> Option<SlotRef<'_, Arc<Owner<D>>>> {
        self.slots[slot_index(slot, lane)]
            .get()
            .filter(|o| o.lane().is_some_and(|c| c.stream() == stream))
    }

    /// [`OwnerTable::owner_slot`]'s later choices, out of line (a stream only takes one where
    /// its first choice serves another live stream).
    #[inline(never)]
    fn owner_slot_second(
        &self,
        stream: StreamId,
        lane: usize,
    ) -> Option<SlotRef<'_, Arc<Owner<D>>>> {
        let choices = slot_choices(stream);
        for &slot in &choices[1..] {
            if let Some(o) = self.serving(slot, stream, lane) {
                return Some(o);
            }
        }
        self.slots[slot_index(choices[1], lane)].get()
    }

    /// The hold on the allocator for a buffer a hit through `slot` handed out: the reference
    /// the hit took over from the slot's lane (`stashed`), or a new one.
    #[inline(always)]
    pub fn hit_owner(slot: &Arc<Owner<D>>, stashed: bool) -> Arc<Owner<D>> {
        if stashed {
            // SAFETY: the slot's lane kept a strong reference of this very `Arc` (a free
            // stashes only into its owner's lane) and handed it to this hit (it is not counted
            // there any more): the new handle owns it.
            return unsafe { Arc::from_raw(Arc::as_ptr(slot)) };
        }
        slot.clone()
    }

    /// A new hold on the allocator for a buffer of `stream` handed out by this thread: its lane's
    /// owner (made here the first time, once the stream has slotted lanes), else the `other`
    /// one. (A slot's owner made for an earlier stream of the slot serves too: a free to a lane
    /// that serves another stream is refused there, and goes to the pool.)
    pub fn owner(&self, stream: StreamId) -> Arc<Owner<D>> {
        self.owner_of_lane(stream, thread_lane())
    }

    /// [`OwnerTable::owner`] of lane `lane` of `stream` (a stream's first lane holds its large
    /// block, so a large buffer belongs to it).
    pub fn owner_of_lane(&self, stream: StreamId, lane: usize) -> Arc<Owner<D>> {
        // The common case first, as `owner_slot` takes it: the stream's first choice holds
        // the owner, whose lane serves the stream (no choices computed, no division).
        if let Some(o) = self.serving(stream.0 as usize, stream, lane) {
            return o.clone();
        }
        self.owner_of_lane_made(stream, lane)
    }

    /// [`OwnerTable::owner_of_lane`] past its first choice: a later choice's owner, made here
    /// the first time.
    #[inline(never)]
    fn owner_of_lane_made(&self, stream: StreamId, lane: usize) -> Arc<Owner<D>> {
        let Some(slot) = self.shared.caches.slot_of(stream) else {
            // No slotted lanes: the first choice's owner, made for another stream, serves as
            // well as any (a free to its lane is refused there, and goes to the pool).
            let first = &self.slots[slot_index(slot_choices(stream)[0], lane)];
            return first.get().map_or_else(|| self.other.clone(), |o| o.clone());
        };
        let owners = &self.slots[slot_index(slot, lane)];
        // `get` yields a reference under std and a clone under loom; `clone` serves both.
        if let Some(o) = owners.get() {
            return o.clone();
        }
        // (The lane of that very slot: an owner holds its own slot's lane for life.)
        let Some(cache) = self.shared.caches.lane_in(slot, lane, stream) else {
            return self.other.clone(); // re-tagged meanwhile: a buffer of it takes the slow free
        };
        #[allow(clippy::needless_borrow)]
        let cache: &Arc<StreamCache> = &cache;
        owners.set(Owner::new(&self.shared, Some(cache.clone())));
        owners.get().expect("just set").clone()
    }
}

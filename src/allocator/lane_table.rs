//! The lane table: which [`StreamCache`]s ("lanes") serve which stream, and which lane a thread
//! uses. [`LANES`] lanes per stream, in [`FAST_STREAMS`] slots that a stream takes by its id
//! (one of [`CHOICES`] slots, re-tagged when the stream they served is gone), and every lane,
//! slotted or not, in stream order for the slow side.
//!
//! ```text
//!  thread ── thread_lane() ─▶ 0 or 1 (round-robin as threads first ask)
//!  stream s ── slot_choices(s) ─▶ [c0, c1, c2, c3] ─▶ slots[c·LANES + lane]: Arc<StreamCache>
//!  all: every lane in stream order (lock order, statistics readers)
//! ```

use super::fast_cache::{FAST_STREAMS, StreamCache};
use crate::device::StreamId;
use crate::sync::{Arc, ArcCell, ArcRef, OnceSlot, SlotRef};

/// Caches ("lanes") per stream. Threads are spread over a stream's lanes (round-robin as they
/// first allocate), so two threads allocating on one stream rarely share a cache and its lock.
/// Lane 0 carries the stream's published pool statistics. (Two under loom too: the models check
/// the cross-lane lookup and the flushes that reach every lane.)
pub const LANES: usize = 2;

/// This thread's lane.
#[cfg(not(loom))]
#[inline(always)]
pub fn thread_lane() -> usize {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        // A constant initialiser: reading it is one thread-local load, no lazy-init check.
        static LANE: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    LANE.with(|l| match l.get() {
        usize::MAX => {
            let lane = NEXT.fetch_add(1, Ordering::Relaxed) % LANES;
            l.set(lane);
            lane
        }
        lane => lane,
    })
}

/// This thread's lane: round-robin in the order threads first ask, as under `std`, with the
/// counter and the thread-locals loom's (reset for every execution of a model).
#[cfg(loom)]
pub fn thread_lane() -> usize {
    use crate::sync::atomic::{AtomicUsize, Ordering};
    loom::lazy_static! {
        static ref NEXT: AtomicUsize = AtomicUsize::new(0);
    }
    loom::thread_local! {
        static LANE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % LANES;
    }
    LANE.with(|l| *l)
}

/// Every stream cache, `LANES` per stream.
///
/// ```text
///  slots: [ slot 0: lane 0, lane 1 ][ slot 1 ] … [ slot 63 ]
///           once set, never removed; each lane tagged with the stream it serves now
///  stream s → its choices, slot (s + k·d) mod 64 for k = 0, 1, 2, 3, d = 1 + (s / 64) mod 63
///             (the first is s mod 64; streams 64 apart step differently; d = 32 shifts the
///             third and fourth by one, so that the four differ): the first that is free
///  all:   every lane, slotted or not, in stream (tag) order, lanes in order; replaced whole
/// ```
///
/// Stream ids are never reused (the devices count them up), so a table indexed by id would
/// give no fast path to a program that creates and destroys streams, once its 64th is made.
/// Instead a stream's lanes are one of its `CHOICES` slots' (`slot_choices`): the first
/// choice's own when it has none yet, or *re-tagged* when the stream they served was destroyed
/// (its lanes were closed and flushed then; see `Shared::ensure_cache`); else the same for
/// the next choice — so a stream 64 ids from a live one (the default stream, or a stream a
/// program keeps while it makes others) still has a fast path, and with `L` streams alive a
/// new one finds all its slots taken about `(L/64)⁴` of the time (`(L/64)²` with two). A
/// stream all of whose slots serve live streams gets unslotted lanes (in `all` only, closed
/// to blocks: they carry its pool statistics), so it takes the slow path, as does any stream
/// looked up before it has lanes. Slotted lookups (one `Acquire` load and a tag load per
/// choice tried) answer the first choice whose lane serves the stream, and the second
/// choice's lane, whatever it serves, where none does; the tag is compared again under the lane's lock by
/// every hit and free (`CacheInner::serves`, `CacheInner::takes_for`), since a lane found
/// for a stream may be re-tagged before its lock is taken, and a buffer keeps its lane for life.
///
/// `all` is the lanes' lock order and the statistics readers' list: it is re-sorted as a whole
/// after a re-tag, under the global lock (which every holder of two lane locks holds).
pub struct CacheTable {
    slots: Box<[OnceSlot<Arc<StreamCache>>]>,
    all: ArcCell<Vec<Arc<StreamCache>>>,
}

impl Default for CacheTable {
    fn default() -> Self {
        CacheTable {
            slots: (0..FAST_STREAMS * LANES).map(|_| OnceSlot::new()).collect(),
            all: ArcCell::new(Vec::new()),
        }
    }
}

/// The index in the slots of lane `lane` of slot `slot`.
#[inline(always)]
pub(crate) fn slot_index(slot: usize, lane: usize) -> usize {
    (slot % FAST_STREAMS) * LANES + (lane & (LANES - 1))
}

/// How many slots a stream may take its lanes from.
pub(crate) const CHOICES: usize = 4;

/// The slots `stream`'s lanes may take, first choice first, all different (see
/// [`CacheTable`]).
#[inline(always)]
pub(crate) fn slot_choices(stream: StreamId) -> [usize; CHOICES] {
    let id = stream.0 as usize;
    let first = id % FAST_STREAMS;
    // A step of 1..=63: k·d for k = 1, 2, 3 is never a multiple of 64 but for 2·32, which the
    // shift of the third and fourth choices by one moves off the first and second.
    let d = 1 + (id / FAST_STREAMS) % (FAST_STREAMS - 1);
    let shift = usize::from(d == FAST_STREAMS / 2);
    std::array::from_fn(|k| (first + k * d + (k / 2) * shift) % FAST_STREAMS)
}

impl CacheTable {
    /// This thread's lane of `stream` for the fast path: `None` if the stream has no slotted
    /// lanes (none yet, or its slot serves another stream).
    #[inline]
    pub fn fast(&self, stream: StreamId) -> Option<SlotRef<'_, Arc<StreamCache>>> {
        self.fast_lane(stream, 0)
    }

    /// Lane 0 of `stream` from the slots (`None` as for [`CacheTable::fast`]).
    #[inline]
    pub fn first_lane(&self, stream: StreamId) -> Option<SlotRef<'_, Arc<StreamCache>>> {
        self.fast_lane_at(stream, 0)
    }

    /// Like [`CacheTable::fast`], for the `k`-th lane counted from this thread's own.
    #[inline]
    pub fn fast_lane(&self, stream: StreamId, k: usize) -> Option<SlotRef<'_, Arc<StreamCache>>> {
        self.fast_lane_at(stream, (thread_lane() + k) % LANES)
    }

    /// Lane `lane` (counted from 0, not from this thread's) of `stream` from the slots.
    #[inline]
    pub fn fast_lane_at(
        &self,
        stream: StreamId,
        lane: usize,
    ) -> Option<SlotRef<'_, Arc<StreamCache>>> {
        self.lane_in(self.slot_of(stream)?, lane, stream)
    }

    /// Lane `lane` of slot `slot`, if it serves `stream`.
    #[inline]
    pub fn lane_in(
        &self,
        slot: usize,
        lane: usize,
        stream: StreamId,
    ) -> Option<SlotRef<'_, Arc<StreamCache>>> {
        self.slots[slot_index(slot, lane)].get().filter(|c| c.stream() == stream)
    }

    /// The slot whose lanes serve `stream` (its lane 0's tag), if one of its choices' does.
    ///
    /// The first choice is looked at before the others are worked out (as `owner_of_lane`
    /// does): the four choices cost a division, and a stream's lanes almost always sit in its
    /// first (`first_lane` on every large search, reuse and free, `fast_lane_at` on every
    /// locked pop).
    #[inline]
    pub fn slot_of(&self, stream: StreamId) -> Option<usize> {
        let first = stream.0 as usize % FAST_STREAMS;
        debug_assert_eq!(first, slot_choices(stream)[0]);
        if self.serves_from(first, stream) {
            return Some(first);
        }
        self.slot_of_later(stream)
    }

    /// [`CacheTable::slot_of`] past the first choice.
    #[inline(never)]
    fn slot_of_later(&self, stream: StreamId) -> Option<usize> {
        slot_choices(stream).into_iter().skip(1).find(|&slot| self.serves_from(slot, stream))
    }

    /// Whether slot `slot`'s lanes serve `stream` (its lane 0's tag).
    #[inline(always)]
    fn serves_from(&self, slot: usize, stream: StreamId) -> bool {
        self.slots[slot_index(slot, 0)].get().is_some_and(|c| c.stream() == stream)
    }

    /// The lanes of slot `slot`, whatever stream they serve (none before the slot's first
    /// stream). For the global-lock side.
    pub fn slot_lanes(&self, slot: usize) -> Vec<Arc<StreamCache>> {
        // (`get` yields a reference under std, a clone under loom.)
        #[allow(clippy::needless_borrow)]
        let lane = |l| self.slots[slot_index(slot, l)].get().map(|c| Arc::clone(&c));
        (0..LANES).filter_map(lane).collect()
    }

    /// Whether `cache` is a slotted lane (one that a buffer's owner may hold).
    pub fn is_slotted(&self, cache: &StreamCache) -> bool {
        slot_choices(cache.stream()).into_iter().any(|slot| {
            (0..LANES).any(|l| {
                self.slots[slot_index(slot, l)].get().is_some_and(|c| {
                    // (A reference under std, a clone under loom.)
                    #[allow(clippy::needless_borrow)]
                    let c: &StreamCache = &c;
                    std::ptr::eq(c, cache)
                })
            })
        })
    }

    /// Every cache, in stream order (the lock order).
    pub fn all(&self) -> ArcRef<Vec<Arc<StreamCache>>> {
        self.all.load()
    }

    /// Lane 0 of `stream`, which carries its pool statistics (slow; for the global-lock side).
    pub fn get(&self, stream: StreamId) -> Option<Arc<StreamCache>> {
        let all = self.all.load();
        let i = all.partition_point(|c| c.stream() < stream);
        all.get(i).filter(|c| c.stream() == stream).cloned()
    }

    /// Every lane of `stream` (slow; for the global-lock side).
    pub fn lanes(&self, stream: StreamId) -> Vec<Arc<StreamCache>> {
        let all = self.all.load();
        let i = all.partition_point(|c| c.stream() < stream);
        all[i..].iter().take_while(|c| c.stream() == stream).cloned().collect()
    }

    /// Adds the lanes of a stream that has none, lane 0 first, into slot `slot`, which must be
    /// empty (`None`: they are unslotted). The caller holds the global lock, and must then
    /// make statistics readers retry (they may hold the old list).
    pub fn add(&self, lanes: Vec<Arc<StreamCache>>, slot: Option<usize>) {
        let Some(stream) = lanes.first().map(|c| c.stream()) else { return };
        let mut all: Vec<_> = self.all.load().iter().cloned().collect();
        let at = all.partition_point(|c| c.stream() < stream);
        for (lane, cache) in lanes.into_iter().enumerate() {
            all.insert(at + lane, cache.clone());
            if let Some(slot) = slot {
                self.slots[slot_index(slot, lane)].set(cache);
            }
        }
        self.all.store(Arc::new(all));
    }

    /// Rebuilds the list after re-tags, in stream order (lanes of a stream keep their order),
    /// without the lanes `drop` names. The caller holds the global lock, and made statistics
    /// readers retry before the first re-tag.
    pub fn resort(&self, mut drop: impl FnMut(&StreamCache) -> bool) {
        let mut all: Vec<_> = self.all.load().iter().filter(|c| !drop(c)).cloned().collect();
        // Stable: a re-tagged slot's lanes were adjacent in lane order, and stay so.
        all.sort_by_key(|c| c.stream());
        self.all.store(Arc::new(all));
    }

    /// Whether `i` in [`CacheTable::all`] is a stream's lane 0.
    pub fn is_first_lane(all: &[Arc<StreamCache>], i: usize) -> bool {
        i == 0 || all[i - 1].stream() != all[i].stream()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Every stream's choices are four different slots, the first `id mod 64`; streams 64 ids
    /// apart (the same first slot) step differently up to the 63rd of them, so a live stream
    /// blocks another's later choices only by chance.
    #[test]
    fn a_streams_choices_are_four_different_slots() {
        for id in 0..64 * 70 {
            let c = slot_choices(StreamId(id));
            assert_eq!(c[0], id as usize % FAST_STREAMS, "{id}");
            for i in 0..CHOICES {
                assert!(c[i] < FAST_STREAMS);
                for j in 0..i {
                    assert_ne!(c[i], c[j], "stream {id}: {c:?}");
                }
            }
        }
        for first in 0..64 {
            let seconds: std::collections::BTreeSet<_> =
                (0..63).map(|k| slot_choices(StreamId(first + 64 * k))[1]).collect();
            assert_eq!(seconds.len(), 63, "slot {first}'s streams share second choices");
        }
        // The step of 32 (streams 31·64…31·64+63): the shift keeps the four apart.
        assert_eq!(slot_choices(StreamId(31 * 64 + 5)), [5, 37, 6, 38]);
    }
}

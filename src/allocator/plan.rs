//! Learned plans of named scopes: the allocation sequence of a scope's last run, the offsets
//! computed from it by interval packing, and the one region those offsets live in.
//!
//! ```text
//!  run k (learning):  a0 a1 f0 a2 f1 ...  ──pack_greedy_by_size──▶  offsets [0, 4096, 0, ...]
//!  run k+1 (planned): step i must equal step i of run k; alloc j gets region.base + offset[j]
//!                     ┌──────────────── region (one pool block) ────────────────┐
//!                     │ a0/a2 │ a1 │ ...                                         │
//! ```
//!
//! A buffer still live when its run ends (an *escape*) keeps its slice *pinned*: the next run
//! checks each planned slice against the pinned ones and serves an overlapping request from the
//! pool instead (a plan miss), so a late free is never overwritten.

use super::batch::BatchBlock;
use crate::device::{EventId, StreamId};
use crate::packing::pack_greedy_by_size;
use crate::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use crate::sync::{Mutex, lock};

/// One step of a scope run: an allocation of a rounded size, or the free of the `i`-th
/// allocation of the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// An allocation of this many (rounded) bytes.
    Alloc(u64),
    /// The free of the allocation with this index in the run.
    Free(u32),
}

/// One step of a plan as the planned path reads it, 32 bytes:
///
/// ```text
///          size           span        offset                  id
///  alloc   rounded bytes  granule g   its slice in the region its buffer's id: the position
///                                                             of its free, or UNFREED | index
///  free    0              0           index of the freed      0
///                                     allocation
/// ```
///
/// A request of `bytes` is the plan's next allocation iff `size - bytes < span` (wrapping):
/// `size` is a non-zero multiple of `g`, so that is `size - g < bytes ≤ size`, the requests the
/// run's rules round to `size`. A free's span is 0: no request matches it. A planned buffer's
/// free is the plan's next step iff the run's position equals the buffer's id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub size: u64,
    pub span: u64,
    pub offset: u64,
    pub id: u64,
}

impl Entry {
    /// The step it stands for.
    #[inline]
    pub fn step(&self) -> Step {
        match self.size {
            0 => Step::Free(self.offset as u32),
            size => Step::Alloc(size),
        }
    }
}

/// The id of a planned buffer the plan never frees (an escape, a forgotten buffer): this bit
/// and its allocation index. No run reaches that position, so its drop takes the general path.
/// (A planned buffer the plan frees has the position of its free as its id.)
pub(crate) const UNFREED: u64 = 1 << 62;

/// A plan learned from one run.
#[derive(Debug)]
pub(crate) struct Learned {
    /// Size of the region.
    pub region_size: u64,
    /// The run's steps as the planned path reads them, one [`Entry`] per step. A later run
    /// follows the plan while it repeats the steps exactly.
    pub script: Script,
    /// Number of allocations before each position (`len() + 1` of them): a run following the
    /// plan knows its allocation count from its position, so the planned path keeps no count.
    allocs_before: Box<[u32]>,
    /// The allocations the run never freed, as (script position, allocation index): escapes,
    /// and scoped buffers that were forgotten. A later run that repeats the plan exactly knows
    /// its own unfreed planned slices from this list, with no scan of the script.
    pub unfreed: Vec<(u32, u32)>,
    /// The learning run's rounding granule (the `span` of every allocation, see [`Entry`]), or
    /// 0 when its rules were not "a multiple of a power of two": then the planned path never
    /// matches and a later run must use the same granule to take it.
    pub granule: u64,
}

/// A plan's steps, shared by the plan and the scopes following it (a plain `std` `Arc`:
/// immutable once made, nothing for loom to model).
pub(crate) type Script = std::sync::Arc<[Entry]>;

#[cfg(test)]
impl Learned {
    /// Offset in the region of each allocation of the run, by allocation index.
    fn offsets(&self) -> Vec<u64> {
        self.script.iter().filter(|e| e.size != 0).map(|e| e.offset).collect()
    }
}

impl Learned {
    /// Packs the lifetimes of `steps` (escapes live to the end of the run) with `align`;
    /// `granule` as in [`Learned::granule`]. `None` when the run allocated nothing or the plan
    /// would not fit the address space.
    pub fn from_steps(steps: &[Step], align: u64, granule: u64) -> Option<Learned> {
        let intervals = Self::intervals(steps);
        if intervals.is_empty() {
            return None;
        }
        let plan = pack_greedy_by_size(&intervals, align).ok()?;
        Some(Self::with_offsets(steps, &plan.offsets, plan.total_size, granule))
    }

    /// The lifetime of each allocation of `steps`: `(size, start, end)` in step positions, with
    /// escapes living to the end of the run.
    pub fn intervals(steps: &[Step]) -> Vec<(u64, u64, u64)> {
        let mut intervals: Vec<(u64, u64, u64)> = Vec::new();
        for (i, step) in steps.iter().enumerate() {
            match *step {
                Step::Alloc(size) => intervals.push((size, i as u64, steps.len() as u64)),
                Step::Free(idx) => intervals[idx as usize].2 = i as u64,
            }
        }
        intervals
    }

    /// Its first `n` steps.
    pub fn steps(&self, n: usize) -> Vec<Step> {
        self.script[..n].iter().map(Entry::step).collect()
    }

    /// Number of steps.
    pub fn len(&self) -> usize {
        self.script.len()
    }

    /// Number of allocations among the first `n` steps (`n ≤ len()`).
    #[inline]
    pub fn allocs_before(&self, n: usize) -> u32 {
        self.allocs_before[n]
    }

    /// A plan giving allocation `j` of `steps` the slice at `offsets[j]`; `granule` as in
    /// [`Learned::granule`] (0 unless every size is a non-zero multiple of it).
    pub fn with_offsets(
        steps: &[Step],
        offsets: &[u64],
        region_size: u64,
        granule: u64,
    ) -> Learned {
        let granule = match steps.iter().all(|s| match *s {
            Step::Alloc(size) => granule != 0 && size % granule == 0,
            Step::Free(_) => true,
        }) {
            true => granule,
            false => 0,
        };
        // The position of each allocation's free, by allocation index.
        let mut frees: Vec<Option<usize>> = Vec::with_capacity(offsets.len());
        let mut allocs_before = Vec::with_capacity(steps.len() + 1);
        for (pos, step) in steps.iter().enumerate() {
            allocs_before.push(frees.len() as u32);
            match *step {
                Step::Alloc(_) => frees.push(None),
                Step::Free(index) => frees[index as usize] = Some(pos),
            }
        }
        allocs_before.push(frees.len() as u32);
        let mut index = 0;
        let script = steps
            .iter()
            .map(|&step| match step {
                Step::Alloc(size) => {
                    let id = frees[index].map_or(UNFREED | index as u64, |pos| pos as u64);
                    let offset = offsets[index];
                    index += 1;
                    Entry { size, span: granule, offset, id }
                }
                Step::Free(index) => Entry { size: 0, span: 0, offset: u64::from(index), id: 0 },
            })
            .collect();
        Learned {
            region_size,
            script,
            allocs_before: allocs_before.into(),
            unfreed: Self::unfreed(steps),
            granule,
        }
    }

    /// The allocations of `steps` never freed in them, as (step position, allocation index).
    pub fn unfreed(steps: &[Step]) -> Vec<(u32, u32)> {
        let mut allocs: Vec<(u32, bool)> = Vec::new();
        for (i, step) in steps.iter().enumerate() {
            match *step {
                Step::Alloc(_) => allocs.push((i as u32, false)),
                Step::Free(idx) => {
                    if let Some(a) = allocs.get_mut(idx as usize) {
                        a.1 = true;
                    }
                }
            }
        }
        let unfreed = allocs.iter().enumerate().filter(|(_, a)| !a.1);
        unfreed.map(|(j, &(pos, _))| (pos, j as u32)).collect()
    }
}

/// An escape's pool block freed while other streams' work on it may still run: the events
/// recorded on those streams, which must complete before it joins its region.
#[derive(Debug)]
pub(crate) struct Settling {
    /// Its address (the pinned slice's offset).
    pub offset: u64,
    pub block: BatchBlock,
    /// The events, and the streams they were recorded on.
    pub events: Vec<(StreamId, EventId)>,
}

/// The memory of a plan: allocated pool blocks shared by the buffers served from it, returned
/// to the pool when the last holder (the plan, a scope run, an escaped buffer, a run whose
/// escapes it adopts) lets go.
///
/// A region made lazily is one fresh block, and offsets are relative to its `base`. A region
/// made when a scope first learns *adopts* the segments its run's escapes live in (see
/// `Shared::adopt_region`): then `base` is 0, offsets are absolute addresses, and each escape's
/// block joins the region when the escape is freed (until then its range is pinned).
#[derive(Debug)]
pub(crate) struct Region {
    /// The pool blocks making up the region, as they are accounted in the statistics.
    blocks: Mutex<Vec<BatchBlock>>,
    /// What offsets are relative to.
    pub base: u64,
    /// Bytes the plan addresses (absorbed escape blocks included).
    pub size: u64,
    /// Slices (offset, size) still used by buffers that escaped an earlier run.
    pinned: Mutex<Vec<(u64, u64)>>,
    /// Escapes freed with work on other streams still to complete: pinned until it has.
    settling: Mutex<Vec<Settling>>,
    /// Number of them, read without the lock.
    settling_count: AtomicUsize,
    /// Number of pinned slices, read without the lock on the planned fast path.
    pinned_count: AtomicUsize,
    /// Held by the one scope run serving slices from the region.
    in_use: AtomicBool,
    /// Some slice was freed with uses on other streams that nothing could order (the device
    /// refused events, waits and host syncs alike): the region is never claimed again and never
    /// returns to the pool.
    poisoned: AtomicBool,
    /// CUDA graphs holding it (a slice was freed while its stream was captured: the graph's
    /// replays may read it): no run claims it until they are gone.
    graphs: AtomicUsize,
    /// A slice was freed while a capture of another family (or of the device itself) captured
    /// its stream or a stream it was used on: that graph may use the slice for as long as it
    /// lives, which nothing here sees. The region serves no more slices, is never claimed
    /// again, and its blocks stay allocated for the allocator's life (`State::foreign_regions`).
    foreign: AtomicBool,
}

impl Region {
    pub fn new(blocks: Vec<BatchBlock>, base: u64, size: u64) -> Region {
        Region {
            blocks: Mutex::new(blocks),
            base,
            size,
            pinned: Mutex::new(Vec::new()),
            pinned_count: AtomicUsize::new(0),
            settling: Mutex::new(Vec::new()),
            settling_count: AtomicUsize::new(0),
            in_use: AtomicBool::new(false),
            poisoned: AtomicBool::new(false),
            graphs: AtomicUsize::new(0),
            foreign: AtomicBool::new(false),
        }
    }

    /// Its blocks, for the pool, once the last holder let go, and the escapes' blocks still
    /// settling (for the pool once their events complete).
    pub fn into_parts(self) -> (Vec<BatchBlock>, Vec<Settling>) {
        let blocks = self.blocks.into_inner().unwrap_or_else(|p| p.into_inner());
        (blocks, self.settling.into_inner().unwrap_or_else(|p| p.into_inner()))
    }

    /// An escape pinned at `offset` (the caller checked) was freed with work on other streams
    /// still to complete (`settling.events`): its block joins the region once that work is
    /// done ([`Region::settle`]); until then the slice stays pinned.
    pub fn absorb_later(&self, settling: Settling) {
        let mut s = lock(&self.settling);
        s.push(settling);
        self.settling_count.store(s.len(), Ordering::Release);
    }

    /// Whether escapes' blocks wait on other streams' work to join it.
    pub fn is_settling(&self) -> bool {
        self.settling_count.load(Ordering::Acquire) != 0
    }

    /// The settling escapes whose events `done` says completed join the region (their slices
    /// unpinned); the completed events go to `spent`.
    pub fn settle(&self, mut done: impl FnMut(EventId) -> bool, spent: &mut Vec<EventId>) {
        let mut s = lock(&self.settling);
        let mut joined = Vec::new();
        s.retain_mut(|e| {
            e.events.retain(|&(_, ev)| match done(ev) {
                true => {
                    spent.push(ev);
                    false
                }
                false => true,
            });
            let finished = e.events.is_empty();
            if finished {
                joined.push((e.offset, e.block));
            }
            !finished
        });
        self.settling_count.store(s.len(), Ordering::Release);
        drop(s);
        for (offset, block) in joined {
            let _ = self.absorb(block, offset);
        }
    }

    /// Whether a slice is pinned at `offset`.
    pub fn is_pinned(&self, offset: u64) -> bool {
        lock(&self.pinned).iter().any(|&(o, _)| o == offset)
    }

    /// An escape of the learning run, pinned at `offset`, was freed: its block joins the region
    /// and the slice is free for planned buffers. `false` if nothing is pinned there.
    pub fn absorb(&self, block: BatchBlock, offset: u64) -> bool {
        let mut p = lock(&self.pinned);
        let Some(i) = p.iter().position(|&(o, _)| o == offset) else { return false };
        lock(&self.blocks).push(block);
        p.swap_remove(i);
        self.pinned_count.store(p.len(), Ordering::Release);
        true
    }

    /// Claims the region for one run; `false` while another run of the scope holds it, or once
    /// it is poisoned.
    pub fn try_claim(&self) -> bool {
        !self.is_poisoned()
            && !self.is_foreign()
            && self.graphs.load(Ordering::Acquire) == 0
            && self
                .in_use
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
    }

    /// Never serve or reuse this region's memory again (see `poisoned`).
    pub fn poison(&self) {
        self.poisoned.store(true, Ordering::Release);
    }

    /// A graph holds the region: no run claims it until [`Region::graph_gone`].
    pub fn graph_holds(&self) {
        self.graphs.fetch_add(1, Ordering::AcqRel);
    }

    /// A graph that held the region is gone (its launches done).
    pub fn graph_gone(&self) {
        self.graphs.fetch_sub(1, Ordering::AcqRel);
    }

    /// A slice was freed during a foreign capture (see `foreign`): never serve, claim or return
    /// this region's memory again.
    pub fn mark_foreign(&self) {
        self.foreign.store(true, Ordering::Release);
    }

    /// Whether [`Region::mark_foreign`] was called.
    pub fn is_foreign(&self) -> bool {
        self.foreign.load(Ordering::Acquire)
    }

    /// Whether [`Region::poison`] was called.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }

    /// The pool blocks it holds (not those of escapes still settling into it).
    pub fn block_ids(&self) -> Vec<crate::pool::BlockId> {
        lock(&self.blocks).iter().map(|b| b.block).collect()
    }

    /// Whether a run claims it or a graph holds it.
    pub fn is_claimed(&self) -> bool {
        self.in_use.load(Ordering::Acquire) || self.graphs.load(Ordering::Acquire) != 0
    }

    /// Ends the current run's claim.
    pub fn unclaim(&self) {
        self.in_use.store(false, Ordering::Release);
    }

    /// Marks `[offset, offset + size)` as held by an escaped buffer.
    pub fn pin(&self, offset: u64, size: u64) {
        let mut p = lock(&self.pinned);
        p.push((offset, size));
        self.pinned_count.store(p.len(), Ordering::Release);
    }

    /// The escaped buffer at `offset` was freed.
    pub fn unpin(&self, offset: u64) {
        let mut p = lock(&self.pinned);
        if let Some(i) = p.iter().position(|&(o, _)| o == offset) {
            p.swap_remove(i);
        }
        self.pinned_count.store(p.len(), Ordering::Release);
    }

    /// Whether it adopted the learning run's own segments (`adopt.rs`): its base is 0 and its
    /// plan's offsets are the addresses of those segments, so the plan holds only with it.
    pub fn is_adopted(&self) -> bool {
        self.base == 0
    }

    /// Whether no run claims it, no graph holds it, no escaped buffer pins a slice of it and it
    /// is not poisoned: with no other holder of the `Arc`, its memory is in no one's use.
    pub fn is_idle(&self) -> bool {
        !self.in_use.load(Ordering::Acquire)
            && self.graphs.load(Ordering::Acquire) == 0
            && !self.has_pins()
            && !self.is_poisoned()
            && !self.is_foreign()
    }

    /// Whether any slice is pinned.
    pub fn has_pins(&self) -> bool {
        self.pinned_count.load(Ordering::Acquire) != 0
    }

    /// Whether `[offset, offset + size)` overlaps a pinned slice.
    pub fn overlaps_pinned(&self, offset: u64, size: u64) -> bool {
        // Pins are added at the exit of the run that held the claim, before it releases the
        // claim (Release) that this run acquired, so a zero count seen here is current; frees
        // may only lower it. A region a foreign capture's graph may use (marked before the
        // escape's free unpins its slice) serves nothing more.
        let pins = self.pinned_count.load(Ordering::Acquire);
        if self.is_foreign() {
            return true;
        }
        if pins == 0 {
            return false;
        }
        let p = lock(&self.pinned);
        p.iter().any(|&(o, s)| o < offset + size && offset < o + s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learned_offsets_reuse_memory_of_finished_allocations() {
        // a0 (4096) a1 (1024) f0 a2 (4096) f1 f2 a3 (512, escapes)
        let steps = vec![
            Step::Alloc(4096),
            Step::Alloc(1024),
            Step::Free(0),
            Step::Alloc(4096),
            Step::Free(1),
            Step::Free(2),
            Step::Alloc(512),
        ];
        let l = Learned::from_steps(&steps, 512, 512).unwrap();
        assert_eq!(l.offsets(), vec![0, 4096, 0, 0]);
        assert_eq!(l.region_size, 5120);
    }

    #[test]
    fn entries_hold_steps_ids_and_allocation_counts() {
        // a0 a1 f1 a2 f0 (a2 escapes)
        let steps = [Step::Alloc(1024), Step::Alloc(512), Step::Free(1), Step::Alloc(2048)];
        let steps = [&steps[..], &[Step::Free(0)]].concat();
        let l = Learned::from_steps(&steps, 512, 512).unwrap();
        assert_eq!((l.len(), l.steps(5), l.granule), (5, steps.clone(), 512));
        let ids: Vec<u64> = l.script.iter().map(|e| e.id).collect();
        assert_eq!(ids, vec![4, 2, 0, UNFREED | 2, 0]);
        let spans: Vec<u64> = l.script.iter().map(|e| e.span).collect();
        assert_eq!(spans, vec![512, 512, 0, 512, 0]);
        assert_eq!((0..=5).map(|n| l.allocs_before(n)).collect::<Vec<_>>(), [0, 1, 2, 2, 3, 3]);
        assert_eq!(l.unfreed, vec![(3, 2)]);
        // A size that is not a multiple of the granule: no request matches any step.
        let l = Learned::from_steps(&[Step::Alloc(1024), Step::Alloc(768)], 256, 512).unwrap();
        assert_eq!((l.granule, l.script[0].span), (0, 0));
        assert_eq!(Learned::from_steps(&steps, 512, 0).unwrap().granule, 0);
    }

    #[test]
    fn escapes_live_to_the_end_of_the_run() {
        let steps = vec![Step::Alloc(1024), Step::Alloc(1024), Step::Free(1), Step::Alloc(1024)];
        let l = Learned::from_steps(&steps, 512, 512).unwrap();
        // a0 escapes, so a2 cannot share its slice; a2 reuses a1's.
        assert_eq!(l.offsets(), vec![0, 1024, 1024]);
        assert_eq!(l.region_size, 2048);
        assert!(Learned::from_steps(&[], 512, 512).is_none());
    }

    #[test]
    fn pinned_slices() {
        let block =
            BatchBlock { block: crate::pool::BlockId(0), quadrant: 0, size: 8192, requested: 8192 };
        let r = Region::new(vec![block], 0x1000, 8192);
        r.pin(1024, 1024);
        assert!(r.overlaps_pinned(0, 1025));
        assert!(!r.overlaps_pinned(0, 1024));
        assert!(!r.overlaps_pinned(2048, 512));
        r.unpin(1024);
        assert!(!r.overlaps_pinned(0, 8192));
    }
}

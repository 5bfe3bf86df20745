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

/// A plan learned from one run.
#[derive(Debug)]
pub(crate) struct Learned {
    /// Size of the region.
    pub region_size: u64,
    /// The run's steps as the planned path reads them: `[code, offset]` per step, where the code
    /// is [`Step::code`] and the offset is the allocation's slice (0 for a free). A later run
    /// follows the plan while it repeats the codes exactly; one load pair per step.
    pub script: Script,
    /// The allocations the run never freed, as (script position, allocation index): escapes,
    /// and scoped buffers that were forgotten. A later run that repeats the plan exactly knows
    /// its own unfreed planned slices from this list, with no scan of the script.
    pub unfreed: Vec<(u32, u32)>,
    /// The largest power of two dividing every allocation's size (0 if none): a scope whose
    /// rounding granule divides it may match requests against the script with one subtraction.
    pub size_align: u64,
}

/// A plan's steps as `[code, offset]` pairs, shared by the plan and the scopes following it
/// (a plain `std` `Arc`: immutable once made, nothing for loom to model).
pub(crate) type Script = std::sync::Arc<[[u64; 2]]>;

/// The bits of a free's [`Step::code`] above the allocation index: a planned `ScopedBuffer`
/// holds its free's code as its id (see `scope.rs`), so its drop compares one word with the
/// script. (Bit 0 is 1 in every free's code and 0 in every allocation's.)
pub(crate) const FREE_TAG: u64 = (NO_SLOT as u64) << 33;

/// The slot field of a free's code (all ones): "no pool buffer", 31 bits.
pub(crate) const NO_SLOT: u32 = 0x7FFF_FFFF;

#[cfg(test)]
impl Learned {
    /// Offset in the region of each allocation of the run, by allocation index.
    fn offsets(&self) -> Vec<u64> {
        self.script.iter().filter(|[code, _]| code & 1 == 0).map(|&[_, off]| off).collect()
    }
}

impl Step {
    /// A one-word form: `size << 1` for an allocation (sizes stay far below 2^63),
    /// `FREE_TAG | index << 1 | 1` for a free.
    #[inline]
    pub fn code(self) -> u64 {
        match self {
            Step::Alloc(size) => size << 1,
            Step::Free(index) => FREE_TAG | (u64::from(index) << 1) | 1,
        }
    }

    /// The step a [`Step::code`] stands for.
    pub fn from_code(code: u64) -> Step {
        if code & 1 == 0 { Step::Alloc(code >> 1) } else { Step::Free((code >> 1) as u32) }
    }
}

impl Learned {
    /// Packs the lifetimes of `steps` (escapes live to the end of the run) with `align`.
    /// `None` when the run allocated nothing or the plan would not fit the address space.
    pub fn from_steps(steps: &[Step], align: u64) -> Option<Learned> {
        let intervals = Self::intervals(steps);
        if intervals.is_empty() {
            return None;
        }
        let plan = pack_greedy_by_size(&intervals, align).ok()?;
        Some(Self::with_offsets(steps, &plan.offsets, plan.total_size))
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
        self.script[..n].iter().map(|&[code, _]| Step::from_code(code)).collect()
    }

    /// Number of steps.
    pub fn len(&self) -> usize {
        self.script.len()
    }

    /// A plan giving allocation `j` of `steps` the slice at `offsets[j]`.
    pub fn with_offsets(steps: &[Step], offsets: &[u64], region_size: u64) -> Learned {
        let mut allocs = offsets.iter();
        let sizes = steps.iter().fold(0, |or, s| match s {
            Step::Alloc(size) => or | size,
            Step::Free(_) => or,
        });
        let size_align = match sizes {
            0 => 0,
            s => 1 << s.trailing_zeros(),
        };
        let script = steps
            .iter()
            .map(|&step| match step {
                Step::Alloc(_) => [step.code(), *allocs.next().expect("one offset per alloc")],
                Step::Free(_) => [step.code(), 0],
            })
            .collect();
        Learned { region_size, script, unfreed: Self::unfreed(steps), size_align }
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
    /// Number of pinned slices, read without the lock on the planned fast path.
    pinned_count: AtomicUsize,
    /// Held by the one scope run serving slices from the region.
    in_use: AtomicBool,
    /// Some slice was freed with uses on other streams that nothing could order (the device
    /// refused events, waits and host syncs alike): the region is never claimed again and never
    /// returns to the pool.
    poisoned: AtomicBool,
}

impl Region {
    pub fn new(blocks: Vec<BatchBlock>, base: u64, size: u64) -> Region {
        Region {
            blocks: Mutex::new(blocks),
            base,
            size,
            pinned: Mutex::new(Vec::new()),
            pinned_count: AtomicUsize::new(0),
            in_use: AtomicBool::new(false),
            poisoned: AtomicBool::new(false),
        }
    }

    /// Its blocks, for the pool, once the last holder let go.
    pub fn into_blocks(self) -> Vec<BatchBlock> {
        self.blocks.into_inner().unwrap_or_else(|p| p.into_inner())
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
            && self
                .in_use
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
    }

    /// Never serve or reuse this region's memory again (see `poisoned`).
    pub fn poison(&self) {
        self.poisoned.store(true, Ordering::Release);
    }

    /// Whether [`Region::poison`] was called.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
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

    /// Whether any slice is pinned.
    pub fn has_pins(&self) -> bool {
        self.pinned_count.load(Ordering::Acquire) != 0
    }

    /// Whether `[offset, offset + size)` overlaps a pinned slice.
    pub fn overlaps_pinned(&self, offset: u64, size: u64) -> bool {
        // Pins are added at the exit of the run that held the claim, before it releases the
        // claim (Release) that this run acquired, so a zero count seen here is current; frees
        // may only lower it.
        if self.pinned_count.load(Ordering::Acquire) == 0 {
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
        let l = Learned::from_steps(&steps, 512).unwrap();
        assert_eq!(l.offsets(), vec![0, 4096, 0, 0]);
        assert_eq!(l.region_size, 5120);
    }

    #[test]
    fn step_codes_round_trip() {
        for step in [Step::Alloc(512), Step::Alloc(1 << 48), Step::Free(0), Step::Free(u32::MAX)] {
            assert_eq!(Step::from_code(step.code()), step);
        }
        assert_ne!(Step::Alloc(2).code(), Step::Free(1).code());
        let steps = [Step::Alloc(1024), Step::Free(0), Step::Alloc(2048)];
        let l = Learned::from_steps(&steps, 512).unwrap();
        assert_eq!(l.size_align, 1024);
        assert_eq!(Step::Free(5).code(), FREE_TAG | 11);
        assert_eq!((l.len(), l.steps(2)), (3, steps[..2].to_vec()));
    }

    #[test]
    fn escapes_live_to_the_end_of_the_run() {
        let steps = vec![Step::Alloc(1024), Step::Alloc(1024), Step::Free(1), Step::Alloc(1024)];
        let l = Learned::from_steps(&steps, 512).unwrap();
        // a0 escapes, so a2 cannot share its slice; a2 reuses a1's.
        assert_eq!(l.offsets(), vec![0, 1024, 1024]);
        assert_eq!(l.region_size, 2048);
        assert!(Learned::from_steps(&[], 512).is_none());
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

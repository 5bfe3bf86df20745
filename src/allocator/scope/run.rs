//! A run's own state, which only its scope's thread touches: the cursor against the plan
//! ([`Cursor`], all the planned path reads), the rest of the run ([`Run`]: steps, unbound
//! allocations, the local cache, held pool buffers) and its hold on the plan's region.

use super::{FAST_OFF, NO_SLOT};
use crate::allocator::Buffer;
use crate::allocator::batch::BatchBlock;
use crate::allocator::plan::{Region, Script, Step};
use crate::device::{Device, DeviceAddr, StreamId};
use crate::pool::BlockId;
use crate::sync::Arc;
use std::cell::Cell;
use std::collections::HashMap;

/// An unbound allocation of the run: its index, block size, offset in the region (or
/// `NO_OFFSET`), and whether it is still live. (Bound buffers cannot outlive the scope, so
/// only unbound ones can escape.)
#[derive(Clone, Copy)]
pub(super) struct LiveEntry {
    pub(super) index: u32,
    pub(super) size: u64,
    pub(super) offset: u64,
    pub(super) live: bool,
    /// Its address, and its pool block if it has one.
    pub(super) ptr: u64,
    pub(super) block: Option<BlockId>,
}

/// A run's hold on its plan's region: one run at a time serves from a region.
pub(super) enum RegionSlot {
    /// Not used yet by this run (the plan's region, if it has one already).
    Unclaimed(Option<Arc<Region>>),
    /// This run serves planned slices from it.
    Claimed(Arc<Region>),
    /// Another run of the same scope holds it, or it could not be reserved: no planned slices.
    Denied,
}

/// Where a run stands against its plan: the planned path reads and writes only `pos`.
pub(super) struct Cursor {
    /// Number of steps taken, with `FAST_OFF` set unless the planned path may serve the next
    /// step: the run follows its plan, holds its region, has no pins to check and no planned
    /// buffer used on another stream, and the scope's rules allow it (`Scope::fast_ok`). One
    /// load and one bounds check stand for all of these (see `Scope::set_fast`).
    pub(super) pos: Cell<usize>,
    /// Whether every step so far equals the plan's step at the same position. While it does,
    /// the steps are the plan's prefix of length `len` and `Run::steps` stays empty.
    pub(super) following: Cell<bool>,
    /// Number of allocations made (the next allocation's index) once the run stopped following
    /// its plan or had none; while it follows, the plan counts them (`Learned::allocs_before`).
    pub(super) allocs: Cell<u32>,
    /// Base address of the claimed region, `NO_BASE` until claimed (or if denied).
    pub(super) base: Cell<u64>,
    /// Whether slices must be checked against pinned ones (an earlier run left escapes when
    /// the region was claimed; pins are only removed while this run holds the claim).
    pub(super) check_pins: Cell<bool>,
    /// Whether some planned buffer was used on another stream (see `Run::uses`).
    pub(super) any_uses: Cell<bool>,
    /// The step at which the run stopped following its plan (`usize::MAX`: it has not).
    pub(super) diverged_at: Cell<usize>,
    /// A CUDA graph holds the claimed region (a planned slice was freed during a capture): the
    /// run serves no more slices from it (`base` stays, for what the run's end reclaims).
    pub(super) held: Cell<bool>,
}

impl Cursor {
    /// Number of steps taken.
    #[inline]
    pub(super) fn len(&self) -> usize {
        self.pos.get() & !FAST_OFF
    }
}

pub(super) const NO_BASE: u64 = u64::MAX;

/// The rest of a run's state, owned by its scope.
pub(super) struct Run<D: Device> {
    /// The steps, once the run stopped following a plan (or had none).
    pub(super) steps: Vec<Step>,
    /// Unbound allocations, in index order, and how many are live.
    pub(super) unbound: Vec<LiveEntry>,
    pub(super) live_unbound: usize,
    pub(super) region: RegionSlot,
    /// Freed pool blocks by rounded size, ready for reuse in this run, with their address and
    /// whether their buffers' frees go straight to the pool (a stitched block's, `buffer.rs`).
    pub(super) local: HashMap<u64, Vec<(BatchBlock, DeviceAddr, bool)>>,
    /// The pool buffers behind live scoped buffers, by slot (kept here so a scoped buffer stays
    /// a few words), and the free slots.
    pub(super) held: Vec<Option<Buffer<D>>>,
    pub(super) free_slots: Vec<u32>,
    /// Planned buffers used on other streams: (allocation index, stream).
    pub(super) uses: Vec<(u32, StreamId)>,
    pub(super) misses: u64,
    /// Allocation indices that followed the plan but were served by the pool (plan misses).
    /// Every other allocation that followed the plan is a plan hit, so hits are not counted.
    pub(super) missed: Vec<u32>,
}

impl<D: Device> Run<D> {
    /// Whether every slot is taken (`NO_SLOT` pool buffers are held).
    pub(super) fn full(&self) -> bool {
        self.free_slots.is_empty() && self.held.len() >= NO_SLOT as usize
    }

    /// Keeps a pool buffer for a scoped buffer; returns its slot (`full` was checked).
    pub(super) fn hold(&mut self, buf: Buffer<D>) -> u32 {
        match self.free_slots.pop() {
            Some(i) => {
                self.held[i as usize] = Some(buf);
                i
            }
            None => {
                self.held.push(Some(buf));
                (self.held.len() - 1) as u32
            }
        }
    }

    /// Empties the local cache: its blocks in address order, the order the run's end (or the
    /// out-of-memory ladder) frees them into the pool. A free ticks the pool's clock, whose
    /// ages the garbage collection compares: in the map's order, which its hasher's random
    /// keys make differ from run to run of one program, the collection released another
    /// segment each time (found by the differential harness, `gc_mixed`).
    /// BROKEN (`scope_frees_unordered`): the map's order.
    pub(super) fn take_local(&mut self) -> Vec<BatchBlock> {
        let mut all: Vec<(BatchBlock, DeviceAddr, bool)> =
            self.local.drain().flat_map(|(_, v)| v).collect();
        if !cfg!(tidepool_broken = "scope_frees_unordered") {
            all.sort_unstable_by_key(|&(_, ptr, _)| ptr.0);
        }
        all.into_iter().map(|(b, ..)| b).collect()
    }

    pub(super) fn unhold(&mut self, slot: u32) -> Buffer<D> {
        self.free_slots.push(slot);
        self.held[slot as usize].take().expect("a held buffer")
    }

    /// Allocation `index` followed the plan but was served by the pool.
    pub(super) fn missed(&mut self, index: u32) {
        self.misses += 1;
        self.missed.push(index);
    }

    /// Marks unbound allocation `index` freed.
    pub(super) fn unbound_freed(&mut self, index: u32) {
        if let Ok(k) = self.unbound.binary_search_by_key(&index, |e| e.index) {
            self.unbound[k].live = false;
            self.live_unbound -= 1;
        }
    }
}

/// A run's hold on `region`: claimed, or denied (let go through `release_region`, so the last
/// hold returns its blocks) while another run holds it or once it is poisoned.
pub(super) fn claim_slot<D: Device>(
    shared: &crate::allocator::state::Shared<D>,
    region: Arc<Region>,
) -> RegionSlot {
    if region.try_claim() {
        // Escapes whose other streams' work is done join it first: their slices are planned.
        if region.is_settling() {
            shared.settle_claimed(&region);
        }
        return RegionSlot::Claimed(region);
    }
    shared.release_region(region);
    RegionSlot::Denied
}

/// The script of a scope without a plan: empty, made once.
pub(super) fn no_script() -> Script {
    static EMPTY: std::sync::LazyLock<Script> = std::sync::LazyLock::new(|| Script::from([]));
    EMPTY.clone()
}

//! What an unbound buffer of a scope run reaches from any thread: the run's shared queue of
//! frees ([`ScopeShared`]) and the buffer's tag ([`ScopeTag`]), which queues its free while the
//! run is open and, after it ended, hands an escaped block or slice to the region that adopted it.

use crate::allocator::batch::BatchBlock;
use crate::allocator::plan::Region;
use crate::allocator::{Buffer, Origin};
use crate::device::{Device, StreamId};
use crate::sync::atomic::{AtomicBool, Ordering};
use crate::sync::{Arc, Mutex, lock};

/// What unbound buffers of a run reach from any thread.
pub(crate) struct ScopeShared {
    pub(super) state: Mutex<SharedRun>,
    /// Set while `freed` is non-empty, so the scope's steps skip the lock when nothing is queued.
    pub(super) pending: AtomicBool,
}

pub(super) struct SharedRun {
    pub(super) open: bool,
    /// Unbound buffers freed while the run is open, in order, not yet recorded by the scope.
    pub(super) freed: Vec<u32>,
    /// The region that adopted the segments of this run's escapes (see `adopt.rs`), held until
    /// every escape pinned in it was freed (`to_absorb` of them are left).
    pub(super) adopt: Option<Arc<Region>>,
    pub(super) to_absorb: usize,
}

/// Ties an unbound buffer to the scope run that made it.
pub(crate) struct ScopeTag {
    pub(super) shared: Arc<ScopeShared>,
    pub(super) index: u32,
    /// Other streams it was used on (`record_stream`), for planned buffers, which have no pool
    /// block to hold: their free makes the owner stream wait for these streams instead.
    pub(super) uses: Mutex<Vec<StreamId>>,
    /// Whether `uses` is non-empty (so a free without uses takes no lock for them).
    pub(super) has_uses: AtomicBool,
}

impl ScopeTag {
    /// Notes a use on another stream, remembered for planned buffers.
    pub(crate) fn used_on(&self, stream: StreamId) {
        self.has_uses.store(true, Ordering::Relaxed);
        let mut uses = lock(&self.uses);
        if !uses.contains(&stream) {
            uses.push(stream);
        }
    }

    /// The other streams the buffer was used on (a copy).
    pub(crate) fn uses(&self) -> Vec<StreamId> {
        match self.has_uses.load(Ordering::Relaxed) {
            true => lock(&self.uses).clone(),
            false => Vec::new(),
        }
    }

    /// The other streams the buffer was used on (taken: called once, as it is freed).
    pub(crate) fn take_uses(&self) -> Vec<StreamId> {
        match self.has_uses.load(Ordering::Relaxed) {
            true => std::mem::take(&mut *lock(&self.uses)),
            false => Vec::new(),
        }
    }

    /// Called from `Buffer::drop`, once the buffer's memory is ordered after its uses on other
    /// streams: queues the free while the run is open (the scope may reuse a planned slice at
    /// its next step); after it ended, unpins an escaped planned slice, or hands an escaped pool
    /// block to the region that adopted its segment.
    pub(crate) fn on_drop<D: Device>(&self, buf: &mut Buffer<D>) {
        let mut run = lock(&self.shared.state);
        if run.open {
            run.freed.push(self.index);
            self.shared.pending.store(true, Ordering::Release);
            return;
        }
        match buf.origin() {
            Origin::Region(region, offset) => region.unpin(*offset),
            &Origin::Pool(block) => {
                let Some(region) = run.adopt.clone() else { return };
                if !region.is_pinned(buf.ptr.0) {
                    return; // an escape in a segment the region did not adopt
                }
                // Freed during a foreign capture of its stream (or of one it was used on): its
                // block is held for good (the buffer's drop), its slice pinned for good.
                let uses = match buf.used_elsewhere() {
                    true => buf.owner.block_uses(block),
                    false => Vec::new(),
                };
                let foreign = buf.owner.scope_free_foreign(buf.stream, &uses);
                // (Not under the run's lock: a block used on other streams takes the global one.)
                drop(run);
                let b = BatchBlock {
                    block,
                    quadrant: buf.quadrant as usize,
                    size: buf.size,
                    requested: buf.accounted,
                };
                if foreign {
                    // (Kept pinned: the region never serves the range again.)
                } else if !buf.used_elsewhere() {
                    // Taken back before the region can serve the range again.
                    buf.owner.device.note_reclaim(buf.ptr, buf.size, buf.stream);
                    region.absorb(b, buf.ptr.0);
                    buf.take_block();
                } else if buf.owner.absorb_later(&region, b, buf.ptr, buf.stream) {
                    // Joins once the other streams' work on it is done (`Region::settle`), or
                    // at once; `absorb_later` told the sanitizer.
                    if cfg!(tidepool_broken = "escape_reclaimed_late") {
                        buf.owner.device.note_reclaim(buf.ptr, buf.size, buf.stream);
                    }
                    buf.take_block();
                }
                // (Otherwise the block takes the event path to the pool, its range pinned.)
                let mut run = lock(&self.shared.state);
                run.to_absorb = run.to_absorb.saturating_sub(1);
                let last = if run.to_absorb == 0 { run.adopt.take() } else { None };
                drop(run);
                if let Some(last) = last {
                    buf.owner.release_region(last);
                }
                buf.owner.release_region(region);
            }
            Origin::None => {}
        }
    }
}

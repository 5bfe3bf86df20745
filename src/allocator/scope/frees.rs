//! A run's frees: bound buffers (planned slices and pool blocks), the queue of unbound ones
//! freed on any thread, and what a free used on other streams or during a capture needs.

use super::{Kind, NO_BASE, RegionSlot, Scope};
use crate::allocator::batch::BatchBlock;
use crate::allocator::plan::Step;
use crate::device::{Device, DeviceAddr, StreamId};
use crate::sync::atomic::Ordering;
use crate::sync::lock;

impl<D: Device> Scope<'_, D> {
    /// Records the free of a bound buffer (`id` as in [`ScopedBuffer`](super::ScopedBuffer)).
    /// The planned path, inlined: the run's position is the buffer's id, so the planned path
    /// may serve (no `FAST_OFF`: following, no planned buffer used on another stream, no
    /// sanitizer) and the plan's next step is this buffer's free (a pool buffer's or a
    /// zero-byte one's id is no position).
    #[inline(always)]
    pub(super) fn free_bound(&self, id: u64, ptr: DeviceAddr, requested: u64) {
        let c = &self.cursor;
        let pos = c.pos.get();
        // (While a stream is routed — a guard, or a capture that may hold the slice back — the
        // mask is all ones and the free takes the slow path.)
        // (Nor while a capture is underway on the device: one of another family may capture the
        // stream, and its graph may use the slice for as long as it lives.)
        // BROKEN (`foreign_scope_reused`): not asked.
        if (pos as u64 ^ id) | self.route_mask.load(Ordering::Relaxed) == 0
            && (cfg!(tidepool_broken = "foreign_scope_reused")
                || !self.alloc.shared.device.capture_underway())
        {
            c.pos.set(pos + 1);
            return;
        }
        self.free_slow(id, ptr, requested);
    }

    /// A planned slice only orders its reuse after the streams it was used on; a pool block
    /// goes to the local cache unless it was used on another stream. Frees of unbound buffers
    /// queued by other threads are recorded first (the plan may have them before this one).
    #[inline(never)]
    pub(super) fn free_slow(&self, id: u64, ptr: DeviceAddr, requested: u64) {
        let (index, slot) = match self.kind(id) {
            Kind::Zero => return,
            Kind::Planned(index) => (index, None),
            Kind::Pool(index, slot) => (index, Some(slot)),
        };
        self.drain_freed();
        self.step(Step::Free(index));
        let Some(slot) = slot else {
            // A planned slice: the plan's step, the request rounded by the run's rules.
            let size = self.round(requested).unwrap_or(0);
            self.device.note_reclaim(ptr, size, self.stream);
            let uses = match self.cursor.any_uses.get() {
                true => self.take_uses(index),
                false => Vec::new(),
            };
            // A capture that holds the slice orders its reuse after `uses` as the graph goes
            // (no event can be waited on by a captured stream now).
            if self.alloc.shared.family.captures.any() && self.hold_region(&uses) {
                return;
            }
            // A foreign capture's graph may use the slice for good: its region serves no more.
            if self.alloc.shared.scope_free_foreign(self.stream, &uses) {
                self.foreign_region();
                return;
            }
            if !uses.is_empty() && !self.alloc.shared.order_after(self.stream, &uses) {
                self.poison_region();
            }
            return;
        };
        let mut run = self.run.borrow_mut();
        let mut buf = run.unhold(slot);
        // A private pool may have served it (a guard or a capture began routing the stream on
        // another thread, or in an out-of-memory callback, after the scope checked the route):
        // its block is that pool's, freed there by the ordinary drop, never kept here.
        let ours = {
            let theirs: &crate::allocator::state::Shared<D> = &buf.owner;
            std::ptr::eq(theirs, &*self.alloc.shared)
                || self.alloc.shared.broken(crate::allocator::Broken::ScopeKeepsRouted)
        };
        // Nor while its stream is captured: the graph's replays may read it, so its drop
        // hands it to the graph (`capture/`) instead, or, for a capture of another family,
        // holds it for good (`Shared::hold_for_foreign`).
        let sh = &self.alloc.shared;
        let captured = (sh.family.captures.capturing(sh, self.stream)
            && !sh.broken(crate::allocator::Broken::CaptureScopeFrees))
            || sh.scope_free_foreign(self.stream, &[]);
        if ours
            && !captured
            && !buf.used_elsewhere()
            && self.config.caching
            && !self.recording_now()
            && let Some(block) = buf.block()
        {
            self.device.note_reclaim(buf.ptr, buf.size, self.stream);
            let b = BatchBlock {
                block,
                quadrant: buf.quadrant as usize,
                size: buf.size,
                requested: buf.accounted,
            };
            run.local.entry(buf.rounded).or_default().push((b, buf.ptr, buf.pool_only()));
            buf.take_block();
        }
        drop(run);
        drop(buf); // the ordinary stream-ordered free, unless taken into the local cache
    }

    /// The streams freed planned allocation `index` was used on (taken out of the run's
    /// record): its reuse must be ordered after them.
    #[cold]
    pub(super) fn take_uses(&self, index: u32) -> Vec<StreamId> {
        let mut others = Vec::new();
        self.run.borrow_mut().uses.retain(|&(i, s)| {
            if i == index {
                others.push(s);
            }
            i != index
        });
        others
    }

    /// A planned slice (used on `uses` too) was freed while a capture may hold it: if one does
    /// (`true`), the graph holds the claimed region, which serves no more slices in this run
    /// and is claimed by no later run until the graph is gone (its replays may read the slice),
    /// and orders its reuse after `uses` then. Broken mode `CaptureScopeFrees`: the slice is
    /// served again at once.
    #[cold]
    pub(super) fn hold_region(&self, uses: &[StreamId]) -> bool {
        let sh = &self.alloc.shared;
        if sh.broken(crate::allocator::Broken::CaptureScopeFrees) {
            return false;
        }
        let RegionSlot::Claimed(region) = &self.run.borrow().region else { return false };
        if !sh.family.captures.hold_region(sh, self.stream, uses, region) {
            return false;
        }
        self.cursor.held.set(true);
        self.set_fast();
        true
    }

    /// Nothing could order a freed planned slice's reuse: the claimed region serves no more
    /// slices in this run and is never claimed or reused again.
    #[cold]
    pub(super) fn poison_region(&self) {
        if let RegionSlot::Claimed(region) = &self.run.borrow().region {
            region.poison();
        }
        self.cursor.base.set(NO_BASE);
        self.set_fast();
    }

    /// A planned slice was freed during a foreign capture (`Shared::scope_free_foreign`): the
    /// claimed region serves no more slices in this run, and is never claimed or returned to
    /// the pool again (its plan lets go of it as the next run opens).
    #[cold]
    fn foreign_region(&self) {
        if let RegionSlot::Claimed(region) = &self.run.borrow().region {
            region.mark_foreign();
        }
        self.cursor.held.set(true);
        self.set_fast();
    }

    /// Records the frees of unbound buffers queued since the last step.
    #[inline]
    pub(super) fn drain_freed(&self) {
        if self.queued() {
            self.drain_queue();
        }
    }

    #[cold]
    fn drain_queue(&self) {
        let Some(shared) = self.shared.get() else { return };
        let freed = {
            let mut st = lock(&shared.state);
            shared.pending.store(false, Ordering::Relaxed);
            std::mem::take(&mut st.freed)
        };
        for i in freed {
            self.unbound_freed(i);
        }
        // An unbound planned slice freed during a foreign capture marked the region (before its
        // free was queued): the run serves no more slices from it.
        if let RegionSlot::Claimed(region) = &self.run.borrow().region
            && region.is_foreign()
        {
            self.cursor.held.set(true);
            self.set_fast();
        }
    }

    /// Records the free of unbound allocation `index`.
    pub(super) fn unbound_freed(&self, index: u32) {
        self.step(Step::Free(index));
        self.run.borrow_mut().unbound_freed(index);
    }
}

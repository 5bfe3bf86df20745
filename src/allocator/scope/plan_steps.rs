//! A run against its plan: the steps it takes, where it leaves the plan, and the planned slices
//! of the plan's region it serves (claiming the region at the first).

use super::{NO_BASE, RegionSlot, Scope, claim_slot};
use crate::allocator::plan::{Entry, Step};
use crate::device::{Device, DeviceAddr};

impl<D: Device> Scope<'_, D> {
    /// Takes a step; while the run still follows its plan, returns the plan's entry for it.
    #[inline]
    pub(super) fn step(&self, step: Step) -> Option<Entry> {
        let c = &self.cursor;
        let len = c.len();
        c.pos.set(c.pos.get() + 1);
        // (While the run follows, the script is its plan's.)
        if c.following.get()
            && let Some(e) = self.script.get(len)
            && e.step() == step
        {
            return Some(*e);
        }
        self.step_off_plan(len, step);
        None
    }

    /// Takes back the last step, an allocation that failed: it never happened, so neither the
    /// plan nor the run's indices may count it, and a run it made diverge follows again.
    #[cold]
    pub(super) fn unstep(&self) {
        let c = &self.cursor;
        c.pos.set(c.pos.get() - 1);
        let len = c.len();
        if c.following.get() {
            return; // the plan counts the run's allocations
        }
        c.allocs.set(c.allocs.get() - 1);
        let mut run = self.run.borrow_mut();
        run.steps.pop();
        if c.diverged_at.get() == len {
            c.following.set(true);
            c.diverged_at.set(usize::MAX);
            run.steps.clear();
            drop(run);
            self.set_fast();
        }
    }

    #[cold]
    pub(super) fn step_off_plan(&self, len: usize, step: Step) {
        let mut run = self.run.borrow_mut();
        if self.cursor.following.replace(false)
            && let Some(plan) = &self.plan
        {
            run.steps = plan.steps(len);
            self.cursor.diverged_at.set(len);
            // From now on the run counts its allocations (this one included).
            let this = u32::from(matches!(step, Step::Alloc(_)));
            self.cursor.allocs.set(plan.allocs_before(len) + this);
            self.set_fast();
        }
        run.steps.push(step);
    }

    /// The steps of the run, for learning.
    pub(super) fn take_steps(&mut self) -> Vec<Step> {
        match &self.plan {
            Some(plan) if self.cursor.following.get() => plan.steps(self.cursor.len()),
            _ => std::mem::take(&mut self.run.get_mut().steps),
        }
    }

    /// The planned slice at `offset` (of an allocation that follows the plan), if it can be
    /// served.
    #[inline]
    pub(super) fn planned(&self, offset: u64, size: u64) -> Option<DeviceAddr> {
        let c = &self.cursor;
        // While the history records (whenever the run opened), the allocator serves and
        // records every allocation: a planned slice would be in no entry.
        // BROKEN (`planned_while_recording`): the plan serves on.
        let recording = self.recording_now() && !cfg!(tidepool_broken = "planned_while_recording");
        if c.held.get() || recording {
            return None;
        }
        let base = c.base.get();
        if base == NO_BASE {
            return self.planned_claiming(offset, size);
        }
        if c.check_pins.get() && self.pinned(offset, size) {
            return None;
        }
        let ptr = DeviceAddr(base + offset);
        self.device.note_handout(ptr, size, self.stream);
        Some(ptr)
    }

    pub(super) fn pinned(&self, offset: u64, size: u64) -> bool {
        match &self.run.borrow().region {
            RegionSlot::Claimed(region) => region.overlaps_pinned(offset, size),
            _ => true,
        }
    }

    /// The first planned allocation of a run that has not claimed its plan's region yet: claims
    /// it, made on first use. `None` when another run holds it or it cannot be made (out of
    /// memory, a device error): then the whole run is served by the pool, which reports any
    /// error itself.
    #[cold]
    pub(super) fn planned_claiming(&self, offset: u64, size: u64) -> Option<DeviceAddr> {
        match self.claim(true) {
            true => self.planned(offset, size),
            false => None,
        }
    }

    /// Claims the plan's region for this run, if it was not tried yet: the plan's region, or
    /// with `make` one made now if the plan has none (the stream's cached transient segments
    /// are trimmed first so the region replaces them). `false` when there is none to claim (or
    /// `make` is false and it does not exist yet), or another run holds it; then this run
    /// serves no planned slice.
    fn claim(&self, make: bool) -> bool {
        let mut run = self.run.borrow_mut();
        let (Some(name), Some(plan)) = (self.name.as_deref(), &self.plan) else { return false };
        let RegionSlot::Unclaimed(existing) = &mut run.region else { return false };
        // The run's hold moves out of the slot; every hold lets go through `release_region`
        // (a plain drop of the last one would strand the region's blocks in the pool).
        let region = match existing.take() {
            Some(r) => r,
            None if !make => return false,
            None => match self.alloc.shared.make_region(name, self.stream, plan) {
                Ok(Some(r)) => r,
                _ => {
                    run.region = RegionSlot::Denied;
                    return false;
                }
            },
        };
        // (A denied region is let go with the run's borrow ended.)
        let slot = {
            drop(run);
            claim_slot(&self.alloc.shared, region)
        };
        let RegionSlot::Claimed(r) = &slot else {
            self.run.borrow_mut().region = slot;
            return false;
        };
        self.cursor.base.set(r.base);
        self.cursor.check_pins.set(r.has_pins());
        self.run.borrow_mut().region = slot;
        self.set_fast();
        true
    }
}

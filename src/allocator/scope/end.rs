//! A run's end: forgotten planned slices and their uses, the local cache back to the pool,
//! and what a named scope learns.

use super::{NO_BASE, NO_OFFSET, RegionSlot, Scope};
use crate::allocator::adopt::Escape;
use crate::allocator::plan::{Learned, Step};
use crate::device::{Device, DeviceAddr, StreamId};
use crate::sync::atomic::Ordering;
use crate::sync::lock;

impl<D: Device> Scope<'_, D> {
    /// At exit: the planned slices of bound buffers that were never freed (`mem::forget`) go
    /// back to the sanitizer, and the stream is ordered after every use recorded on a planned
    /// buffer that was never freed, so neither the next run nor the pool reuses the memory
    /// before those uses completed. `steps` are the run's steps unless it `followed` its plan.
    pub(super) fn reclaim_forgotten(&mut self, steps: &[Step], followed: bool) {
        let base = self.cursor.base.get();
        if let (Some(plan), true) = (&self.plan, base != NO_BASE) {
            // Planned allocations are the run's first steps that followed the plan.
            let prefix = self.followed();
            let computed;
            let unfreed = match followed {
                true => &plan.unfreed,
                false => {
                    computed = Learned::unfreed(steps);
                    &computed
                }
            };
            let run = self.run.get_mut();
            let mut forgotten = false;
            for &(pos, index) in unfreed {
                if pos as usize >= prefix
                    || run.missed.contains(&index)
                    || run.unbound.binary_search_by_key(&index, |e| e.index).is_ok()
                {
                    continue; // not a planned slice, or an unbound one (an escape)
                }
                let e = plan.script[pos as usize];
                if let Step::Alloc(size) = e.step() {
                    self.device.note_reclaim(DeviceAddr(base + e.offset), size, self.stream);
                    forgotten = true;
                }
            }
            // The run's end frees them: during a foreign capture of the stream (or of one a
            // planned buffer was used on), that graph may use them for good, and the region
            // serves and returns nothing more (as for a planned slice freed then).
            let uses: Vec<StreamId> = run.uses.iter().map(|&(_, s)| s).collect();
            if forgotten
                && self.alloc.shared.scope_free_foreign(self.stream, &uses)
                && let RegionSlot::Claimed(region) = &run.region
            {
                region.mark_foreign();
            }
        }
        let run = self.run.get_mut();
        if run.uses.is_empty() || self.alloc.shared.broken(crate::allocator::Broken::ForgottenUses)
        {
            return;
        }
        let mut others: Vec<StreamId> = run.uses.drain(..).map(|(_, s)| s).collect();
        others.sort_unstable();
        others.dedup();
        if !self.alloc.shared.order_after(self.stream, &others) {
            self.poison_region();
        }
    }

    /// Number of the run's first steps that followed its plan.
    fn followed(&self) -> usize {
        match self.cursor.following.get() {
            true => self.cursor.len(),
            false => self.cursor.diverged_at.get(),
        }
    }

    /// The run's plan hits: every allocation that followed the plan but was not a miss (the
    /// planned path counts nothing).
    fn plan_hits(&self) -> u64 {
        let followed = self.plan.as_ref().map_or(0, |p| p.allocs_before(self.followed()));
        let misses = self.run.borrow().misses;
        debug_assert!(u64::from(followed) >= misses, "{followed} allocations, {misses} misses");
        u64::from(followed).saturating_sub(misses)
    }
}

impl<D: Device> Drop for Scope<'_, D> {
    /// Ends the run: escapes are counted (planned ones pinned), the local cache goes back to the
    /// pool in one batch, and a named scope learns the run unless it followed its plan exactly.
    /// A first plan adopts the run's leftover segments (`adopt.rs`); later ones get their region
    /// when the next run first needs it.
    fn drop(&mut self) {
        let sh = &self.alloc.shared;
        // Closed under the queue's lock, held to the end: an unbound buffer freed from now on
        // finds the run closed (and any adopted region in place), one freed before is recorded.
        if let (Some(name), mark @ 1..) = (&self.name, self.learning) {
            sh.learning_ends(name, self.stream, mark);
        }
        // (A run without unbound buffers has no queue: nothing can reach it after the exit.)
        let shared = self.shared.get().cloned();
        let mut st = shared.as_ref().map(|s| lock(&s.state));
        if let Some(st) = &mut st {
            for i in std::mem::take(&mut st.freed) {
                self.unbound_freed(i);
            }
            st.open = false;
        }
        let followed = self.cursor.following.get()
            && self.plan.as_ref().is_some_and(|p| p.len() == self.cursor.len());
        let steps = if followed { Vec::new() } else { self.take_steps() };
        // Planned slices of forgotten scoped buffers: taken back, and ordered after the other
        // streams they were used on, before the region can serve or return them.
        self.reclaim_forgotten(&steps, followed);
        let hits = self.plan_hits();
        let recording = self.recording_now();
        // Nothing is learned for a stream that went (its plans were forgotten with it).
        let gone = self.gone.load(Ordering::Acquire) != self.gone_seen.get()
            && self.recheck_stream().is_err();
        let seen = self.gone_seen.get();
        let run = self.run.get_mut();
        // Pool buffers of forgotten scoped buffers: freed now, before the pool is looked at.
        run.held.clear();
        if let RegionSlot::Claimed(region) = &run.region {
            for e in run.unbound.iter().filter(|e| e.live && e.offset != NO_OFFSET) {
                region.pin(e.offset, e.size);
            }
            region.unclaim();
        }
        // Every hold on a region lets go through `release_region`, so whichever is last (the
        // plan relearned below, this scope, an escaped buffer) returns its blocks to the pool.
        let region = match std::mem::replace(&mut run.region, RegionSlot::Denied) {
            RegionSlot::Claimed(r) | RegionSlot::Unclaimed(Some(r)) => Some(r),
            _ => None,
        };
        let c = &sh.scope_counters;
        for (counter, n) in [
            (&c.escapes, run.live_unbound as u64),
            (&c.plan_hits, hits),
            (&c.plan_misses, run.misses),
        ] {
            if n != 0 {
                counter.fetch_add(n, Ordering::Relaxed);
            }
        }
        if !run.local.is_empty() {
            let blocks = run.take_local();
            sh.free_blocks(self.stream, &blocks);
        }
        if self.plan.is_some() && !followed {
            c.plan_fallbacks.fetch_add(1, Ordering::Relaxed);
        }
        let learner = if followed || recording || gone { None } else { self.name.as_deref() };
        #[cfg(tidepool_broken = "adopt")]
        drop(st); // BROKEN: an escape freed now finds the run closed and no region yet.
        let adopted = match (learner, &self.plan) {
            (Some(name), None) => {
                let escapes: Vec<Escape> = run
                    .unbound
                    .iter()
                    .filter(|e| e.live)
                    .filter_map(|e| Some(Escape { block: e.block?, ptr: e.ptr, size: e.size }))
                    .collect();
                sh.adopt_region(name, self.stream, &steps, &escapes, self.granule, seen)
            }
            _ => None,
        };
        #[cfg(tidepool_broken = "adopt")]
        let mut st = shared.as_ref().map(|s| lock(&s.state));
        // Holds let go of once the run's lock is let go (through `release_region`, so the last
        // one returns the region's blocks to the pool).
        let mut adopted_release = None;
        match (adopted, learner) {
            (Some((region, pinned)), _) => match (pinned.is_empty(), &mut st) {
                (false, Some(st)) => {
                    st.to_absorb = pinned.len();
                    st.adopt = Some(region);
                }
                // Escapes are unbound buffers, so a run that pinned any has a queue.
                _ => adopted_release = Some(region),
            },
            (None, Some(name)) => {
                let align = sh.config.load().sizing.min_block_size;
                let learned = Learned::from_steps(&steps, align, self.granule);
                sh.learn(name, self.stream, learned, seen);
            }
            (None, None) => {}
        }
        drop(st);
        for r in region.into_iter().chain(adopted_release) {
            sh.release_region(r);
        }
        if let Some((name, ring)) = self.annotation.take() {
            // BROKEN (`end_in_new_ring`): into whatever ring records now.
            match cfg!(tidepool_broken = "end_in_new_ring") {
                true => drop(sh.annotate(name, false)),
                false => lock(&ring).annotate(name, false),
            }
        }
    }
}

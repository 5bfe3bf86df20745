//! A run's pool blocks: from its local cache of blocks it freed, or from the allocator, with
//! the out-of-memory ladder's first rung (the run's own idle blocks).

use super::{NO_BASE, RegionSlot, Scope, TRANSIENT};
use crate::allocator::batch::BatchBlock;
use crate::allocator::plan::Step;
use crate::allocator::{AllocError, Buffer};
use crate::device::Device;
use crate::sync::atomic::Ordering;

impl<D: Device> Scope<'_, D> {
    /// [`Scope::pool_block`] for the allocation just stepped: the step is taken back if it
    /// fails, and also if it unwinds. The allocator runs user code on the way (out-of-memory
    /// observers, the failure callback), and a panic there that the caller catches must leave
    /// the run as an error would; else the run records an allocation that never happened, and
    /// the next run learns a plan with it.
    pub(super) fn pool_block_or_unstep(
        &self,
        bytes: u64,
        rounded: u64,
    ) -> Result<Buffer<D>, AllocError> {
        /// Takes the step back as it goes, unless disarmed.
        struct Unstep<'s, 'a, D: Device>(&'s Scope<'a, D>, bool);
        impl<D: Device> Drop for Unstep<'_, '_, D> {
            fn drop(&mut self) {
                if self.1 {
                    self.0.unstep();
                }
            }
        }
        // BROKEN: a panic in the allocator's user code leaves the step taken.
        let mut guard = Unstep(self, !cfg!(tidepool_broken = "unwind_step"));
        let r = self.pool_block(bytes, rounded);
        guard.1 = r.is_err();
        r
    }

    /// A pool block for the run: from the local cache when one of the size was freed in this
    /// run, else from the allocator.
    fn pool_block(&self, bytes: u64, rounded: u64) -> Result<Buffer<D>, AllocError> {
        // (While the history is recorded, the allocator hands out and records every block.)
        let cached = if self.recording_now() {
            None
        } else {
            let mut run = self.run.borrow_mut();
            let list = run.local.get_mut(&rounded);
            list.and_then(|v| v.pop_if(|(b, ..)| self.may_reuse(b)))
        };
        let Some((b, ptr, pool_only)) = cached else {
            // Out of memory, the run's own idle memory goes back first (`give_back_idle`).
            // BROKEN (`scope_idle_kept`): it stays out of the ladder's reach.
            let give_back =
                &mut || !cfg!(tidepool_broken = "scope_idle_kept") && self.give_back_idle();
            return self.alloc.alloc_in_giving_back(bytes, self.stream, TRANSIENT, give_back);
        };
        // A transient request may have been placed in a persistent segment's free space
        // (`residency.rs`): the block keeps its segment's residency, as when it was handed out.
        let residency = crate::allocator::stats_layout::residency_of(b.quadrant);
        let mut reused = self.alloc.hand_out(
            ptr,
            bytes,
            b.size,
            self.stream,
            Some(b.block),
            rounded,
            residency,
            b.quadrant,
        );
        // The statistics still account the block with the request it was first made for.
        reused.accounted = b.requested;
        if pool_only {
            reused.mark_pool_only(); // still a stitched block
        }
        Ok(reused)
    }

    /// The out-of-memory ladder's first rung for the run's requests (found in review: a request
    /// the allocator alone would serve failed inside a scope): returns the run's locally cached
    /// blocks to the pool (as its end would), and lets go of the region of a run that left its
    /// plan once none of the planned slices it was served is live (it serves no more). Whether
    /// anything was given back.
    #[cold]
    fn give_back_idle(&self) -> bool {
        let blocks: Vec<BatchBlock> = {
            let mut run = self.run.borrow_mut();
            run.take_local()
        };
        let any = !blocks.is_empty();
        if any {
            self.alloc.shared.free_blocks(self.stream, &blocks);
        }
        let c = &self.cursor;
        if c.following.get() || c.held.get() || c.base.get() == NO_BASE {
            return any;
        }
        let mut run = self.run.borrow_mut();
        if !matches!(run.region, RegionSlot::Claimed(_)) || !run.uses.is_empty() {
            return any;
        }
        // The planned allocations are the ones before the divergence that did not miss; one
        // not freed in the run's steps (a live buffer, an escape, a forgotten one) may still be
        // in use.
        let freed: std::collections::HashSet<u32> = run
            .steps
            .iter()
            .filter_map(|s| match s {
                Step::Free(i) => Some(*i),
                _ => None,
            })
            .collect();
        let missed: std::collections::HashSet<u32> = run.missed.iter().copied().collect();
        let before = &run.steps[..c.diverged_at.get().min(run.steps.len())];
        let allocs = before.iter().filter(|s| matches!(s, Step::Alloc(_)));
        let live = (0u32..).zip(allocs).any(|(i, _)| !missed.contains(&i) && !freed.contains(&i));
        if live {
            return any;
        }
        let RegionSlot::Claimed(region) = std::mem::replace(&mut run.region, RegionSlot::Denied)
        else {
            unreachable!("checked above")
        };
        drop(run);
        region.unclaim();
        c.base.set(NO_BASE);
        self.set_fast();
        self.alloc.shared.release_region(region);
        true
    }

    /// Whether the memory history is recorded now (whenever the run opened): the local cache
    /// neither takes nor serves blocks meanwhile, and the run learns no plan, so that what the
    /// history sees stays whole.
    pub(super) fn recording_now(&self) -> bool {
        // BROKEN (`local_while_recording`, `scopes_unrecorded`): never.
        !cfg!(tidepool_broken = "local_while_recording")
            && !cfg!(tidepool_broken = "scopes_unrecorded")
            && self.alloc.shared.recording.load(Ordering::Relaxed)
    }

    /// Whether a block the run freed into its local cache may serve a transient request now:
    /// one that sits in persistent memory (a persistent ordinary segment's free space, where
    /// the search placed it while the residencies shared free space) only while they still
    /// do, i.e. while no expandable ranges serve requests (`residency.rs`); otherwise it waits
    /// in the cache for the run's end, and the request goes to the pool.
    fn may_reuse(&self, b: &BatchBlock) -> bool {
        let sh = &self.alloc.shared;
        crate::allocator::stats_layout::residency_of(b.quadrant) == TRANSIENT
            || !sh.over_ranges(&self.alloc.config())
            || sh.broken(crate::allocator::Broken::LocalReuseAcrossRanges)
    }
}

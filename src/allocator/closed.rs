//! A closed allocator: its last handle is gone, so nothing will allocate from it again, but
//! buffers (and a `mem::forget`ten buffer or scope, for good) may still hold it.
//!
//! ```text
//!  last handle ─▶ idle plan regions, stream caches, events waited for, initial pool:
//!                 every cached segment and free page, and every pooled event, goes back to
//!                 the device now
//!  later free  ─▶ (uses on other streams: waited for on the host, as caching:false does;
//!                  so is a block left pending by a region let go of since the close)
//!              ─▶ pool ─▶ the lock is let go: its segment or pages go back if free
//!  last buffer ─▶ `Shared`'s drop: whatever is left
//! ```
//!
//! Without it, the cache stayed until the last buffer went: one forgotten 4 KiB buffer kept
//! every cached segment of the allocator on the device for the rest of the process. Now a
//! forgotten buffer keeps its own segment (or pages), as a leaked tensor keeps its block in
//! PyTorch. A forgotten named scope keeps its plan's region.

use super::*;

impl<D: Device> Shared<D> {
    /// Closes the allocator (the last handle is gone; the caller set `stash_closed` and holds
    /// the global lock, and let go of the idle plan regions before it took it): the stream
    /// caches are flushed, pending frees waited for (a counted host sync each, none during a
    /// capture) and the initial pool joins the cache, which `release_closed` then returns as
    /// the lock is let go.
    pub(super) fn close(&self, st: &mut State) {
        if cfg!(tidepool_broken = "closed_keeps_cache") {
            return; // BROKEN: the cache stays until the last buffer goes
        }
        st.initial = None;
        self.flush_all(st);
        if !self.device.capture_underway() {
            let _ = self.sync_events(st);
        }
    }

    /// What a closed allocator does as its global lock is let go: every segment and expandable
    /// page that holds no busy block goes back to the device (after its stream's work, as
    /// `empty_cache` does), as do plan regions let go of since and the pooled events. Nothing
    /// during a capture (the next section tries again) or in a pool a graph still uses (its
    /// replays write the pool's free memory: released once the graph is gone).
    #[cold]
    #[inline(never)]
    pub(super) fn release_closed(&self, st: &mut State) {
        if cfg!(tidepool_broken = "closed_keeps_cache") || self.device.capture_underway() {
            return; // BROKEN (the first): the cache stays until the last buffer goes
        }
        self.release_idle_regions_locked(st, false);
        // A block pending on events now (an escape still settling into a region let go of
        // since the close, say) is waited for on the host, as a closed allocator's frees are:
        // no later section may come to poll it. (BROKEN, `closed_pending_polled`: only polled,
        // and its memory stays until some later free.)
        if !st.pending.is_empty() && !cfg!(tidepool_broken = "closed_pending_polled") {
            let _ = self.sync_events(st);
        }
        self.process_events(st);
        let _ = self.release_segments(st, |_| true);
        if !st.vm.is_empty() {
            self.free_ranges(st, |_| true);
        }
        // The pooled events go too: a later free that needs one makes one, and it comes back
        // here. (BROKEN, `closed_keeps_events`: kept until the last buffer goes, so a forgotten
        // buffer kept every event the allocator ever pooled.)
        if !cfg!(tidepool_broken = "closed_keeps_events") && !st.free_events.is_empty() {
            let refused: Vec<Leftover> = std::mem::take(&mut st.free_events)
                .into_iter()
                .filter(|&e| self.device.destroy_event(e).is_err())
                .map(Leftover::Event)
                .collect();
            if !refused.is_empty() {
                // What the device refused: the family tries again (`leftovers.rs`).
                self.family.leftovers.add_and_retry(refused, &self.device);
            }
        }
    }
}

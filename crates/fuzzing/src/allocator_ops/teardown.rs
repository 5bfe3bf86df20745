//! The end of a program: every buffer dropped with the faults still armed, both allocators
//! served once more and dropped, and the device left holding nothing.

use super::{HandedOver, Harness, dev_err};
use std::sync::Arc;
use tidepool::device::{Device, SimDevice};

impl Harness<'_> {
    /// Ends the open scope and lets go of the faults armed; returns the device and every live
    /// buffer of both allocators (with whether it is an unbound scope buffer), for
    /// [`closed_teardown`] once the caller dropped the allocators.
    ///
    /// [`closed_teardown`]: super::closed_teardown
    pub(super) fn hand_over(mut self) -> Result<(Arc<SimDevice>, Vec<HandedOver>), String> {
        self.exit_scope()?;
        self.check()?;
        self.clear_faults()?;
        let mut buffers: Vec<_> =
            std::mem::take(&mut self.live).into_iter().map(|l| (l.buf, l.run.is_some())).collect();
        buffers.extend(std::mem::take(&mut self.others).into_iter().map(|b| (b, false)));
        // (Escapes are held to the strict rule too: one freed into a closed allocator with
        // uses on other streams is waited for on the host, so its region goes back at once.
        // Until 2026-12-05 the rule skipped programs with escapes, and a 2 MiB region stayed.)
        Ok((self.dev.clone(), buffers))
    }

    /// Ends the open scope and drops every buffer, checking after each; returns the device for
    /// [`finish`] once the caller dropped the allocator. Only plan regions may stay allocated,
    /// and with `explicit`, not past `empty_cache`.
    ///
    /// [`finish`]: super::finish
    pub(super) fn teardown(mut self, explicit: bool) -> Result<Arc<SimDevice>, String> {
        self.exit_scope()?;
        self.check()?;
        while !self.live.is_empty() {
            drop(self.live.remove(0));
            self.check()?;
        }
        while !self.others.is_empty() {
            drop(self.others.remove(0));
            self.check()?;
        }
        // Every buffer went with the faults still armed; from here the allocators must give
        // everything back.
        self.clear_faults()?;
        self.other.synchronize().map_err(|e| format!("second synchronize: {e}"))?;
        let a = self.other.stats().blocks.allocated_bytes.all.current;
        ensure!(a == 0, "the second allocator holds {a} bytes with no buffer left");
        self.alloc.synchronize().map_err(|e| format!("synchronize: {e}"))?;
        let stats = self.alloc.stats();
        let (b, regions) = (&stats.blocks, stats.plan_region_bytes);
        // (`check` bounds what regions hold by `plan_region_bytes`.)
        ensure!(
            b.active_bytes.all.current == b.allocated_bytes.all.current
                && (regions > 0
                    || b.allocated_bytes.all.current == 0 && b.requested_bytes.all.current == 0),
            "memory still active after every buffer was dropped ({regions} bytes in regions): \
             {b:?}"
        );
        if explicit {
            self.other.empty_cache().map_err(|e| format!("second empty_cache: {e}"))?;
            self.other.release_persistent().map_err(|e| format!("second release: {e}"))?;
            let kept = |i: usize| self.initial[i].map_or(0, |(_, size)| size);
            ensure!(self.other.reserved_bytes() == kept(1), "the second allocator kept memory");
            self.alloc.empty_cache().map_err(|e| format!("empty_cache: {e}"))?;
            self.alloc.release_persistent().map_err(|e| format!("release_persistent: {e}"))?;
            self.check()?;
            self.nothing_releasable(|_| true, "empty_cache + release_persistent")?;
            let mut initials: Vec<_> = self.initial.iter().flatten().copied().collect();
            initials.sort();
            let mut live = self.dev.live_segments();
            live.sort();
            // With no buffer live and no scope open every plan region is idle, and
            // `empty_cache` lets go of idle regions (it waits for escapes still settling).
            let regions = self.alloc.stats().plan_region_bytes;
            ensure!(regions == 0, "{regions} bytes of plan regions after empty_cache");
            ensure!(
                self.alloc.reserved_bytes() == kept(0) && live == initials,
                "an idle allocator kept {} bytes after empty_cache + release_persistent",
                self.alloc.reserved_bytes()
            );
        }
        self.dev.synchronize().map_err(|e| dev_err("device synchronize", e))?;
        Ok(self.dev)
    }
}

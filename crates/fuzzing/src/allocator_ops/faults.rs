//! Injected faults: which errors they explain (an out-of-memory report against the device's
//! bytes, limits and armed faults), the event faults switched around the harness's own calls,
//! and clearing them at the end.

use super::{EXCUSED, Harness, clear_faults, dev_err, excused};
use tidepool::device::{Device, StreamId};
use tidepool::{AllocError, OomReport};

impl Harness<'_> {
    /// An out-of-memory error must have a cause the harness can see.
    pub(super) fn explain_oom(&self, r: &OomReport, calls_before: u64) -> Result<(), String> {
        if r.rejected {
            // Refused before the device was asked: only past the cap (which the private pools
            // share: `family_reserved`), and only when asked to.
            let cap = r.limit.unwrap_or(r.device_total);
            ensure!(
                self.alloc.config().throw_on_oom && r.family_reserved + r.segment > cap,
                "a rejection that throw_on_cudamalloc_oom does not explain: {r:?}"
            );
            return Ok(());
        }
        if self.vm_failures() > self.vm_fail_mark.get() {
            // A physical creation or a mapping was refused in this step (an injected fault, or
            // the device full: for expandable segments the device refuses page by page).
            return Ok(());
        }
        let calls_after = self.reserve_calls();
        let nth_fired = self.nth_fires_at.is_some_and(|c| calls_before < c && c <= calls_after);
        let above = self.fail_above.is_some_and(|limit| r.segment > limit);
        let device_full = r.segment > r.device_free;
        let limited = r.over_limit();
        ensure!(
            nth_fired || above || device_full || limited,
            "unexplained out-of-memory (no injected fault, device not full, under the limit): {r:?}"
        );
        Ok(())
    }

    /// Arms the event faults `[queries, records, waits, panics]` on the device.
    pub(super) fn set_event_faults(&self, f: [bool; 4]) {
        self.dev.fail_event_queries(f[0]);
        self.dev.fail_event_records(f[1]);
        self.dev.fail_event_waits(f[2]);
        self.dev.panic_on_faults(f[3]);
        self.event_faults.set(f);
    }

    /// Counts an allocator's error for an injected fault (each is followed by the usual
    /// checks).
    pub(super) fn note_excused(&self) {
        EXCUSED.with(|c| c.set(c.get() + 1));
    }

    /// Unmaps the device refused so far (only injected).
    pub(super) fn unmaps_refused(&self) -> u64 {
        self.dev.vm_counters().failed_unmaps
    }

    /// The outcome of an allocator call that changes no model state of its own: `Ok(true)` if
    /// it succeeded, `Ok(false)` if it returned the error of an injected fault (counted), the
    /// failure otherwise.
    pub(super) fn tolerate(&self, r: Result<(), AllocError>, what: &str) -> Result<bool, String> {
        match r {
            Ok(()) => Ok(true),
            Err(e) if excused(&e) => {
                self.note_excused();
                Ok(false)
            }
            Err(e) => Err(format!("{what}: {e}")),
        }
    }

    /// Whether a fault refused an unmap in this step (a release may then keep what it could
    /// not unmap: pages stay mapped in their range, free, until a later release).
    pub(super) fn unmap_refused_in_step(&self) -> bool {
        self.unmaps_refused() > self.unmaps_refused
    }

    /// Clears every armed fault and lets go of the harness's event: from now on no device call
    /// is refused, and the allocators must keep working (a small request on the default
    /// stream is served and freed) and give everything back.
    pub(super) fn clear_faults(&mut self) -> Result<(), String> {
        clear_faults(&self.dev);
        self.event_faults.set([false; 4]);
        self.nth_fires_at = None;
        self.fail_above = None;
        self.dev.destroy_event(self.event).map_err(|e| dev_err("destroy_event", e))?;
        for a in [self.alloc, self.other] {
            match a.alloc(4096, StreamId::DEFAULT) {
                Ok(b) => drop(b),
                Err(AllocError::OutOfMemory(_)) => {}
                Err(e) => return Err(format!("a request with no fault armed: {e}")),
            }
        }
        self.check()
    }
}

//! What an allocator could not give back to the device as it went.
//!
//! An allocator (the general one or a private pool) returns everything when its last handle
//! and buffer are gone (`Shared::drop`). A call the device refuses then (an error, or a panic
//! answered as one by `Guarded`) has no later release point in that allocator, so what it held
//! moves to its family, where every allocator of the family that remains tries again: at each
//! `empty_cache` and as it goes itself. Only when the whole family is gone with the device
//! still refusing is it lost.
//!
//! ```text
//!  MemPool dropped ── Shared::drop ── vm_free refused ──▶ Family::leftovers [Free(range)]
//!                                                              │
//!  Allocator::empty_cache / Shared::drop (any of the family) ──┴─▶ retry, in order:
//!      unmap mappings ─▶ release physical allocations ─▶ free ranges ─▶ release segments
//!      ─▶ destroy events      (what is refused again stays)
//! ```
//!
//! What an allocator let go of before the work that used it was known complete (a block still
//! pending on events of other streams, or parked for a host wait, when the allocator went
//! during a capture, which refuses every wait) waits apart (`after_sync`): it is tried only
//! after a device-wide synchronisation succeeds, then joins the rest.

use super::*;
use crate::device::PhysHandle;

/// One thing to give back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Leftover {
    /// A mapping of `bytes` at `va` (`vm_unmap`).
    Unmap { va: u64, bytes: u64 },
    /// A physical allocation, unmapped (`vm_release`).
    Release(PhysHandle),
    /// A virtual range with nothing mapped (`vm_free`).
    Free { base: u64, size: u64 },
    /// A segment (`release`).
    Segment(DeviceAddr),
    /// An event (`destroy_event`).
    Event(EventId),
}

/// A family's leftovers, kept in the order they must go (the derived order: mappings before
/// their physical allocations and ranges).
#[derive(Default)]
pub(super) struct Leftovers(Mutex<Kept>);

/// The leftovers: those to try at once, and those to try after a device synchronisation.
#[derive(Default)]
struct Kept {
    now: Vec<Leftover>,
    after_sync: Vec<Leftover>,
}

impl Leftovers {
    /// Adds `items`, then tries every leftover again.
    pub(super) fn add_and_retry<D: Device>(&self, items: Vec<Leftover>, device: &Guarded<D>) {
        let mut all = lock(&self.0);
        all.now.extend(items);
        Self::retry_all(&mut all, device);
    }

    /// Adds `items`, whose memory may still be used by work no event was waited for: they are
    /// tried only after a device-wide synchronisation succeeds (none while a capture is
    /// underway). Then tries every leftover again.
    pub(super) fn add_after_sync<D: Device>(&self, items: Vec<Leftover>, device: &Guarded<D>) {
        let mut all = lock(&self.0);
        all.after_sync.extend(items);
        Self::retry_all(&mut all, device);
    }

    /// Tries every leftover again, if there is any.
    pub(super) fn retry<D: Device>(&self, device: &Guarded<D>) {
        let mut all = lock(&self.0);
        if !all.now.is_empty() || !all.after_sync.is_empty() {
            Self::retry_all(&mut all, device);
        }
    }

    fn retry_all<D: Device>(all: &mut Kept, device: &Guarded<D>) {
        if !all.after_sync.is_empty() && device.synchronize().is_ok() {
            let synced = std::mem::take(&mut all.after_sync);
            all.now.extend(synced);
        }
        Self::retry_locked(&mut all.now, device);
    }

    fn retry_locked<D: Device>(all: &mut Vec<Leftover>, device: &Guarded<D>) {
        all.sort_unstable();
        all.dedup();
        all.retain(|&item| {
            let done = match item {
                Leftover::Unmap { va, bytes } => device.vm_unmap(DeviceAddr(va), bytes),
                Leftover::Release(handle) => device.vm_release(handle),
                Leftover::Free { base, size } => device.vm_free(DeviceAddr(base), size),
                Leftover::Segment(ptr) => device.release(ptr),
                Leftover::Event(event) => device.destroy_event(event),
            };
            done.is_err()
        });
    }
}

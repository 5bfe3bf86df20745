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
pub(super) struct Leftovers(Mutex<Vec<Leftover>>);

impl Leftovers {
    /// Adds `items`, then tries every leftover again.
    pub(super) fn add_and_retry<D: Device>(&self, items: Vec<Leftover>, device: &Guarded<D>) {
        let mut all = lock(&self.0);
        all.extend(items);
        Self::retry_locked(&mut all, device);
    }

    /// Tries every leftover again, if there is any.
    pub(super) fn retry<D: Device>(&self, device: &Guarded<D>) {
        let mut all = lock(&self.0);
        if !all.is_empty() {
            Self::retry_locked(&mut all, device);
        }
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

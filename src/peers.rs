//! Allocators over one device help each other out of memory. Two libraries that each make an
//! allocator over the same `Arc<D>` (or an application that keeps one per subsystem) share the
//! device's memory but not their caches: one failed with out-of-memory while the other held
//! hundreds of MiB of free cached segments it would never use again. Before an allocation gives
//! up, the other allocators of the same kind over the same device return their free cached
//! memory — device allocators their *transient* memory, as their own `empty_cache` would
//! (persistent memory is never evicted); pinned host allocators their free blocks — and the
//! allocation is tried once more.
//!
//! ```text
//!  PEERS: [(kind, device, Weak<allocator>), …]   process-wide, dead entries pruned on insert
//!  B's request ─▶ out of memory ─▶ each other live allocator of B's kind and device:
//!                                    release its free cache ─▶ B tries once more
//! ```
//!
//! A device is its memory: the device's `memory_domain` (CUDA: its context, so two
//! `CudaDevice::new(0)` are one), else the object its `Arc` holds. No lock of the asking
//! allocator is held while a peer releases, and a peer takes only its own locks, so two
//! allocators out of memory at once, each asking the other, cannot deadlock.

use crate::device::{Device, Guarded};
#[cfg(not(loom))]
use std::sync::{Arc, Weak};

/// What an allocator does for a peer that ran out of memory.
pub(crate) trait Peer: Send + Sync {
    /// Returns its free cached memory (a device allocator: transient only); whether any went.
    #[cfg_attr(loom, allow(dead_code))] // (no list under loom: nobody asks)
    fn release_for_peer(&self) -> bool;
}

/// Which memory an allocator caches: only allocators of one kind help each other.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Kind {
    /// Device memory (general allocators; private pools are their family's).
    Device,
    /// Pinned host memory.
    PinnedHost,
}

/// An allocator of `kind`, by the memory its device allocates from ([`Key`]).
#[cfg(not(loom))]
struct Entry {
    kind: Kind,
    device: Key,
    peer: Weak<dyn Peer>,
}

#[cfg(not(loom))]
static PEERS: std::sync::Mutex<Vec<Entry>> = std::sync::Mutex::new(Vec::new());

#[cfg(not(loom))]
fn peers() -> std::sync::MutexGuard<'static, Vec<Entry>> {
    PEERS.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(not(loom))]
/// The key of `device`'s memory: its [`Device::memory_domain`] (CUDA: the context), else the
/// address of the object the `Arc` holds.
fn key_of<D: Device>(device: &Guarded<D>) -> Key {
    match device.memory_domain() {
        Some(domain) => Key::Domain(domain),
        None => Key::Object(Arc::as_ptr(device.arc()) as *const () as usize),
    }
}

/// Which memory a device object allocates from (see [`key_of`]).
#[cfg(not(loom))]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Key {
    /// A memory several objects may share ([`Device::memory_domain`]).
    Domain(u64),
    /// The object's own (its address).
    Object(usize),
}

/// Notes `peer`, an allocator of `kind` over `device`, in the process-wide list (nothing under
/// loom, which has no weak references).
pub(crate) fn join<D: Device, P: Peer + 'static>(
    kind: Kind,
    device: &Guarded<D>,
    peer: &crate::sync::Arc<P>,
) {
    #[cfg(not(loom))]
    {
        let p: Arc<dyn Peer> = peer.clone();
        register(kind, key_of(device), Arc::downgrade(&p));
    }
    #[cfg(loom)]
    let _ = (kind, device, peer);
}

/// Asks the other allocators of `kind` over `device` (all but `me`) to return their free cached
/// memory; whether any did (never under loom). Called with no allocator lock held.
pub(crate) fn ask<D: Device>(kind: Kind, device: &Guarded<D>, me: *const ()) -> bool {
    #[cfg(not(loom))]
    {
        // Families left with no general allocator lend what their dropped graphs held too.
        let orphans = kind == Kind::Device && let_go_of_orphans(device);
        release_peers(kind, key_of(device), me) | orphans
    }
    #[cfg(loom)]
    {
        let _ = (kind, device, me);
        false
    }
}

/// Notes an allocator of `kind` over `device` (and forgets the dead ones).
#[cfg(not(loom))]
fn register(kind: Kind, device: Key, peer: Weak<dyn Peer>) {
    let mut list = peers();
    list.retain(|e| e.peer.strong_count() > 0);
    list.push(Entry { kind, device, peer });
}

/// What is left of an allocator family whose general allocator's last handle went: dropped
/// graphs' holds (`Family::graph_holds`) that wait for a device synchronisation, which the
/// family holds through the allocators they free into, and which hold the family (a cycle no
/// call of the application reaches any more).
pub(crate) trait Orphan: Send + Sync {
    /// Lets go of the holds once the device synchronises (nothing while a capture is
    /// underway); whether any went.
    #[cfg_attr(loom, allow(dead_code))] // (no list under loom: nobody asks)
    fn let_go_of_holds(&self) -> bool;
}

/// A family of `device`'s memory left with no general allocator, by weak reference: its entry
/// lives as long as the family does (while its holds keep it), and dies with it.
#[cfg(not(loom))]
struct OrphanEntry {
    device: Key,
    orphan: Weak<dyn Orphan>,
}

#[cfg(not(loom))]
static ORPHANS: std::sync::Mutex<Vec<OrphanEntry>> = std::sync::Mutex::new(Vec::new());

/// Notes `orphan`, a family over `device` whose general allocator is gone (nothing under loom).
pub(crate) fn orphan<D: Device, O: Orphan + 'static>(
    device: &Guarded<D>,
    orphan: &crate::sync::Arc<O>,
) {
    #[cfg(not(loom))]
    {
        let o: Arc<dyn Orphan> = orphan.clone();
        let mut list = ORPHANS.lock().unwrap_or_else(|p| p.into_inner());
        list.retain(|e| e.orphan.strong_count() > 0);
        list.push(OrphanEntry { device: key_of(device), orphan: Arc::downgrade(&o) });
    }
    #[cfg(loom)]
    let _ = (device, orphan);
}

/// Has the orphaned families over `device`'s memory let go of their holds, where the device
/// synchronises now; whether any did. What another allocator of the device calls as its own
/// capture ends, at its `empty_cache`, out of memory and as it goes: the orphans' own calls
/// are gone. Called with no allocator lock held.
pub(crate) fn let_go_of_orphans<D: Device>(device: &Guarded<D>) -> bool {
    #[cfg(not(loom))]
    {
        let key = key_of(device);
        let orphans: Vec<Arc<dyn Orphan>> = {
            let mut list = ORPHANS.lock().unwrap_or_else(|p| p.into_inner());
            list.retain(|e| e.orphan.strong_count() > 0);
            list.iter().filter(|e| e.device == key).filter_map(|e| e.orphan.upgrade()).collect()
        };
        // (Outside the list's lock: letting go drops the families' last holds.)
        let mut any = false;
        for o in &orphans {
            any |= o.let_go_of_holds();
        }
        any
    }
    #[cfg(loom)]
    {
        let _ = device;
        false
    }
}

/// [`ask`], by key.
#[cfg(not(loom))]
fn release_peers(kind: Kind, device: Key, me: *const ()) -> bool {
    let others: Vec<Arc<dyn Peer>> = peers()
        .iter()
        .filter(|e| e.kind == kind && e.device == device)
        .filter(|e| !std::ptr::addr_eq(e.peer.as_ptr(), me))
        .filter_map(|e| e.peer.upgrade())
        .collect();
    // (Outside the registry's lock: a peer's release may drop the last hold of something that
    // registers or looks up again.)
    let mut any = false;
    for p in &others {
        any |= p.release_for_peer(); // every peer, not only until the first that had some
    }
    any
}

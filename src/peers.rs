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
    return release_peers(kind, key_of(device), me);
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

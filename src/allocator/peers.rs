//! Allocators over one device help each other out of memory. Two libraries that each make an
//! allocator over the same `Arc<D>` (or an application that keeps one per subsystem) share the
//! device's memory but not their caches: one failed with out-of-memory while the other held
//! hundreds of MiB of free cached segments it would never use again. Before an allocation gives
//! up, the other general allocators of the same device return their free cached *transient*
//! memory, as their own `empty_cache` would (persistent memory is never evicted), and the
//! allocation is tried once more.
//!
//! ```text
//!  PEERS: [(device, Weak<allocator>), …]        process-wide, dead entries pruned on insert
//!  B's request ─▶ out of memory ─▶ each other live allocator of B's device:
//!                                    empty_cache (transient) ─▶ B tries once more
//! ```
//!
//! A device is its `Arc` (the allocators share the device object). No lock of the asking
//! allocator is held while a peer releases, and a peer takes only its own locks, so two
//! allocators out of memory at once, each asking the other, cannot deadlock.

use super::*;
use std::sync::Weak;

/// What an allocator does for a peer that ran out of memory.
pub(super) trait Peer: Send + Sync {
    /// Returns the free cached transient memory; whether any reserved bytes went back.
    fn release_for_peer(&self) -> bool;
}

/// A general allocator of a device, by the device's address.
struct Entry {
    device: usize,
    peer: Weak<dyn Peer>,
}

static PEERS: std::sync::Mutex<Vec<Entry>> = std::sync::Mutex::new(Vec::new());

fn peers() -> std::sync::MutexGuard<'static, Vec<Entry>> {
    PEERS.lock().unwrap_or_else(|p| p.into_inner())
}

/// The key of `device`: the address of the object the `Arc` holds.
pub(super) fn key_of<D: Device>(device: &Arc<D>) -> usize {
    Arc::as_ptr(device) as *const () as usize
}

/// Notes a general allocator of `device` (and forgets the dead ones).
pub(super) fn register(device: usize, peer: Weak<dyn Peer>) {
    let mut list = peers();
    list.retain(|e| e.peer.strong_count() > 0);
    list.push(Entry { device, peer });
}

/// Asks every other live general allocator of `device` (all but `me`) to return its free
/// cached transient memory; whether any did. Called with no allocator lock held.
pub(super) fn release_peers(device: usize, me: *const ()) -> bool {
    let others: Vec<Arc<dyn Peer>> = peers()
        .iter()
        .filter(|e| e.device == device && !std::ptr::addr_eq(e.peer.as_ptr(), me))
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

impl<D: Device> Peer for Shared<D> {
    fn release_for_peer(&self) -> bool {
        if cfg!(tidepool_broken = "peers_kept") || self.device.capture_underway() {
            return false; // BROKEN (the first): the peers keep their caches
        }
        let _ = self.release_idle_regions();
        let mut st = self.lock_state();
        let before = st.pool.reserved_bytes();
        self.flush_all(&mut st);
        let _ = self.sync_events(&mut st);
        let _ = self.release_segments(&mut st, |s| s.key.residency == Residency::Transient);
        st.pool.reserved_bytes() < before
    }
}

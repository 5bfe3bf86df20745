//! `Buffer`: device memory handed out by the allocator, returned to it on drop.
//!
//! A buffer's memory comes from one of three places ([`Origin`]): a block of the pool, a slice
//! of a learned plan's region, or nowhere (zero bytes). A buffer made inside a scope also carries
//! a [`ScopeTag`], so the scope can record its free and keep its block for local reuse.

use super::owner::Owner;
use super::plan::Region;
use super::scope::ScopeTag;
use crate::device::{Device, DeviceAddr, StreamId};
use crate::pool::BlockId;
use crate::stats::Residency;
use crate::sync::Arc;
use crate::sync::atomic::{AtomicBool, Ordering};
use std::fmt;

/// Where a buffer's memory lives.
pub(super) enum Origin {
    /// Zero bytes, or a block a scope took back for local reuse.
    None,
    /// A block of the pool.
    Pool(BlockId),
    /// A slice of a learned plan's region, at this offset.
    Region(Arc<Region>, u64),
}

/// A piece of device memory owned by one user. Dropping it frees it, stream-ordered: its block
/// is reusable at once by later allocations on its stream, and by other streams once the uses
/// announced with [`crate::Allocator::record_stream`] have completed.
///
/// `Buffer` is `Send + Sync`: it may be dropped on any thread.
#[must_use = "dropping a Buffer frees its memory at once"]
pub struct Buffer<D: Device> {
    pub(super) ptr: DeviceAddr,
    pub(super) requested: u64,
    pub(super) size: u64,
    pub(super) stream: StreamId,
    pub(super) origin: Origin,
    pub(super) scope: Option<ScopeTag>,
    pub(super) owner: Arc<Owner<D>>,
    /// The requested bytes its block is accounted with in the statistics: `requested`, except
    /// for a block a scope reused locally for another request of the same rounded size.
    pub(super) accounted: u64,
    /// The rounded request it served: with the residency, its class in the stream cache.
    pub(super) rounded: u64,
    pub(super) residency: Residency,
    /// Its statistics quadrant (pool kind × residency).
    pub(super) quadrant: u8,
    /// Set by `record_stream` when another stream uses it: its free must then take the slow
    /// path (events), never the stream cache. The uses themselves sit in the locked state.
    pub(super) used_elsewhere: AtomicBool,
}

impl<D: Device> Buffer<D> {
    /// Whether `record_stream` recorded a use on another stream.
    pub(super) fn used_elsewhere(&self) -> bool {
        #[cfg(tidepool_broken = "events")]
        return false; // BROKEN: forgets the recorded uses, so the block skips its events.
        #[cfg(not(tidepool_broken = "events"))]
        return self.used_elsewhere.load(Ordering::Acquire);
    }

    pub(super) fn mark_used_elsewhere(&self) {
        self.used_elsewhere.store(true, Ordering::Release);
    }
}

impl<D: Device> Buffer<D> {
    /// The device address of the first byte ([`DeviceAddr::NULL`] for a zero-byte buffer).
    pub fn ptr(&self) -> DeviceAddr {
        self.ptr
    }

    /// Bytes asked for.
    pub fn len(&self) -> u64 {
        self.requested
    }

    /// Whether this is a zero-byte buffer (it holds no device memory).
    pub fn is_empty(&self) -> bool {
        self.requested == 0
    }

    /// Bytes of the block behind it (the request rounded up; 0 for a zero-byte buffer).
    pub fn block_size(&self) -> u64 {
        self.size
    }

    /// The stream it was allocated on, which owns it.
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// Whether it was served from a learned plan's region.
    pub fn is_planned(&self) -> bool {
        matches!(self.origin, Origin::Region(..))
    }

    /// The pool block behind it, if any.
    pub(super) fn block(&self) -> Option<BlockId> {
        match self.origin {
            Origin::Pool(b) => Some(b),
            _ => None,
        }
    }

    /// The device its memory lives on (the allocator's device).
    pub fn device(&self) -> &Arc<D> {
        &self.owner.device
    }
}

impl<D: Device> Drop for Buffer<D> {
    fn drop(&mut self) {
        let uses = match self.scope.take() {
            Some(tag) => tag.on_drop(self),
            None => Vec::new(),
        };
        match std::mem::replace(&mut self.origin, Origin::None) {
            Origin::Pool(block) => {
                let freed = Freed {
                    block,
                    ptr: self.ptr,
                    size: self.size,
                    requested: self.accounted,
                    stream: self.stream,
                    rounded: self.rounded,
                    residency: self.residency,
                    quadrant: self.quadrant as usize,
                    used_elsewhere: self.used_elsewhere(),
                };
                self.owner.free(freed);
            }
            Origin::Region(region, _) => {
                self.owner.device.note_reclaim(self.ptr, self.size, self.stream);
                self.owner.order_after(self.stream, &uses);
                self.owner.release_region(region);
            }
            Origin::None => {}
        }
    }
}

/// What the allocator needs to know about a buffer being freed.
pub(super) struct Freed {
    pub(super) block: BlockId,
    pub(super) ptr: DeviceAddr,
    pub(super) size: u64,
    pub(super) requested: u64,
    pub(super) stream: StreamId,
    pub(super) rounded: u64,
    pub(super) residency: Residency,
    pub(super) quadrant: usize,
    pub(super) used_elsewhere: bool,
}

impl<D: Device> fmt::Debug for Buffer<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("ptr", &self.ptr)
            .field("len", &self.requested)
            .field("block_size", &self.size)
            .field("stream", &self.stream)
            .field("planned", &self.is_planned())
            .finish()
    }
}

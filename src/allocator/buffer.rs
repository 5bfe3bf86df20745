//! `Buffer`: device memory handed out by the allocator, returned to it on drop.
//!
//! A buffer's memory comes from one of three places ([`Origin`]): a block of the pool, a slice
//! of a learned plan's region, or nowhere (zero bytes). A buffer made inside a scope also carries
//! a [`ScopeTag`], so the scope can record its free and keep its block for local reuse.

use super::Shared;
use super::plan::Region;
use super::scope::ScopeTag;
use crate::device::{Device, DevicePtr, StreamId};
use crate::pool::BlockId;
use crate::sync::Arc;
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
pub struct Buffer<D: Device> {
    pub(super) ptr: DevicePtr,
    pub(super) requested: u64,
    pub(super) size: u64,
    pub(super) stream: StreamId,
    pub(super) origin: Origin,
    pub(super) scope: Option<ScopeTag>,
    pub(super) owner: Arc<Shared<D>>,
}

impl<D: Device> Buffer<D> {
    pub(super) fn empty(stream: StreamId, owner: Arc<Shared<D>>) -> Buffer<D> {
        Buffer {
            ptr: DevicePtr::NULL,
            requested: 0,
            size: 0,
            stream,
            origin: Origin::None,
            scope: None,
            owner,
        }
    }

    /// The device address of the first byte ([`DevicePtr::NULL`] for a zero-byte buffer).
    pub fn ptr(&self) -> DevicePtr {
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
            Origin::Pool(block) => self.owner.free(block, self.ptr, self.size, self.stream),
            Origin::Region(region, _) => {
                self.owner.device.note_reclaim(self.ptr, self.size, self.stream);
                self.owner.order_after(self.stream, &uses);
                self.owner.release_region(region);
            }
            Origin::None => {}
        }
    }
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

//! `Buffer`: device memory handed out by the allocator, returned to it on drop.

use super::Shared;
use crate::device::{Device, DevicePtr, StreamId};
use crate::pool::BlockId;
use crate::sync::Arc;
use std::fmt;

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
    pub(super) block: Option<BlockId>,
    pub(super) owner: Arc<Shared<D>>,
}

impl<D: Device> Buffer<D> {
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

    /// The device its memory lives on (the allocator's device).
    pub fn device(&self) -> &Arc<D> {
        &self.owner.device
    }
}

impl<D: Device> Drop for Buffer<D> {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            self.owner.free(block, self.ptr, self.size, self.stream);
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
            .finish()
    }
}

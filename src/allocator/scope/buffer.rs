//! [`ScopedBuffer`]: a scope's buffer, one word of id beside its address (see its docs), freed
//! into its run when dropped.

use super::{NO_INDEX, NO_SLOT, POOL, Scope, ZERO_ID};
use crate::allocator::AllocError;
use crate::device::{Device, DeviceAddr, StreamId};
use crate::sync::Arc;

/// A buffer of a [`Scope`]; it cannot outlive the scope, nor leave its thread (the scope's
/// run state is not synchronised, which is what makes a planned allocation a few nanoseconds):
///
/// ```compile_fail
/// use std::sync::Arc;
/// use tidepool::{Allocator, Config, SimDevice, StreamId};
/// let alloc = Allocator::new(Arc::new(SimDevice::new(1 << 30)), Config::default()).unwrap();
/// let scope = alloc.scope(StreamId::DEFAULT);
/// let buf = scope.alloc(4096).unwrap();
/// std::thread::scope(|t| {
///     t.spawn(move || drop(buf)); // error: `ScopedBuffer` cannot be sent between threads
/// });
/// ```
///
/// Memory that another thread frees comes from [`Scope::alloc_unbound`] instead.
#[must_use = "dropping a ScopedBuffer frees its memory at once"]
pub struct ScopedBuffer<'s, D: Device> {
    pub(super) scope: &'s Scope<'s, D>,
    pub(super) ptr: DeviceAddr,
    pub(super) requested: u64,
    /// What it is, in one word (see [`Scope::kind`]):
    ///
    /// ```text
    ///  planned, freed by the plan   position of its free in the script   (< 2^62)
    ///  planned, never freed by it   UNFREED | allocation index           (01 in the top bits)
    ///  pool buffer                  POOL | slot << 32 | allocation index (11; slot in `Run::held`)
    ///  zero bytes                   ZERO_ID                              (all ones)
    /// ```
    ///
    /// The run's position (`Cursor::pos`) equals the id only for a planned buffer whose free is
    /// the plan's next step while the planned path may serve, so its drop is one comparison.
    pub(super) id: u64,
}

/// What a [`ScopedBuffer::id`] stands for.
#[derive(Clone, Copy)]
pub(super) enum Kind {
    Zero,
    /// A planned slice, with its allocation index.
    Planned(u32),
    /// A pool buffer: its allocation index and slot.
    Pool(u32, u32),
}

/// The id of a pool buffer (see [`ScopedBuffer::id`]).
#[inline]
pub(super) const fn pool_id(index: u32, slot: u32) -> u64 {
    POOL | (slot as u64) << 32 | index as u64
}

// A zero-byte buffer's id is no pool buffer's (slot `NO_SLOT` is never held).
const _: () = assert!(pool_id(NO_INDEX, NO_SLOT) == ZERO_ID);

impl<D: Device> ScopedBuffer<'_, D> {
    fn kind(&self) -> Kind {
        self.scope.kind(self.id)
    }

    /// The device address of the first byte ([`DeviceAddr::NULL`] for a zero-byte buffer).
    pub fn ptr(&self) -> DeviceAddr {
        self.ptr
    }

    /// Bytes asked for.
    pub fn len(&self) -> u64 {
        self.requested
    }

    /// Whether this is a zero-byte buffer.
    pub fn is_empty(&self) -> bool {
        self.requested == 0
    }

    /// Bytes of the block or slice behind it.
    pub fn block_size(&self) -> u64 {
        match self.kind() {
            Kind::Zero => 0,
            // A planned slice is the plan's step, which is the request rounded by the run's rules.
            Kind::Planned(_) => self.scope.round(self.requested).unwrap_or(0),
            Kind::Pool(_, slot) => {
                self.scope.run.borrow().held[slot as usize].as_ref().map_or(0, |b| b.size)
            }
        }
    }

    /// The scope's stream, which owns it.
    pub fn stream(&self) -> StreamId {
        self.scope.stream
    }

    /// The device its memory lives on (the scope's allocator's).
    pub(crate) fn device(&self) -> &Arc<D> {
        self.scope.alloc.device()
    }

    /// Whether it was served from the learned plan's region.
    pub fn is_planned(&self) -> bool {
        matches!(self.kind(), Kind::Planned(_))
    }

    /// Marks it as used on `stream` too (see [`Allocator::record_stream`]): it is no longer
    /// reused locally, and its reuse is ordered after `stream`'s work.
    ///
    /// [`Allocator::record_stream`]: crate::Allocator::record_stream
    pub fn record_stream(&self, stream: StreamId) -> Result<(), AllocError> {
        self.scope.alloc.shared.stream_exists(stream)?;
        if stream == self.scope.stream {
            return Ok(());
        }
        let mut run = self.scope.run.borrow_mut();
        match self.kind() {
            Kind::Zero => {}
            Kind::Pool(_, slot) => {
                if let Some(buf) = &run.held[slot as usize] {
                    self.scope.alloc.shared.record_use(buf, stream)?;
                }
            }
            Kind::Planned(index) => {
                if !run.uses.contains(&(index, stream)) {
                    run.uses.push((index, stream));
                    self.scope.cursor.any_uses.set(true);
                    self.scope.set_fast();
                }
            }
        }
        Ok(())
    }
}

impl<D: Device> Drop for ScopedBuffer<'_, D> {
    #[inline(always)]
    fn drop(&mut self) {
        self.scope.free_bound(self.id, self.ptr, self.requested);
    }
}

impl<D: Device> std::fmt::Debug for ScopedBuffer<'_, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScopedBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.requested)
            .field("block_size", &self.block_size())
            .field("stream", &self.scope.stream)
            .field("planned", &self.is_planned())
            .finish()
    }
}

//! Aligned allocations (`Allocator::alloc_aligned`, after RMM's `aligned_resource_adaptor`): a
//! block that starts at a multiple of any power of two up to the segment size of its pool.
//!
//! ```text
//!  align ≤ MIN_ALIGN (256)  ─▶ alloc_in: every block already starts there
//!  align > MIN_ALIGN        ─▶ slow path only (no stream cache, no large-block reuse):
//!     best fit that holds an aligned run ─▶ padding split off as a free block ─▶ allocate
//!     else a segment of ≥ rounded + align − MIN_ALIGN (new, another stream's, or grown)
//! ```
//!
//! Freed, an aligned block goes wherever any block goes (its stream cache too) and coalesces
//! with its padding again in the pool. Scopes have no aligned allocation: plans pack blocks at
//! offsets of their rounded sizes.

use super::*;
use crate::config::MIN_ALIGN;
use crate::stats::PoolKind;

impl<D: Device> Allocator<D> {
    /// Allocates `bytes` of transient memory on `stream` at an address that is a multiple of
    /// `align`: any power of two up to the segment size of the request's pool (`small_segment_mb`
    /// for requests up to `small_size_mb`, else `large_segment_mb`). Every pointer is at least
    /// 256-byte aligned anyway; above that the allocation takes the slow path. A bad `align` is
    /// [`AllocError::InvalidAlignment`].
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::{Allocator, Config, SimDevice, StreamId};
    /// let alloc = Allocator::new(Arc::new(SimDevice::new(1 << 30)), Config::default()).unwrap();
    /// let _pad = alloc.alloc(512, StreamId::DEFAULT).unwrap();
    /// let a = alloc.alloc_aligned(1000, 64 << 10, StreamId::DEFAULT).unwrap();
    /// assert_eq!(a.ptr().0 % (64 << 10), 0);
    /// assert!(alloc.alloc_aligned(1000, 3000, StreamId::DEFAULT).is_err());
    /// ```
    pub fn alloc_aligned(
        &self,
        bytes: u64,
        align: u64,
        stream: StreamId,
    ) -> Result<Buffer<D>, AllocError> {
        self.alloc_aligned_in(bytes, align, stream, Residency::Transient)
    }

    /// [`Allocator::alloc_aligned`] with the given residency.
    pub fn alloc_aligned_in(
        &self,
        bytes: u64,
        align: u64,
        stream: StreamId,
        residency: Residency,
    ) -> Result<Buffer<D>, AllocError> {
        let config = self.shared.config.load();
        let z = &config.sizing;
        let max = match z.round(bytes).map(|r| z.kind(r)) {
            Some(PoolKind::Small) => z.small_segment,
            _ => z.large_segment,
        };
        if !align.is_power_of_two() || align > max {
            return Err(AllocError::InvalidAlignment { align, max });
        }
        drop(config);
        let align = if align <= MIN_ALIGN { 0 } else { align };
        self.alloc_with_retries(bytes, stream, residency, align)
    }
}

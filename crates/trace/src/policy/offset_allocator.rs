//! The `offset-allocator` crate (a port of Sebastian Aaltonen's O(1) two-level segregated-fit
//! allocator: 256 size bins on a small-float scale, bitmasks to find a non-empty bin) as a
//! fixed-heap baseline. Its sizes are `u32`, so it counts 256-byte granules; see
//! [`super::fixed_heap`] for heap sizing.

use offset_allocator::{Allocation, Allocator};

use super::fixed_heap::{self, SubAllocator};
use super::{Policy, PolicyResult, ReplayError};
use crate::event::Trace;

/// The `offset-allocator` baseline.
#[derive(Debug, Clone, Copy, Default)]
pub struct OffsetAllocatorPolicy;

struct Heap(Allocator);

impl SubAllocator for Heap {
    type Handle = Allocation;
    const NAME: &'static str = "offset-allocator";
    const MAX_HEAP: u64 = u32::MAX as u64;

    fn with_heap(granules: u64, max_live: usize) -> Result<Self, ReplayError> {
        let size = u32::try_from(granules)
            .map_err(|_| ReplayError::new(Self::NAME, "heap larger than 2^32 granules"))?;
        // Each live allocation holds a node, and free regions between them one more each.
        let nodes = max_live
            .checked_mul(2)
            .and_then(|n| n.checked_add(8))
            .and_then(|n| u32::try_from(n).ok())
            .filter(|&n| n < u32::MAX - 2)
            .ok_or_else(|| ReplayError::new(Self::NAME, "too many live allocations"))?;
        Ok(Heap(Allocator::with_max_allocs(size, nodes)))
    }

    fn alloc(&mut self, granules: u64) -> Option<(u64, Allocation)> {
        let a = self.0.allocate(u32::try_from(granules).ok()?)?;
        Some((u64::from(a.offset), a))
    }

    fn free(&mut self, handle: Allocation) {
        self.0.free(handle);
    }
}

impl Policy for OffsetAllocatorPolicy {
    fn name(&self) -> &'static str {
        Heap::NAME
    }

    fn replay(&self, trace: &Trace, timeline: bool) -> Result<PolicyResult, ReplayError> {
        fixed_heap::replay::<Heap>(trace, timeline)
    }
}

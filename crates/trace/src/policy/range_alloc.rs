//! The `range-alloc` crate (a sorted `Vec` of free ranges, best fit by linear scan, merging
//! neighbours on free) as a fixed-heap baseline, counting 256-byte granules like the other
//! sub-allocator; see [`super::fixed_heap`] for heap sizing.

use std::ops::Range;

use range_alloc::RangeAllocator;

use super::fixed_heap::{self, GRANULE, SubAllocator};
use super::{Policy, PolicyResult, ReplayError};
use crate::event::Trace;

/// The `range-alloc` baseline.
#[derive(Debug, Clone, Copy, Default)]
pub struct RangeAllocPolicy;

struct Heap(RangeAllocator<u64>);

impl SubAllocator for Heap {
    type Handle = (u64, u64);
    const NAME: &'static str = "range-alloc";
    // Byte counts must fit in u64, and the crate asserts `len + len` does not overflow.
    const MAX_HEAP: u64 = u64::MAX / GRANULE;

    fn with_heap(granules: u64, _max_live: usize) -> Result<Self, ReplayError> {
        Ok(Heap(RangeAllocator::new(0..granules)))
    }

    fn alloc(&mut self, granules: u64) -> Option<(u64, (u64, u64))> {
        let r: Range<u64> = self.0.allocate_range(granules).ok()?;
        Some((r.start, (r.start, r.end)))
    }

    fn free(&mut self, (start, end): (u64, u64)) {
        self.0.free_range(start..end);
    }
}

impl Policy for RangeAllocPolicy {
    fn name(&self) -> &'static str {
        Heap::NAME
    }

    fn replay(&self, trace: &Trace, timeline: bool) -> Result<PolicyResult, ReplayError> {
        fixed_heap::replay::<Heap>(trace, timeline)
    }
}

//! Block and segment records. Both live in slabs and refer to each other by index, never by
//! pointer: a segment knows its first block, each block its neighbours in address order.
//!
//! ```text
//!  segment ──first──▶ [block A] ⇄ [block B] ⇄ [block C]      A.addr + A.size == B.addr, ...
//! ```

pub use crate::types::BlockState;
use crate::types::{PoolKind, Residency, StreamId};

/// Index of a block record in the pool's slab. Stable while the block exists.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct BlockId(pub(crate) usize);

/// Index of a segment record in the pool's slab.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct SegmentId(pub(crate) usize);

/// Which free lists a block belongs to: residency, owning stream and size class.
/// Blocks of different keys never share a segment.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct PoolKey {
    /// Persistent or transient.
    pub residency: Residency,
    /// The stream the segment was reserved for.
    pub stream: StreamId,
    /// Small or large pool.
    pub kind: PoolKind,
}

/// A contiguous piece of a segment.
#[derive(Clone, Debug)]
pub struct Block {
    /// Segment holding the block.
    pub segment: SegmentId,
    /// First address.
    pub addr: u64,
    /// Size in bytes (a multiple of the rounding granularity).
    pub size: u64,
    /// Bytes the user asked for (0 while free).
    pub requested: u64,
    /// Neighbour at the lower address, in the same segment.
    pub prev: Option<BlockId>,
    /// Neighbour at the higher address, in the same segment.
    pub next: Option<BlockId>,
    /// Free, allocated or pending.
    pub state: BlockState,
    /// Allocated while at least the pool's oversize size (`max_split_size`): counted in
    /// `oversize_allocations` until freed.
    pub oversize: bool,
}

impl Block {
    /// Whether the block shares its segment with other blocks.
    pub fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
}

/// One device reservation (`cuMemAlloc`).
#[derive(Clone, Debug)]
pub struct Segment {
    /// First address.
    pub base: u64,
    /// Size in bytes.
    pub size: u64,
    /// The free lists its blocks belong to.
    pub key: PoolKey,
    /// The block at `base`.
    pub first: BlockId,
    /// The block at its end (kept by every split, merge and join: expandable growth finds a
    /// run's end block without walking the run).
    pub last: BlockId,
    /// Blocks that are allocated or pending (a segment with none can be released).
    pub busy_blocks: usize,
    /// The slot of its key's free index in the pool.
    pub(super) slot: usize,
    /// The pool's clock when a block of it was last allocated or freed: the segment with the
    /// smallest has been idle longest.
    pub last_use: u64,
    /// A run of an expandable range's mapped pages (`Pool::extend`), not a device segment:
    /// its free blocks are in no inactive-split figure (PyTorch leaves expandable segments out
    /// of `inactive_split`: their free whole pages can always be released).
    pub expandable: bool,
}

//! Aligned allocations (`Allocator::alloc_aligned`): the best-fit free block that holds an
//! aligned run of the rounded size, and the split that gives the padding in front of it back to
//! the free index as a block of its own (so no byte is lost: it coalesces again when the aligned
//! block is freed).
//!
//! ```text
//!  free block  [ pad │ aligned block (rounded) │ rest ]      pad = align_up(addr, align) − addr
//!  split_front ──▶ [pad: free][ free from the aligned address ]  ──allocate──▶ rest split as usual
//! ```

use super::{Block, BlockId, BlockState, Entry, Pool, PoolKey, Sizing};

/// Bytes from `addr` up to the next multiple of `align` (a power of two).
pub fn padding(addr: u64, align: u64) -> u64 {
    addr.wrapping_neg() & (align - 1)
}

impl Pool {
    /// The first free block of `key` in best-fit order (size, address) that holds `rounded`
    /// bytes at an `align`-aligned address, unless the size rules forbid spending it on this
    /// request. Visits the blocks from the best fit upward until one fits.
    pub fn find_free_aligned(
        &self,
        key: PoolKey,
        rounded: u64,
        align: u64,
        sizing: &Sizing,
    ) -> Option<BlockId> {
        let index = &self.free[self.slot_of(key)?].index;
        let mut e = index.best_fit(rounded);
        while let Some(c) = e {
            if !sizing.may_serve(c.size, rounded) {
                // Larger blocks are no better: `may_serve` only refuses more as blocks grow.
                return None;
            }
            if c.size >= rounded + padding(c.addr, align) {
                return Some(BlockId(c.id));
            }
            e = index.next_after(&c);
        }
        None
    }

    /// Splits the padding in front of the first `align`-aligned address off the free block `id`,
    /// leaving it a free block of its own; returns the free block that starts at the aligned
    /// address (`id` itself when there is no padding). The caller checked that the block holds
    /// the aligned request.
    pub fn split_front(&mut self, id: BlockId, align: u64) -> BlockId {
        let b = &self.blocks[id.0];
        assert_eq!(b.state, BlockState::Free, "split_front of a block that is not free");
        let pad = padding(b.addr, align);
        if pad == 0 {
            return id;
        }
        assert!(pad < b.size, "split_front: no aligned address in the block");
        let (seg, addr, size, was_split) = (b.segment, b.addr, b.size, b.is_split());
        let slot = self.segments[seg.0].slot;
        self.index_remove(slot, &Entry { size, addr, id: id.0 });
        let mut net = (0, 0);
        if was_split {
            self.split_change(seg, &mut net, size, false);
        }
        let next = self.blocks[id.0].next;
        let rest = BlockId(self.blocks.insert(Block {
            segment: seg,
            addr: addr + pad,
            size: size - pad,
            requested: 0,
            prev: Some(id),
            next,
            state: BlockState::Free,
            oversize: false,
        }));
        match next {
            Some(n) => self.blocks[n.0].prev = Some(rest),
            None => self.segments[seg.0].last = rest,
        }
        let front = &mut self.blocks[id.0];
        front.size = pad;
        front.next = Some(rest);
        // Both halves are free blocks of a split segment now. (Two adjacent free blocks exist
        // only until the caller allocates `rest`, under the same lock.)
        self.index_insert(slot, Entry { size: pad, addr, id: id.0 });
        self.split_change(seg, &mut net, pad, true);
        self.index_insert(slot, Entry { size: size - pad, addr: addr + pad, id: rest.0 });
        self.split_change(seg, &mut net, size - pad, true);
        self.count_split_net(seg, net);
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{PoolKind, Residency, StreamId};

    const KEY: PoolKey = PoolKey {
        residency: Residency::Transient,
        stream: StreamId::DEFAULT,
        kind: PoolKind::Small,
    };

    #[test]
    fn padding_to_the_next_multiple() {
        assert_eq!(padding(0x1000, 4096), 0);
        assert_eq!(padding(0x1200, 4096), 0xe00);
        assert_eq!(padding(0x1200, 512), 0);
        assert_eq!(padding(0x1100, 512), 0x100);
    }

    #[test]
    fn aligned_fit_splits_the_padding_off_and_coalesces_back() {
        let s = Sizing::default();
        let mut p = Pool::new();
        // A segment at 0x10_0200: the first 4 KiB-aligned address is 0x10_1000.
        let seg = p.add_segment(KEY, 0x10_0200, 0x4000);
        assert_eq!(p.find_free_aligned(KEY, 512, 4096, &s), Some(seg));
        // Too small once the padding is counted: 0x4000 - 0xe00 < 0x3400.
        assert_eq!(p.find_free_aligned(KEY, 0x3400, 4096, &s), None);
        let at = p.split_front(seg, 4096);
        assert_eq!(p.block(at).addr, 0x10_1000);
        assert_eq!((p.block(seg).addr, p.block(seg).size), (0x10_0200, 0xe00));
        let a = p.allocate(at, 512, 500, &s);
        assert_eq!(p.block(a).addr, 0x10_1000);
        p.check_invariants().unwrap();
        assert_eq!(p.stats().allocated_bytes.all.current, 512);
        assert_eq!(p.stats().inactive_split_bytes.all.current, 0x4000 - 512);
        assert_eq!(p.stats().inactive_split.all.current, 2);
        // Freed, the three pieces are one free block again: nothing lost.
        p.free(a);
        p.check_invariants().unwrap();
        assert_eq!(p.free_blocks(), 1);
        assert_eq!(p.stats().inactive_split_bytes.all.current, 0);
        assert_eq!(p.releasable_segments(|_| true).len(), 1);
    }

    #[test]
    fn aligned_fit_skips_blocks_that_only_fit_unaligned() {
        let s = Sizing::default();
        let mut p = Pool::new();
        // Two free blocks of 2 KiB: one at a misaligned address (best fit by size, lower), one
        // aligned.
        p.add_segment(KEY, 0x20_0200, 0x800);
        let good = p.add_segment(KEY, 0x30_0000, 0x800);
        assert_eq!(p.find_free_aligned(KEY, 0x800, 4096, &s), Some(good));
        assert_eq!(p.split_front(good, 4096), good, "no padding, no split");
        p.check_invariants().unwrap();
    }
}
